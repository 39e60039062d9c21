"""Recorded plans kept on disk (runtime/plan_cache.py): read back, they run exactly as the
recorded ones; a stale, damaged or forged file is never run, it is removed and the plan
recorded again; processes storing the same plan at once leave one whole file."""
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import llambda
from llambda.model import convert
from llambda.model.forward import KeptPlan
from llambda.runtime import library, plan_cache
from llambda.runtime.recorder import PlanRecorder
from synth import write_random_llama

pytestmark = pytest.mark.skipif(os.environ.get("LLAMBDA_BACKEND", "avx2") != "avx2",
                                reason="plans exist on the AVX2 backend only")

PROMPT = [5, 17, 42, 99, 3, 250, 7]          # 7 tokens: the (8, 1) step shape


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    gguf = tmp_path_factory.mktemp("plans") / "tiny.gguf"
    write_random_llama(gguf, n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=300,
                       tensor_type="Q4_1", n_ctx=256, seed=5)
    return convert.ensure_converted(gguf, progress=False)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory, the kernel library kept where it is."""
    monkeypatch.setenv("LLAMBDA_KERNEL_DIR", str(library.library_dir()))
    monkeypatch.setenv("LLAMBDA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(plan_cache.DIR_ENV, raising=False)
    return tmp_path / plan_cache.CACHE_SUBDIR


def load(path, **kw):
    return llambda.load(path, n_ctx=128, threads=2, progress=False, **kw)


def run(model):
    """Logits of PROMPT (one prefill step, then its rows one by one), and the plans' kinds."""
    last = model.evaluate(PROMPT).copy()
    rows = model.logits(PROMPT[:3]).copy()
    return np.concatenate([last, rows.ravel()]), {k: type(p) for k, p in model.net._plans.items()}


def plan_files(cache):
    return sorted(cache.glob("*.plan")) if cache.exists() else []


def test_kept_plans_run_exactly_as_recorded(model_file, cache):
    with load(model_file) as model:
        recorded, kinds = run(model)
    assert set(kinds.values()) == {PlanRecorder}
    assert len(plan_files(cache)) == len(kinds)
    with load(model_file) as model:
        kept, kinds = run(model)
        assert set(kinds.values()) == {KeptPlan}
        assert [op.name for op in model.net._plans[(1, 1)].ops][:2] == ["embed", "rmsnorm"]
    np.testing.assert_array_equal(kept, recorded)


def test_profile_of_a_kept_plan_names_its_ops(model_file, cache):
    with load(model_file) as model:
        run(model)
    with load(model_file) as model:
        assert isinstance(model.net._plans[(1, 1)], KeptPlan)
        table = model.profile(tokens=2, prefill=0).table()
    assert "qgemm" in table


