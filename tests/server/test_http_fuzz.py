"""The HTTP fuzzer (tools/fuzz.py --http, tools/fuzz_http.py) on a seeded slice, and what its
campaigns found, each as a test of its own."""
import re
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from repo_paths import REPO
from synth import write_random_llama
from server_process import ServerProcess

SLICE_SEED, SLICE_CASES = 7, 40
SLICE_TIMEOUT_S = 600           # the slice's own server included; a hang inside it is caught per case


def test_a_seeded_slice_finds_nothing(tmp_path):
    """Every kind of case (fields, bodies, storms, cancels, slow clients, the context and the KV
    pool), health checks after each batch, and SIGTERM last: 0 failures."""
    r = subprocess.run([sys.executable, str(REPO / "tools" / "fuzz.py"), "--http", "--seed", str(SLICE_SEED),
                        "--cases", str(SLICE_CASES), "--timeout", "60", "--out", str(tmp_path / "failures")],
                       capture_output=True, text=True, timeout=SLICE_TIMEOUT_S, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr[-6000:]
    m = re.search(r"(\d+) http cases tried, (\d+) failures", r.stdout)
    assert m and int(m.group(1)) == SLICE_CASES and int(m.group(2)) == 0, r.stdout + r.stderr[-6000:]
    kinds = re.search(r"cases by kind: (.*)", r.stderr).group(1)
    for kind in ("field", "body", "sigterm"):
        assert kind in kinds, kinds           # the slice reaches the kinds it claims to


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzzfound") / "tiny.gguf"
    write_random_llama(path, n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=300,
                       tensor_type="Q8_0", n_ctx=256, seed=11)
    s = ServerProcess(path, "--ctx", "128", "--parallel", "2", "--threads", "1", "--max-waiting", "4")
    yield s
    assert s.stop() == 0, "".join(s.log)


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_more_choices_than_the_queue_holds_is_a_400_not_a_429_forever(server, route, body):
    """n choices wait together: with n above --max-waiting an idle server answered 429 with
    Retry-After, so a client retried for ever."""
    status, _, reply = server.post_json(route, dict(body, model=server.model_id, n=5, max_tokens=2))
    assert status == 400
    assert reply["error"]["param"] == "n" and "--max-waiting" in reply["error"]["message"]
    status, _, reply = server.post_json(route, dict(body, model=server.model_id, n=4, max_tokens=2))
    assert status == 200 and len(reply["choices"]) == 4


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text"}])
def test_apply_template_refuses_a_part_that_is_not_text(server, part):
    """/apply-template joined the parts' text: an image part (text None) was a 500 TypeError."""
    status, _, reply = server.post_json("/apply-template", {"messages": [{"role": "user", "content": [part]}]})
    assert status == 400
    assert reply["error"]["param"] == "messages[0].content[0]" and reply["error"]["code"] == "unsupported_parameter"
    status, _, _ = server.post_json("/apply-template", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}]})
    assert status == 200
