"""The decode loop, stop strings, the Python API and the chat command."""
import subprocess
import sys

import pytest

import llambda
from llambda.codegen.contract import KV_BLOCK
from llambda.serving.generation import Stats, StopStrings
from synth import write_random_llama


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen") / "tiny.gguf"
    write_random_llama(path, n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=300,
                       tensor_type="Q8_0", n_ctx=512, seed=11)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_path):
    with llambda.load(tiny_path, n_ctx=512, progress=False) as model:
        yield model


def test_stop_strings_hold_back_possible_prefixes():
    s = StopStrings(["END"])
    assert s.feed("hello E") == "hello "      # "E" might start "END"
    assert s.feed("N") == ""
    assert s.feed("x") == "ENx"               # it did not
    assert s.feed("abcEND tail") == "abc" and s.hit


def test_stop_strings_none_pass_everything():
    s = StopStrings([])
    assert s.feed("abc") == "abc" and s.flush() == "" and not s.hit


def test_streamed_pieces_are_the_detokenized_ids(tiny):
    stats = Stats()
    text = "".join(tiny.generate("hello", max_tokens=30, temperature=1.0, seed=4, stats=stats))
    assert stats.generated_tokens == len(stats.ids) <= 30
    assert text == tiny.detokenize(stats.ids)
    assert stats.prompt_ids == tiny.tokenize("hello")


def test_generation_stops_at_a_stop_string(tiny):
    full = "".join(tiny.generate("hello", max_tokens=40, temperature=1.0, seed=9))
    assert len(full) > 4
    stop = full[2:4]
    stats = Stats()
    cut = "".join(tiny.generate("hello", max_tokens=40, temperature=1.0, seed=9, stop=[stop], stats=stats))
    assert cut == full[:full.index(stop)]
    assert stats.stop_reason == "stop_string"


def test_zero_max_tokens_and_cache_reuse(tiny):
    long = "hello there, " * 8                   # more than one KV block of tokens
    assert "".join(tiny.generate(long, max_tokens=0)) == ""
    stats = Stats()
    "".join(tiny.generate(long + "friend", max_tokens=2, temperature=0, stats=stats))
    assert stats.cached_tokens >= KV_BLOCK     # the shared prefix's whole blocks were not recomputed


def test_context_full_stops_generation(tiny_path):
    with llambda.load(tiny_path, n_ctx=16, progress=False) as model:
        stats = Stats()
        "".join(model.generate("hi", max_tokens=100, temperature=1.0, seed=1, stats=stats, ignore_eos=True))
        assert stats.stop_reason == "context_full"
        # every position computed; the last token comes from position 15's logits
        assert stats.prompt_tokens + stats.generated_tokens == 17


def test_chat_api_renders_the_template(tiny):
    prompt = tiny.render_chat([{"role": "user", "content": "Hi"}])
    assert "<|im_start|>user" in prompt and prompt.rstrip().endswith("<|im_start|>assistant")
    reply = "".join(tiny.chat([{"role": "user", "content": "Hi"}], max_tokens=8, seed=1))
    assert isinstance(reply, str)


def test_chat_command_answers_each_line(tiny_path):
    proc = subprocess.run([sys.executable, "-m", "llambda.cli", "chat", "--model", str(tiny_path),
                           "--max-tokens", "5", "--seed", "1", "--system", "Be brief."],
                          input="Hello\nHow are you?\n", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout.count("\n") >= 2        # one reply line per user line
