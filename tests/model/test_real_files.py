"""Real GGUF files against llama.cpp, when both are at hand (skipped otherwise).

Runs llambda.bench.llamacpp_compare's checks (the ones tools/compare_llamacpp.py
prints) on every *.gguf in the directories of LLAMBDA_REAL_MODELS
(os.pathsep-separated; default: the cache's models directory, which holds the
default model once fetched), with each built-in prompt:
- prompt token ids equal llama.cpp's (specials added and parsed, and neither);
- teacher-forced along llama.cpp's greedy path (16 steps), the argmax equals
  llama.cpp's wherever llama.cpp's top-2 margin is >= 1 logit;
- KL(llama.cpp || llambda) at the prompt end <= 0.05 nats.
Needs llama-cpp-python.

    LLAMBDA_REAL_MODELS=~/models:$HOME/.cache/llambda/models .venv/bin/python -m pytest tests/model/test_real_files.py
"""
import importlib.util
import os
from pathlib import Path

import pytest

from llambda.runtime import paths


def _model_dirs():
    value = os.environ.get("LLAMBDA_REAL_MODELS")
    if value is None:
        return [paths.cache_dir() / "models"]
    return [Path(part).expanduser() for part in value.split(os.pathsep) if part]


def _cases():
    if importlib.util.find_spec("llama_cpp") is None:    # before reading any file
        return [pytest.param(None, marks=pytest.mark.skip(reason="llama-cpp-python is not installed"))]
    files = {}          # by name: a copy of the same file in a second directory is not run twice
    for d in _model_dirs():
        for p in sorted(d.glob("*.gguf")) if d.is_dir() else ():
            files.setdefault(p.name, p)
    files = [files[name] for name in sorted(files)]
    if not files:
        return [pytest.param(None, marks=pytest.mark.skip(
            reason=f"no *.gguf in {os.pathsep.join(map(str, _model_dirs()))} (set LLAMBDA_REAL_MODELS)"))]
    return [pytest.param(path, id=path.name) for path in files]


@pytest.mark.parametrize("path", _cases())
def test_real_file_matches_llamacpp(path):
    from llambda.bench.llamacpp_compare import DEFAULT_PROMPTS, Pair, compare_prompt, format_report
    with Pair(path, DEFAULT_PROMPTS) as pair:
        reports = [compare_prompt(pair, prompt) for prompt in DEFAULT_PROMPTS]
        text = "\n\n".join(format_report(r, pair.model.detokenize) for r in reports)
    assert all(r.ok for r in reports), f"{path.name}:\n{text}"
