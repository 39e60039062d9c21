"""Bad input at the command line: one clear line on stderr, non-zero exit, no traceback,
no file left behind."""
import subprocess
import sys

import pytest

from synth import write_random_llama


def llambda_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "llambda.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


def assert_user_error(proc, *needles):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == ""
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "tiny.gguf"
    write_random_llama(path, n_layer=1, dim=64, n_head=2, n_kv_head=1, ffn_dim=64, vocab_size=300,
                       tensor_type="Q4_1", n_ctx=64)
    return path


def test_missing_model_file(tmp_path):
    assert_user_error(llambda_cli("run", "--model", tmp_path / "nope.gguf"), "nope.gguf")


def test_not_a_model_file(tmp_path):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"hello world, not a model" * 10)
    assert_user_error(llambda_cli("run", "--model", junk), "junk.bin")
    assert_user_error(llambda_cli("info", junk), "junk.bin")


def test_truncated_gguf_leaves_no_partial_output(tiny, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[: tiny.stat().st_size // 2])
    out = tmp_path / "cut.llb"
    assert_user_error(llambda_cli("convert", cut, "-o", out, "--quiet"), "cut.gguf")
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["cut.gguf"]


def test_truncated_llambda_file(tiny, tmp_path):
    out = tmp_path / "m.llb"
    assert llambda_cli("convert", tiny, "-o", out, "--quiet").returncode == 0
    cut = tmp_path / "cut.llb"
    cut.write_bytes(out.read_bytes()[:-100])
    assert_user_error(llambda_cli("run", "--model", cut, "--max-tokens", "1"), "cut.llb")
    assert_user_error(llambda_cli("verify", cut), "cut.llb")


def test_prompt_longer_than_context(tiny):
    proc = llambda_cli("run", "--model", tiny, "--ctx", "8", "--prompt", "a b c d e f g h i j k l m n o p")
    assert_user_error(proc, "context")
    ok = llambda_cli("run", "--model", tiny, "--ctx", "8", "--truncate", "--max-tokens", "2",
                     "--prompt", "a b c d e f g h i j k l m n o p")
    assert ok.returncode == 0, ok.stderr


@pytest.mark.parametrize("option, value", [
    ("--temperature", "-1"), ("--top-p", "0"), ("--top-p", "1.5"), ("--min-p", "-0.1"),
    ("--top-k", "-3"), ("--repeat-penalty", "0"), ("--max-tokens", "-5"), ("--threads", "0"),
    ("--threads", "-2"), ("--ctx", "0"),
])
def test_invalid_options(tiny, option, value):
    proc = llambda_cli("run", "--model", tiny, option, value)
    assert_user_error(proc, option.lstrip("-").split("-")[0])


def test_prompt_file_not_utf8(tiny, tmp_path):
    bad = tmp_path / "prompt.txt"
    bad.write_bytes(b"caf\xe9 \xff\xfe")
    assert_user_error(llambda_cli("run", "--model", tiny, "--prompt-file", bad), "prompt.txt", "UTF-8")
    assert_user_error(llambda_cli("run", "--model", tiny, "--prompt-file", tmp_path / "missing.txt"),
                      "missing.txt")


def test_run_prints_only_text_on_stdout(tiny):
    proc = llambda_cli("run", "--model", tiny, "--max-tokens", "4", "--seed", "1")
    assert proc.returncode == 0, proc.stderr
    assert "tok/s" in proc.stderr and "tok/s" not in proc.stdout


@pytest.mark.parametrize("args, needle", [
    (("--prompts", "x"), "--prompts: expected a comma-separated list of integers"),
    (("--prompts", "128,0"), "--prompts: every prompt size must be >= 1"),
    (("--prompts", "4096", "--ctx", "1024"), "--ctx: 1024 positions do not hold a prompt of 4096 tokens"),
])
def test_bench_refuses_prompts_it_cannot_time(tiny, args, needle):
    """Checked before anything is measured (no model is converted, no ceiling probed)."""
    assert_user_error(llambda_cli("bench", "--model", tiny, "--threads", "1", *args), needle)


def test_serve_security_flags_refused_before_the_model_loads(tiny, tmp_path):
    """One line naming the flag and the file at fault, exit 2, no server started (issue 36)."""
    pytest.importorskip("uvicorn")
    empty, junk = tmp_path / "empty-keys.txt", tmp_path / "junk.pem"
    empty.write_text("# no key yet\n\n")
    junk.write_text("not a certificate\n")
    cases = [
        (("--api-key-file", tmp_path / "keys.txt"), ("--api-key-file", "keys.txt", "no such file")),
        (("--api-key-file", empty), ("empty-keys.txt", "holds no key")),
        (("--api-key-file", tmp_path), ("--api-key-file", "cannot read")),
        (("--api-key", ""), ("--api-key", "empty")),
        (("--api-key", "two words"), ("--api-key", "without spaces")),
        (("--ssl-keyfile", junk), ("--ssl-keyfile needs --ssl-certfile",)),
        (("--ssl-certfile", junk), ("--ssl-certfile needs --ssl-keyfile",)),
        (("--ssl-keyfile", tmp_path / "nope.key", "--ssl-certfile", junk),
         ("--ssl-keyfile", "nope.key", "no such file")),
        (("--ssl-keyfile", junk, "--ssl-certfile", junk), ("junk.pem", "not a PEM certificate")),
        (("--cors-origins", "https://ok.example,https://slash.example/"), ("--cors-origins", "https://slash.example/")),
    ]
    for args, needles in cases:
        proc = llambda_cli("serve", "--model", tiny, "--port", "0", *args)
        assert_user_error(proc, *needles)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
