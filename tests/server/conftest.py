"""Fixtures the server tests share."""
import pytest

from server_process import QWEN3_TEMPLATE, default_model_server


@pytest.fixture(scope="module")
def qwen_server(default_gguf):
    """The default model behind Qwen3's chat template: the <tool_call> format, <think> blocks."""
    s = default_model_server(default_gguf, "--chat-template", str(QWEN3_TEMPLATE))
    yield s
    assert s.stop() == 0, "".join(s.log)
