"""Hostile files, hostile templates, broken pipes and killed processes (issue 9): one clear
line, never a crash, nothing left behind. Each test failed before its fix."""
import os
import signal
import stat
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest

import llambda
from llambda import cli
from llambda.model import convert
from llambda.serving import generation
from llambda import inputs
from llambda.model import integrity
from llambda.model import limits
from llambda.chat import limits as template_limits
from llambda.chat.template import render_chat
from llambda.errors import UserError
from llambda.runtime import atomic, faults, weightfile
from synth import write_random_llama

from tiny_gguf import tiny_tensors, write_gguf

PY = sys.executable
# Subprocesses with a private cache use the kernel library already built (not a rebuild).
KERNEL_ENV = {"LLAMBDA_KERNEL_DIR": str(__import__("llambda.runtime.library").runtime.library.ensure_built())}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMBDA_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile") / "tiny.gguf"
    write_random_llama(path, n_layer=1, dim=64, n_head=2, n_kv_head=1, ffn_dim=64, vocab_size=300,
                       tensor_type="Q4_1", n_ctx=64)
    return path


@pytest.fixture(scope="module")
def tiny_llb(tiny_gguf):
    return convert.convert(tiny_gguf, tiny_gguf.with_suffix(".llb"), progress=False)


@pytest.fixture(scope="module")
def tiny_model(tiny_llb):
    with llambda.load(tiny_llb, progress=False, threads=1) as model:
        yield model


def one_line(text):
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert "Traceback" not in text, text
    return lines[0]