def test_no_disk_cache_without_a_source(model_file, cache):
    """A TransformerModel built directly (tests, tools) neither reads nor writes the cache."""
    with load(model_file) as model:
        net = model.net
        net.source = None
        net._plans.clear()
        model.engine.call(lambda: net._plan(2, 1))
        assert isinstance(net._plans[(2, 1)], PlanRecorder)
    assert len(plan_files(cache)) == 1          # (1, 1), stored while loading


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "garbage"])
def test_damaged_file_is_removed_and_recorded_again(model_file, cache, damage):
    with load(model_file) as model:
        recorded, _ = run(model)
    for path in plan_files(cache):
        data = bytearray(path.read_bytes())
        os.chmod(path, 0o644)
        if damage == "flip":
            data[len(data) // 2] ^= 0x10
        elif damage == "truncate":
            data = data[:len(data) - 100]
        elif damage == "empty":
            data = b""
        else:
            data = os.urandom(len(data))
        path.write_bytes(bytes(data))
    with load(model_file) as model:
        again, kinds = run(model)
    assert set(kinds.values()) == {PlanRecorder}
    np.testing.assert_array_equal(again, recorded)
    with load(model_file) as model:                 # the rebuilt files are whole
        assert set(run(model)[1].values()) == {KeptPlan}


def _rewrite(path, key, change):
    """Re-encode a plan file after ``change(header, payload bytearray)``: a valid checksum
    over forged contents."""
    header, payload = plan_cache.decode(path.read_bytes(), key)
    header, payload = dict(header), bytearray(payload)
    change(header, payload)
    del header["key"], header["version"]
    os.chmod(path, 0o644)
    path.write_bytes(plan_cache.encode(key, header, bytes(payload)))


def _first_offset_at(header, payload):
    """Where in the payload the first relocated word (an offset into its region) lies."""
    sections = header["sections"]
    pos = int(np.frombuffer(bytes(payload[sum(sections[:2]):][:8]), np.int64)[0])
    n_words = plan_cache.RECORD["int_args"].shape[0]
    row, word = divmod(pos, n_words)          # records then chunk records, n_words int args each
    n_records = header["n_ops"] * header["n_threads"]
    base = row * plan_cache.RECORD.itemsize if row < n_records else \
        sections[0] + (row - n_records) * plan_cache.RECORD.itemsize
    return base + plan_cache.RECORD.fields["int_args"][1] + 8 * word


@pytest.mark.parametrize("forgery", ["offset beyond its region", "region resized", "pointer made plain",
                                     "kernel arity", "unknown symbol", "huge scratch"])
def test_forged_file_with_a_valid_checksum_is_refused(model_file, cache, forgery):
    with load(model_file) as model:
        recorded, _ = run(model)
        key = model.net._plan_key(8, 1)
    path = plan_cache.path_for(key)

    def change(header, payload):
        if forgery == "offset beyond its region":
            at = _first_offset_at(header, payload)
            payload[at:at + 8] = (1 << 40).to_bytes(8, "little")
        elif forgery == "region resized":
            header["regions"][0][2] += 64
        elif forgery == "pointer made plain":
            header["n_reloc"] -= 1          # one pointer left unrelocated (and the sections moved)
            sections = header["sections"]
            start = sum(sections[:2])
            del payload[start + 8 * (header["n_reloc"]):start + 8 * (header["n_reloc"] + 1)]
            start = sum(sections[:3]) - 8
            del payload[start + 4 * header["n_reloc"]:start + 4 * (header["n_reloc"] + 1)]
            sections[2] -= 8
            sections[3] -= 4
        elif forgery == "kernel arity":
            arity_at = sum(header["sections"][:5])
            payload[arity_at:arity_at + 4] = (99).to_bytes(4, "little")
        elif forgery == "huge scratch":
            header["scratch"][0][0] = 1 << 50         # refused before anything is allocated
        else:
            header["symbols"][0] = "llb_not_a_kernel__avx2"
    _rewrite(path, key, change)
    with load(model_file) as model:
        again, kinds = run(model)
    assert kinds[(8, 1)] is PlanRecorder            # not run: recorded again
    np.testing.assert_array_equal(again, recorded)


def test_stale_keys_record_again(model_file, cache, monkeypatch):
    with load(model_file) as model:
        run(model)
    first = plan_files(cache)
    # the model file touched: its identity, so the key, changed
    os.utime(model_file, ns=(time.time_ns(), time.time_ns() + 10**9))
    with load(model_file) as model:
        assert set(run(model)[1].values()) == {PlanRecorder}
    # llambda's code changed
    stamp = plan_cache.code_stamp()
    monkeypatch.setattr(plan_cache, "code_stamp", lambda: stamp + "\nedited")
    with load(model_file) as model:
        assert set(run(model)[1].values()) == {PlanRecorder}
    # another step configuration (threads) is another key
    monkeypatch.setattr(plan_cache, "code_stamp", lambda: stamp)
    with llambda.load(model_file, n_ctx=128, threads=1, progress=False) as model:
        assert set(run(model)[1].values()) == {PlanRecorder}
    assert len(plan_files(cache)) == 4 * len(first)


def test_code_stamp_covers_every_subpackage():
    """The model's code lives in subpackages (llambda/model/forward.py, llambda/serving/...):
    a change to any of them must change the plans' key as one to llambda/api.py does."""
    from llambda.model import forward
    from llambda.serving import engine
    from llambda.runtime.native import gemm
    stamp = plan_cache.code_stamp()
    for module in (llambda, forward, engine, gemm):
        assert str(Path(module.__file__).resolve()) in stamp, module.__name__


def test_plan_pointing_outside_the_named_buffers_is_not_kept(model_file, cache):
    with load(model_file) as model:
        rec = model.net._plans[(1, 1)]
        assert not plan_cache.store("some key", rec.plan, rec.ops, [], [])
        with pytest.raises(plan_cache.NotCacheable):
            plan_cache.freeze(rec.plan, rec.ops, model.net._plan_buffers()[1:], [])
    assert not plan_cache.path_for("some key").exists()


def test_regions_merge_views_and_keep_their_first_name():
    base = np.zeros(1024, np.float32)
    other = np.zeros(16, np.float32)
    r = plan_cache.Regions([("a", base[256:]), ("b", base), ("c", base[:10]), ("d", other)])
    by_name = dict((sig[0], sig) for sig in r.signature)
    assert set(by_name) == {"a", "d"}
    assert by_name["a"] == ("a", 1024, 4096)          # the region starts 1 KiB before "a"
    assert by_name["d"] == ("d", 0, 64)


def test_pruning_drops_the_least_recently_used(tmp_path):
    for i, name in enumerate(["old", "mid", "new"]):
        path = tmp_path / f"{name}.plan"
        path.write_bytes(b"x" * 100)
        os.utime(path, ns=(i * 10**9, i * 10**9))
    plan_cache._prune(tmp_path, budget=250)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mid.plan", "new.plan"]


_CHILD = """
import sys, numpy as np, llambda
with llambda.load(sys.argv[1], n_ctx=128, threads=2, progress=False) as m:
    print(repr(m.evaluate({prompt}).tobytes().hex()[:64]), type(m.net._plans[(8, 1)]).__name__)
"""


def test_processes_storing_at_once_leave_whole_files(model_file, cache):
    env = dict(os.environ)
    code = _CHILD.format(prompt=PROMPT)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(model_file)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        outs.append(out.split())
    assert len({o[0] for o in outs}) == 1            # the same logits in every process
    with load(model_file) as model:
        kept, kinds = run(model)
        assert kinds[(1, 1)] is kinds[(8, 1)] is KeptPlan      # what the children made
        assert repr(model.evaluate(PROMPT).tobytes().hex()[:64]) == outs[0][0]
    for path in plan_files(cache):
        header, payload = plan_cache.decode(path.read_bytes(), header_key(path))
        assert sum(header["sections"]) == len(payload)
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]


