"""The model cache under stress (issue 39): two processes converting the same GGUF at once, a
full disk, a read-only cache, a cached conversion edited afterwards, and ``kill -9`` at random
points of ``run`` and ``convert`` followed by a correct next run.

Every case runs the real CLI in processes of their own with a cache folder of the test's.
A failure is one line naming the file or folder at fault with exit status 2; whatever
happened, the next run in a sound cache gives the same greedy text as an undisturbed one."""
import contextlib
import os
import random
import resource
import subprocess
import sys
import textwrap
import time

import pytest

from synth import write_random_llama

PY = sys.executable
RUN = ["--prompt", "Once upon a time", "--max-tokens", "12", "--temperature", "0", "--threads", "1"]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("stress") / "m.gguf"
    return write_random_llama(path, n_layer=2, dim=64, n_head=2, n_kv_head=1, ffn_dim=128, vocab_size=300,
                              tensor_type="Q4_1", n_ctx=256)


def env_with(cache, **extra):
    env = {k: v for k, v in os.environ.items() if k != "LLAMBDA_BACKEND"}
    env["LLAMBDA_CACHE_DIR"] = str(cache)
    env.update(extra)
    return env


def llambda(*args, cache, timeout=300, **kwargs):
    return subprocess.run([PY, "-m", "llambda", *map(str, args)], capture_output=True, text=True,
                          env=env_with(cache), stdin=subprocess.DEVNULL, timeout=timeout, **kwargs)


def one_line(stderr):
    """The one line of a failure (the note of a conversion on first use, and progress bars, which
    a terminal erases, aside)."""
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("llambda: converting")
             and "%|" not in line]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def leftovers(folder):
    """Temporary files of writes that did not finish."""
    return [p for p in folder.rglob("*") if p.name.endswith(".tmp") or p.name.startswith(".")]


@pytest.fixture(scope="module")
def reference(gguf, tmp_path_factory):
    """The greedy text of an undisturbed run, and how long a run with a fresh cache took."""
    cache = tmp_path_factory.mktemp("reference-cache")
    started = time.monotonic()
    proc = llambda("run", "--model", gguf, *RUN, cache=cache)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, time.monotonic() - started


def converted(cache):
    return sorted((cache / "converted").glob("*.llb"))


# ---------------------------------------------------------------- two converting at once

CONVERT_AND_WAIT = """
import sys
from llambda.model import convert
checked = convert._check_loadable
def held(written, gguf_path):
    checked(written, gguf_path)     # the whole file is written, not yet named
    print("written", flush=True)
    sys.stdin.readline()            # until the other process has written its own
convert._check_loadable = held
from llambda import cli
sys.exit(cli.main(["run", "--model", sys.argv[1], *sys.argv[2:]]))
"""