def run_python(code, env=None, **kwargs):
    full_env = dict(os.environ, **KERNEL_ENV, **(env or {}))
    return subprocess.run([PY, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          env=full_env, **kwargs)


# ---------------------------------------------------------------- 1. SIGBUS

def test_a_file_truncated_under_its_mapping_ends_with_one_line_naming_it(tmp_path):
    path = tmp_path / "w.llb"
    weightfile.write(path, {"a": 1}, {"x": np.arange(1 << 20, dtype=np.float32)})
    proc = run_python(f"""
        import os
        from llambda.runtime import weightfile
        w = weightfile.open_weights({str(path)!r})
        os.chmod({str(path)!r}, 0o644)
        os.truncate({str(path)!r}, 0)
        print(float(w["x"].sum()))
        """, env={"LLAMBDA_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == faults.EXIT_STATUS, proc
    line = one_line(proc.stderr)
    assert str(path) in line and "changed while in use" in line


def test_the_kernels_reading_a_truncated_model_end_with_one_line(tiny_llb, tmp_path):
    copy = tmp_path / "m.llb"
    copy.write_bytes(tiny_llb.read_bytes())
    proc = run_python(f"""
        import os, llambda
        m = llambda.load({str(copy)!r}, progress=False, threads=1)
        os.truncate({str(copy)!r}, 4096)
        m.logits([1, 2, 3])
        """, env={"LLAMBDA_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == faults.EXIT_STATUS, proc
    assert str(copy) in one_line(proc.stderr)


def test_written_model_files_are_read_only(tiny_gguf, tmp_path):
    out = convert.convert(tiny_gguf, tmp_path / "ro.llb", progress=False)
    assert stat.S_IMODE(out.stat().st_mode) & 0o222 == 0
    cached = convert.ensure_converted(tiny_gguf, progress=False)
    assert stat.S_IMODE(cached.stat().st_mode) & 0o222 == 0
    convert.convert(tiny_gguf, out, progress=False)        # converting again still replaces it


# ---------------------------------------------------------------- 2. templates

HOSTILE_TEMPLATES = {
    "multiplied string": '{{ "a" * 10**10 }}',
    "multiplied literal": '{{ "a" * 9999999999 }}',
    "padded filter": '{{ "a"|center(9999999999) }}',
    "padded method": '{{ "a".ljust(9999999999) }}',
    "doubling namespace": '{% set ns = namespace(s="ab") %}{% for i in range(60) %}'
                          '{% set ns.s = ns.s ~ ns.s %}{% endfor %}x',
    "nested loops": '{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}',
    "nested loops with output": '{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}',
    "endless recursion": '{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}',
    "format width": '{{ "%0999999999d" % 1 }}',
    "format filter width": '{{ "%0999999999d"|format(1) }}',
    "long list": '{{ ([1] * 100000000)|length }}',
}


@pytest.mark.parametrize("name", HOSTILE_TEMPLATES)
def test_hostile_templates_fail_with_one_line_naming_the_template(name, monkeypatch):
    monkeypatch.setattr(template_limits, "MAX_SECONDS", 0.5)
    with pytest.raises(UserError) as error:
        render_chat(HOSTILE_TEMPLATES[name], [{"role": "user", "content": "hi"}], name="evil.jinja")
    assert "evil.jinja" in one_line(str(error.value))


def test_ordinary_templates_still_render():
    text = render_chat("{% for m in messages %}<|{{ m.role }}|>{{ m.content * 2 }}{% endfor %}",
                       [{"role": "user", "content": "hi"}])
    assert text == "<|user|>hihi"


# ---------------------------------------------------------------- 3. text that is not UTF-8

def test_the_text_rule():
    assert inputs.check_text("héllo") == "héllo"
    with pytest.raises(UserError, match=r"prompt: not valid UTF-8 \(byte 0xff at character 3\)"):
        inputs.check_text("abc\udcff", "prompt")
    with pytest.raises(UserError, match="lone surrogate U\\+D800"):
        inputs.check_text("\ud800", "prompt")


def test_lone_surrogates_through_the_api(tiny_model):
    for call in (lambda: tiny_model.tokenize("a\ud800"), lambda: list(tiny_model.generate("a\ud800")),
                 lambda: tiny_model.render_chat([{"role": "user", "content": "x\udcff"}]),
                 lambda: tiny_model.tokenizer.encode("\ud800")):
        with pytest.raises(UserError) as error:
            call()
        one_line(str(error.value))


def test_a_prompt_that_is_not_utf8_on_the_command_line(tiny_gguf):
    proc = subprocess.run([PY, "-m", "llambda.cli", "run", "--model", str(tiny_gguf), "--prompt", b"abc\xff"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "--prompt: not valid UTF-8" in one_line(proc.stderr)


def test_chat_refuses_a_line_that_is_not_utf8_and_goes_on(tiny_gguf, tmp_path):
    proc = subprocess.run([PY, "-m", "llambda.cli", "chat", "--model", str(tiny_gguf), "--max-tokens", "2",
                           "--chat-template", "chatml"],
                          input=b"abc\xff\nhello\n", capture_output=True, timeout=300,
                          env=dict(os.environ, **KERNEL_ENV, LLAMBDA_CACHE_DIR=str(tmp_path / "cache"),
                                   PYTHONIOENCODING="utf-8:surrogateescape"))
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert "input line: not valid UTF-8 (byte 0xff at character 3); line ignored" in err


# ---------------------------------------------------------------- 4. vocabularies that are not UTF-8

def test_a_vocabulary_token_that_is_not_utf8_converts_and_loads(tmp_path, monkeypatch):
    import gguf
    original = gguf.GGUFWriter.add_token_list

    def with_raw_bytes(self, tokens):
        tokens = list(tokens)
        tokens[5] = b"\xff\xfe"
        original(self, tokens)
    monkeypatch.setattr(gguf.GGUFWriter, "add_token_list", with_raw_bytes)
    path = write_gguf(tmp_path / "raw.gguf", tiny_tensors())
    out = convert.convert(path, tmp_path / "raw.llb", progress=False)
    tokenizer = convert.build_tokenizer(out, convert.tokenizer_metadata(out))
    assert tokenizer.token_bytes(5) == b"\xff\xfe"
    assert tokenizer.decode([5]) == "\ufffd\ufffd"


def test_conversion_refuses_a_file_that_would_not_load(tmp_path, monkeypatch):
    from llambda.tokenizer import vocab as tokenizer
    path = write_gguf(tmp_path / "m.gguf", tiny_tensors())

    def broken(md):
        raise TypeError("cannot build this vocabulary")
    monkeypatch.setattr(tokenizer.Tokenizer, "from_gguf_metadata", staticmethod(broken))
    with pytest.raises(UserError, match="would not load") as error:
        convert.convert(path, tmp_path / "m.llb", progress=False)
    assert "m.gguf" in one_line(str(error.value))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "m.gguf"] or \
        sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


# ---------------------------------------------------------------- 5. killed during conversion

@pytest.mark.parametrize("unnamed", [True, False], ids=["O_TMPFILE", "named-temporary"])
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_conversion_killed_halfway_leaves_nothing(tiny_gguf, tmp_path, how, unnamed):
    out = tmp_path / "out" / "m.llb"
    out.parent.mkdir()
    proc = run_python(f"""
        import os, signal
        from llambda.model import convert
        from llambda.runtime import atomic, weightfile
        if not {unnamed}:
            atomic._open_unnamed = lambda directory: (None, None)
        def killed(out, *args):
            out.write(b"x" * 100000)
            out.flush()
            os.kill(os.getpid(), {int(how)})
        weightfile._write_arrays = killed
        convert.convert({str(tiny_gguf)!r}, {str(out)!r}, progress=False)
        """, env={"LLAMBDA_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == -how
    left = list(out.parent.iterdir())
    if unnamed:
        assert left == []
    else:       # a named temporary of a dead process: the next write there removes it
        assert len(left) == 1 and left[0].name.startswith(".m.llb.")
        atomic.clean_stale(out.parent)
        assert list(out.parent.iterdir()) == []


def test_stale_temporaries_of_live_processes_are_kept(tmp_path):
    mine = tmp_path / f".m.llb.{os.getpid()}.abcd1234.tmp"
    dead = tmp_path / ".m.llb.999999999.abcd1234.tmp"
    other = tmp_path / "notes.tmp"
    for path in (mine, dead, other):
        path.write_bytes(b"x")
    with atomic.create(tmp_path / "new.bin") as f:
        f.write(b"data")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, other.name, "new.bin"])


# ---------------------------------------------------------------- 6. broken pipes

def test_a_closed_stdout_ends_quietly_with_sigpipe_status(monkeypatch, capsys):
    def writes_to_a_closed_pipe(args):
        raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(cli, "cmd_info", writes_to_a_closed_pipe)
    monkeypatch.setattr(cli, "_silence_stdout", lambda: None)
    assert cli.main(["info", "x.llb"]) == 128 + signal.SIGPIPE
    assert capsys.readouterr().err == ""


def test_run_into_head_exits_like_a_unix_tool(tiny_gguf, tmp_path):
    env = dict(os.environ, **KERNEL_ENV, LLAMBDA_CACHE_DIR=str(tmp_path / "cache"))
    subprocess.run([PY, "-m", "llambda.cli", "convert", str(tiny_gguf), "-o", str(tmp_path / "m.llb"), "--quiet"],
                   check=True, capture_output=True, env=env)
    proc = subprocess.Popen([PY, "-m", "llambda.cli", "run", "--model", str(tmp_path / "m.llb"), "--ignore-eos",
                             "--max-tokens", "60", "--temperature", "0", "--echo", "--truncate", "--prompt", "x" * 20000],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.read(20)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) in (0, 128 + signal.SIGPIPE), err
    assert "Broken pipe" not in err and "Traceback" not in err


# ---------------------------------------------------------------- 7. one line, not a traceback

def test_an_unknown_backend_is_one_line(tiny_llb, monkeypatch, capsys):
    monkeypatch.setenv("LLAMBDA_BACKEND", "cuda")
    from llambda.runtime import backend
    backend.get_backend.cache_clear()
    try:
        assert cli.main(["run", "--model", str(tiny_llb), "--max-tokens", "1"]) == 2
    finally:
        backend.get_backend.cache_clear()
    assert "LLAMBDA_BACKEND" in one_line(capsys.readouterr().err)


def test_absurd_thread_counts_are_refused_and_oversubscription_warned(tiny_llb, monkeypatch, capsys):
    monkeypatch.setenv("LLAMBDA_THREADS", "100000")
    with pytest.raises(UserError, match="LLAMBDA_THREADS: 100000 worker threads"):
        llambda.load(tiny_llb, progress=False)
    monkeypatch.delenv("LLAMBDA_THREADS")
    monkeypatch.setattr(limits, "usable_cpus", lambda: 1)
    with llambda.load(tiny_llb, progress=False, threads=2):
        pass
    assert "--threads 2 is more than the 1 CPU" in capsys.readouterr().err


def test_a_context_too_large_for_memory_is_refused_with_the_figure(tiny_llb):
    with pytest.raises(UserError, match=r"--ctx 100000000000: the KV cache needs .* TiB") as error:
        llambda.load(tiny_llb, progress=False, n_ctx=100_000_000_000)
    one_line(str(error.value))


def test_a_forged_header_whose_config_disagrees_with_its_tensors(tiny_llb, tmp_path):
    w = weightfile.open_weights(tiny_llb)
    metadata = dict(w.metadata)
    config = dict(metadata["config"])
    config["n_layer"] += 1                          # a consistent config, tensors missing
    for key in ("layer_window", "layer_rope_base", "layer_rope_scale"):
        config[key] = list(config[key]) + [config[key][-1]]
    metadata["config"] = config
    forged = weightfile.write(tmp_path / "forged.llb", metadata, {name: np.array(w[name]) for name in w})
    with pytest.raises(UserError, match="lacks tensors") as error:
        llambda.load(forged, progress=False)
    assert "forged.llb" in one_line(str(error.value))


# ---------------------------------------------------------------- 8. damage found late

def test_a_flipped_weight_byte_is_found_on_the_first_load(tiny_llb, tmp_path):
    damaged = tmp_path / "d.llb"
    data = bytearray(tiny_llb.read_bytes())
    entry = weightfile.open_weights(tiny_llb).entries[-1]
    data[entry.offset + entry.nbytes // 2] ^= 0x40
    damaged.write_bytes(bytes(data))
    with pytest.raises(UserError, match="checksum mismatch") as error:
        llambda.load(damaged, progress=False)
    assert "llambda verify" in one_line(str(error.value))
    assert not integrity.is_verified(damaged)


def test_the_checksums_are_verified_once_per_machine(tiny_llb, tmp_path, monkeypatch):
    copy = tmp_path / "c.llb"
    copy.write_bytes(tiny_llb.read_bytes())
    calls = []
    original = weightfile.WeightFile.verify
    monkeypatch.setattr(weightfile.WeightFile, "verify", lambda self, progress=None: calls.append(1) or
                        original(self, progress))
    convert.load_model_file(copy)
    convert.load_model_file(copy)
    assert len(calls) == 1 and integrity.is_verified(copy)
    os.utime(copy, ns=(1, 1))           # a changed file is verified again
    convert.load_model_file(copy)
    assert len(calls) == 2


def test_nan_logits_name_the_file_and_llambda_verify(tiny_model, monkeypatch):
    monkeypatch.setattr(tiny_model.net, "forward", lambda ids, pos0, all_logits=False:
                        np.full(tiny_model.config.vocab_size, np.nan, np.float32))
    tiny_model._cached = []
    with pytest.raises(UserError, match="may be damaged; run `llambda verify") as error:
        tiny_model.evaluate([1, 2])
    assert str(tiny_model.path) in one_line(str(error.value))


def test_rope_freqs_of_the_wrong_shape_are_refused_at_conversion(tmp_path):
    tensors = tiny_tensors()
    tensors["rope_freqs.weight"] = np.ones(5, np.float32)
    with pytest.raises(UserError, match="rope_freqs.weight has shape 5"):
        convert.convert(write_gguf(tmp_path / "m.gguf", tensors), tmp_path / "m.llb", progress=False)
    assert not (tmp_path / "m.llb").exists()


def test_cache_directory_errors_name_it_and_the_variable(tiny_gguf, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    monkeypatch.setenv("LLAMBDA_CACHE_DIR", str(blocker))
    with pytest.raises(UserError, match="LLAMBDA_CACHE_DIR") as error:
        convert.ensure_converted(tiny_gguf, progress=False)
    assert str(blocker) in one_line(str(error.value))


# ---------------------------------------------------------------- 9. API footguns

def test_stop_is_a_string_not_its_characters(tiny_model, monkeypatch):
    seen = []
    monkeypatch.setattr(tiny_model.engine, "submit",
                        lambda ids, sampler, n, stops, **k: seen.append(stops) or SimpleNamespace())
    tiny_model.generate("x", stop="is")
    tiny_model.generate("x", stop=["is", "Par"])
    tiny_model.generate("x", stop=None)
    assert seen == [["is"], ["is", "Par"], []]
    with pytest.raises(UserError, match="stop"):
        tiny_model.generate("x", stop=5)
    stopper = generation.StopStrings(inputs.check_stop("is"))
    assert stopper.feed("Paris") == "Par" and stopper.hit      # "is" itself, not "i" or "s"
    assert generation.StopStrings(inputs.check_stop("is")).feed("Pa i s") == "Pa i s"


@pytest.mark.parametrize("prompt", [b"hi", bytearray(b"hi"), 5, {"a": 1}])
def test_a_prompt_is_text_or_token_ids(tiny_model, prompt):
    with pytest.raises(UserError, match="prompt"):
        tiny_model.generate(prompt)


@pytest.mark.parametrize("ids", [[1.7], ["5"], [True], [1, None], np.array([1.0])])
def test_token_ids_are_integers(tiny_model, ids):
    with pytest.raises(UserError, match="token id"):
        tiny_model.logits(ids)


def test_numpy_integer_ids_are_token_ids(tiny_model):
    assert tiny_model.logits(np.array([1, 2], np.int64)).shape[0] == 2
    assert tiny_model.logits([np.int32(1)]).shape[0] == 1


def test_an_interrupted_reply_says_so_in_its_stats(tiny_model):
    stats = generation.Stats()
    pieces = tiny_model.generate([1, 2, 3], max_tokens=20, ignore_eos=True, temperature=0, stats=stats)
    with pytest.raises(KeyboardInterrupt):
        for i, _ in enumerate(pieces):
            raise KeyboardInterrupt
    pieces.close()
    assert stats.stop_reason == "interrupted"
    stats = generation.Stats()
    list(tiny_model.generate([1, 2, 3], max_tokens=3, ignore_eos=True, temperature=0, stats=stats))
    assert stats.stop_reason == "max_tokens"


# ---------------------------------------------------------------- found by the fuzz campaign

@pytest.mark.parametrize("temperature, penalty", [(1e-308, 1.0), (0.8, 1e308), (5e-324, 1e300)])
def test_sampling_at_extreme_settings_warns_of_nothing(temperature, penalty):
    import warnings
    from llambda.serving.sampling import Sampler
    logits = np.random.default_rng(0).standard_normal(500).astype(np.float32) * 10
    for filters in ({}, {"top_k": 0, "top_p": 1.0, "min_p": 0.0}):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            token = Sampler(temperature=temperature, repeat_penalty=penalty, seed=1, **filters).sample(
                logits, [1, 2, 3])
        assert 0 <= token < logits.size


def test_a_stray_break_in_a_template_is_one_line():
    with pytest.raises(UserError, match="does not parse") as error:
        render_chat("{% if messages %}{% break %}{% endif %}", [{"role": "user", "content": "hi"}], name="t.jinja")
    assert "t.jinja" in one_line(str(error.value))


def test_a_gguf_length_past_any_file_is_one_line(tiny_gguf, tmp_path):
    data = bytearray(tiny_gguf.read_bytes())
    data[24:32] = (2**64 - 1).to_bytes(8, "little")       # the first key's length
    bad = tmp_path / "long.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(UserError, match="damaged or truncated GGUF") as error:
        convert.convert(bad, tmp_path / "long.llb", progress=False)
    one_line(str(error.value))


def test_a_block_count_past_the_tensor_table_is_refused_before_allocating(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", tiny_tensors())
    data = bytearray(path.read_bytes())
    key = b"llama.block_count"
    offset = data.index(key) + len(key) + 4             # past the key and its value type: the u32
    data[offset:offset + 4] = (2**32 - 1).to_bytes(4, "little")
    (tmp_path / "n.gguf").write_bytes(bytes(data))
    with pytest.raises(UserError, match="block_count = 4294967295"):
        convert.convert(tmp_path / "n.gguf", tmp_path / "n.llb", progress=False)


@pytest.mark.parametrize("key, value", [("n_layer", 0.1), ("layer_rope_scale", None), ("rms_eps", "x"),
                                        ("n_head", True)])
def test_config_values_of_the_wrong_type_are_one_line(tiny_llb, tmp_path, key, value):
    w = weightfile.open_weights(tiny_llb)
    metadata = dict(w.metadata, config=dict(w.metadata["config"], **{key: value}))
    forged = weightfile.write(tmp_path / "f.llb", metadata, {name: np.array(w[name]) for name in w})
    for call in (lambda: convert.info(forged), lambda: convert.verify(forged),
                 lambda: llambda.load(forged, progress=False)):
        with pytest.raises(UserError, match=f"model config: {key}") as error:
            call()
        one_line(str(error.value))


@pytest.mark.parametrize("edit", [{"vectors": 1.5}, {"layouts": []}, {"layouts": "x"}])
def test_metadata_of_the_wrong_shape_is_one_line(tiny_llb, tmp_path, edit):
    w = weightfile.open_weights(tiny_llb)
    forged = weightfile.write(tmp_path / "f.llb", dict(w.metadata, **edit), {name: np.array(w[name]) for name in w})
    with pytest.raises(UserError, match="model metadata") as error:
        convert.info(forged)
    one_line(str(error.value))


def test_a_mapping_that_dies_while_the_guard_table_is_written_does_not_deadlock():
    """The garbage collector may finalize a dead mapping (faults.remove) in the middle of
    faults.add on the same thread: remove must not wait for the lock add holds; the slot is
    forgotten by the next add or remove."""
    import threading
    state = faults._install()
    if not state:
        pytest.skip("no SIGBUS guard on this machine")
    slot = state.add(1 << 40, (1 << 40) + 4096, b"x\n")
    done = threading.Event()
    with faults._lock:                       # as if add() were running here
        worker = threading.Thread(target=lambda: (state.remove(slot), done.set()))
        worker.start()
        assert done.wait(10)                 # returned at once, leaving the slot pending
        assert slot in state.used
    other = state.add(1 << 41, (1 << 41) + 4096, b"y\n")
    starts = [entry[0] for entry in state.used.values()]
    assert 1 << 40 not in starts and 1 << 41 in starts     # the next add drained it
    state.remove(other)
    assert 1 << 41 not in [entry[0] for entry in state.used.values()]
