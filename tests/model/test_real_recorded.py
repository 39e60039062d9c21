"""The real Gemma 3 270M Q4_K_M file (no chat template, gemma3 architecture, Q5_0/Q4_K/Q6_K/Q8_0
tensors, a 262,144-token SentencePiece vocabulary) against llama.cpp's side recorded once.

`make test` fetches the file (`llambda fetch gemma3-270m --gguf`); llama.cpp's ids, greedy
paths and top logits were recorded with
`tools/compare_llamacpp.py gemma-3-270m-q4_k_m.gguf --steps 24 --prompt ... --record
tests/fixtures/gemma3_270m_llamacpp.json` (llama-cpp-python 0.3.36, flash attention), so
this test needs no llama.cpp. The checks are tests/model/test_real_files.py's:
- prompt token ids equal llama.cpp's, with and without special tokens;
- teacher-forced along llama.cpp's greedy path, the argmax equals llama.cpp's wherever its
  top-2 margin is at least DEFAULT_MARGIN (1 logit);
- KL(llama.cpp || llambda) at the prompt end <= 0.05 nats (over llama.cpp's top 64 tokens
  and one bucket for the rest: a lower bound of the full KL, which those tokens dominate).
Then chat: Model.chat on the template-less file uses the gemma format, and its greedy reply
follows llama.cpp's path up to the first step where llama.cpp's margin is not clear.
"""
import json
from pathlib import Path

import numpy as np
import pytest

import llambda
from llambda.model import catalog
from llambda.bench.llamacpp_compare import DEFAULT_KL_MAX, DEFAULT_MARGIN, check_recorded, format_report
import fetched_files
from repo_paths import FIXTURES

FIXTURE = FIXTURES / "gemma3_270m_llamacpp.json"
CHAT_QUESTION = "What is the capital of France? Answer in one word."


@pytest.fixture(scope="module")
def gemma():
    path = fetched_files.gemma_gguf()
    with llambda.load(str(path), n_ctx=256, progress=False) as model:
        yield model


@pytest.fixture(scope="module")
def recording():
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def test_recording_is_of_this_file(recording):
    assert recording["model"] == catalog.lookup("gemma3-270m").file_name
    assert len(recording["prompts"]) >= 4 and recording["steps"] >= 16


@pytest.mark.parametrize("index", range(4))
def test_matches_llamacpp(gemma, recording, index):
    report = check_recorded(gemma, recording["prompts"][index], margin=DEFAULT_MARGIN, kl_max=DEFAULT_KL_MAX)
    assert report.ok, format_report(report, gemma.detokenize)
    assert sum(s.clear for s in report.steps) >= 8     # the argmax check had something to check


def test_chat_without_a_template_follows_llamacpp(gemma, recording):
    assert gemma.chat_template.name == "gemma" and gemma.chat_template.builtin
    messages = [{"role": "user", "content": CHAT_QUESTION}]
    record = next(r for r in recording["prompts"] if CHAT_QUESTION in r["prompt"])
    assert gemma.render_chat(messages) == record["prompt"]
    reply = "".join(gemma.chat(messages, temperature=0, max_tokens=len(record["path"]), ignore_eos=True))
    # llama.cpp's path up to its first unclear step is what a greedy reply must produce
    margins = [np.float64(logits[0]) - logits[1] for logits in record["top_logits"]]
    clear = next((i for i, m in enumerate(margins) if m < DEFAULT_MARGIN), len(margins))
    expected = gemma.detokenize(record["path"][:clear])
    assert clear >= 8 and reply.startswith(expected), (reply, expected)