def header_key(path):
    """The key a plan file says it was made for (decode checks it against what is asked)."""
    import json
    import struct
    head = plan_cache._HEAD
    _, n_text, _ = head.unpack_from(path.read_bytes())
    return json.loads(path.read_bytes()[head.size:head.size + n_text])["key"]


def test_idle_engine_makes_every_plan_ahead(model_file, cache):
    with load(model_file, warm_when_idle=True) as model:
        shapes = model.net.step_shapes()
        deadline = time.monotonic() + 120             # a bound on the wait, not a timing
        while model.net.cold_shape() is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert model.net.cold_shape() is None
        assert set(shapes) <= set(model.net._plans)
        ids = [e.token for e in model.submit(PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True)]
    with load(model_file) as model:                   # made ahead, so kept: no recording at all
        assert [e.token for e in model.submit(PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True)] == ids
        assert set(map(type, model.net._plans.values())) == {KeptPlan}


@pytest.fixture(scope="module")
def long_model_file(tmp_path_factory):
    """A context of several attention segments: decode steps on 2 threads split their
    attention over segments, into partial records the recorder owns, then combine them."""
    gguf = tmp_path_factory.mktemp("plans-long") / "tiny-long.gguf"
    write_random_llama(gguf, n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=300,
                       tensor_type="Q4_1", n_ctx=1024, seed=6)
    return convert.ensure_converted(gguf, progress=False)