def test_two_processes_converting_the_same_gguf_at_once(gguf, reference, tmp_path):
    cache = tmp_path / "cache"
    procs = [subprocess.Popen([PY, "-c", CONVERT_AND_WAIT, str(gguf), *RUN], env=env_with(cache), text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(2)]
    try:
        for proc in procs:              # both have a whole conversion in hand, neither has named it
            assert proc.stdout.readline() == "written\n", proc.stderr.read()
        for proc in procs:
            proc.stdin.write("\n")
            proc.stdin.flush()
        results = [proc.communicate(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err
        assert out == reference[0]
    assert len(converted(cache)) == 1
    assert leftovers(cache / "converted") == []
    assert llambda("verify", converted(cache)[0], cache=cache).returncode == 0


# ---------------------------------------------------------------- a full disk

@contextlib.contextmanager
def tmpfs(folder, size, read_only=False):
    """A tmpfs of ``size`` at ``folder`` (root only: the test skips otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    folder.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def _limit_file_size(size):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))


@pytest.mark.parametrize("how", ["tmpfs", "ulimit -f"])
def test_a_full_disk_is_one_line_and_leaves_nothing(gguf, reference, tmp_path, how):
    cache = tmp_path / "cache"
    with contextlib.ExitStack() as stack:
        if how == "tmpfs":
            stack.enter_context(tmpfs(cache, "16k"))      # the conversion is ~70 kB
            proc = llambda("run", "--model", gguf, *RUN, cache=cache)
        else:
            proc = llambda("run", "--model", gguf, *RUN, cache=cache, preexec_fn=_limit_file_size(16 << 10))
        line = one_line(proc.stderr)
        assert proc.returncode == 2, proc.stderr
        assert str(cache / "converted") in line and "LLAMBDA_CACHE_DIR" in line, line
        assert ("No space left" in line) or ("File too large" in line), line
        assert converted(cache) == [] and leftovers(cache) == []
    proc = llambda("run", "--model", gguf, *RUN, cache=cache)       # room again: a correct run
    assert proc.returncode == 0 and proc.stdout == reference[0], proc.stderr


def test_a_full_cache_does_not_stop_a_converted_model(gguf, reference, tmp_path):
    """The plans, tokenizer files and checksum stamps a run writes are best effort."""
    model = tmp_path / "m.llb"
    assert llambda("convert", gguf, "-o", model, "--quiet", cache=tmp_path / "other").returncode == 0
    with tmpfs(tmp_path / "cache", "4k") as cache:
        proc = llambda("run", "--model", model, *RUN, cache=cache)
    assert proc.returncode == 0 and proc.stdout == reference[0], proc.stderr


# ---------------------------------------------------------------- a read-only cache

@pytest.fixture
def read_only_cache(tmp_path):
    cache = tmp_path / "ro-cache"
    if os.geteuid() == 0:
        with tmpfs(cache, "1m", read_only=True):
            yield cache
    else:
        cache.mkdir()
        cache.chmod(0o555)
        yield cache
        cache.chmod(0o755)


def test_a_read_only_cache_still_runs_a_converted_model(gguf, reference, tmp_path, read_only_cache):
    model = tmp_path / "m.llb"
    assert llambda("convert", gguf, "-o", model, "--quiet", cache=tmp_path / "other").returncode == 0
    proc = llambda("run", "--model", model, *RUN, cache=read_only_cache)
    assert proc.returncode == 0 and proc.stdout == reference[0], proc.stderr


def test_a_read_only_cache_refuses_a_conversion_in_one_line(gguf, read_only_cache):
    proc = llambda("run", "--model", gguf, *RUN, cache=read_only_cache)
    line = one_line(proc.stderr)
    assert proc.returncode == 2
    assert str(read_only_cache) in line and "LLAMBDA_CACHE_DIR" in line, line


# ---------------------------------------------------------------- a cached conversion edited

def _flip_last_tensor_byte(path):
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("edit", ["byte flipped", "truncated", "emptied", "replaced by text"])
def test_a_cached_conversion_edited_afterwards_is_converted_again(gguf, reference, tmp_path, edit):
    cache = tmp_path / "cache"
    assert llambda("run", "--model", gguf, *RUN, cache=cache).returncode == 0
    (cached,) = converted(cache)
    if edit == "byte flipped":
        _flip_last_tensor_byte(cached)
    else:
        cached.chmod(0o644)
        size = cached.stat().st_size
        with open(cached, "r+b") as f:
            f.truncate({"truncated": size // 2, "emptied": 0, "replaced by text": 0}[edit])
            if edit == "replaced by text":
                f.write(b"hello\n")
    proc = llambda("run", "--model", gguf, *RUN, cache=cache)
    assert proc.returncode == 0 and proc.stdout == reference[0], proc.stderr
    assert "Traceback" not in proc.stderr
    (again,) = converted(cache)
    assert llambda("verify", again, cache=cache).returncode == 0


# ---------------------------------------------------------------- kill -9 anywhere

@pytest.mark.parametrize("command", ["run", "convert"])
def test_kill_9_at_random_points_then_a_correct_run(gguf, reference, tmp_path, command):
    """SIGKILL at seeded random moments within the span a whole run takes; every next run
    in the same cache gives the undisturbed text."""
    cache = tmp_path / "cache"
    text, span = reference
    rng = random.Random(39)
    out = tmp_path / "m.llb"
    args = ["run", "--model", gguf, *RUN] if command == "run" else ["convert", gguf, "-o", out, "--quiet"]
    for round_ in range(6):
        proc = subprocess.Popen([PY, "-m", "llambda", *map(str, args)], env=env_with(cache),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            proc.wait(timeout=rng.uniform(0, span))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        model = gguf if command == "run" else out
        if command == "convert" and not out.exists():
            model = gguf
        after = llambda("run", "--model", model, *RUN, cache=cache)
        assert after.returncode == 0 and after.stdout == text, after.stderr
        if command == "convert":
            out.unlink(missing_ok=True)
        elif round_ % 2:
            for cached in converted(cache):     # the next kill may land in a conversion again
                cached.chmod(0o644)
                cached.unlink()