def test_split_attention_plans_are_kept_with_their_partials(long_model_file, cache):
    def decode(model):
        ids = list(model.generate(PROMPT, max_tokens=6, temperature=0))
        return ids, {k: type(p) for k, p in model.net._plans.items()}, model.net._plans[(1, 1)]
    with llambda.load(long_model_file, n_ctx=1024, threads=2, progress=False) as model:
        recorded, kinds, decode_plan = decode(model)
        assert "attention_combine" in [op.name for op in decode_plan.ops]   # the split path ran
    assert set(kinds.values()) == {PlanRecorder}
    for _ in range(50):                          # the stores run on another thread
        if len(plan_files(cache)) == len(kinds):
            break
        time.sleep(0.1)
    assert len(plan_files(cache)) == len(kinds)
    with llambda.load(long_model_file, n_ctx=1024, threads=2, progress=False) as model:
        kept, kinds, _ = decode(model)
        assert set(kinds.values()) == {KeptPlan}
    assert kept == recorded


def test_decode_deep_into_a_long_context_runs_its_own_plan_with_the_same_bits(long_model_file, cache):
    """Past enough key segments for both threads (whole_head_split), a decode step runs the
    plan whose attention chunks are key segments with every head: its logits are the bits of
    the plan that splits by heads too, which shorter contexts keep. A prompt that long makes
    it before its first token; it is kept on disk apart."""
    rng = np.random.default_rng(3)
    ids = [int(t) for t in rng.integers(0, 300, 900)]
    with llambda.load(long_model_file, n_ctx=1024, threads=2, progress=False) as model:
        net = model.net
        net.forward(ids, 0)
        assert (1, 1, "whole heads") in net._plans      # made in the prompt's time, not its first token's
        assert not net._whole_heads(1, 100) and net._whole_heads(1, 901) and not net._whole_heads(8, 901)
        deep = net.forward([7], 900)
        assert (1, 1, "whole heads") in net.step_shapes()
        net._whole_heads = lambda m, keys: False
        np.testing.assert_array_equal(net.forward([7], 900), deep)
        kinds = {k: type(p) for k, p in net._plans.items()}
    for _ in range(50):                          # the stores run on another thread
        if len(plan_files(cache)) == len(kinds):
            break
        time.sleep(0.1)
    assert len(plan_files(cache)) == len(kinds)


def test_an_unwritable_plan_directory_is_named_once(model_file, cache, monkeypatch, tmp_path):
    """A plan that cannot be kept is not kept (the model records it at each load instead),
    and a warning names the directory and the variable that chooses another, once."""
    blocked = tmp_path / "a file"
    blocked.write_text("")
    monkeypatch.setenv(plan_cache.DIR_ENV, str(blocked / "plans"))
    monkeypatch.setattr(plan_cache, "_reported", set())
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")              # the model's own (threaded) attempts
        with load(model_file) as model:
            model.logits([1, 2, 3])
            rec = model.net._plans[(1, 1)]
            named, scratch = model.net._plan_buffers(), rec.scratch_buffers()
    monkeypatch.setattr(plan_cache, "_reported", set())
    with pytest.warns(RuntimeWarning, match=r"cannot keep recorded plans in .*a file/plans.*LLAMBDA_PLAN_DIR"):
        assert not plan_cache.store("some key", rec.plan, rec.ops, named, scratch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not plan_cache.store("another key", rec.plan, rec.ops, named, scratch)
