"""Slow, idle, greedy and vanishing clients (issue 39; llambda/server/connections.py): a real
`llambda serve` with a 1 s read timeout and a cap of 4 connections per client, driven over raw
sockets. Every socket wait is bounded; the bounds are far above the server's timeout, so a
server that never times out fails them and a slow machine does not."""
import json
import re
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from synth import write_random_llama
from server_process import ServerProcess

READ_TIMEOUT_S, PER_CLIENT = 1, 4
WAIT_S = 30                 # a socket wait: a server that holds the connection fails it


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("slow") / "tiny.gguf"
    write_random_llama(path, n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=300,
                       tensor_type="Q8_0", n_ctx=256, seed=11)
    s = ServerProcess(path, "--ctx", "256", "--parallel", "2", "--threads", "1", "--read-timeout", str(READ_TIMEOUT_S),
                      "--max-connections-per-client", str(PER_CLIENT))
    yield s
    assert s.stop() == 0, "".join(s.log)


def connect(server):
    host, port = server.url.split("//")[1].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=WAIT_S)
    return sock


def request_bytes(path="/v1/completions", body=None, content_length=None, keep_alive=False):
    body = json.dumps(body if body is not None else {"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) if content_length is None else content_length}\r\n"
            + ("" if keep_alive else "Connection: close\r\n") + "\r\n")
    return head.encode() + body


def read_all(sock):
    """Everything the server sends until it closes (bounded by the socket's timeout)."""
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def status_and_body(raw):
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(re.match(rb"HTTP/1\.1 (\d+)", head).group(1)), head.decode("latin-1").lower(), body


def assert_error_body(body, code):
    error = json.loads(body)["error"]
    assert isinstance(error["message"], str) and error["type"] and "param" in error
    assert error["code"] == code


def errors(server, status):
    _, _, raw = server.get("/metrics")
    m = re.search(rf'llambda_http_errors_total{{status="{status}"}} (\S+)', raw.decode())
    return float(m.group(1)) if m else 0.0


def test_an_idle_connection_is_closed(server):
    with connect(server) as sock:
        assert read_all(sock) == b""          # closed without an answer: nothing was asked


def test_a_dribbled_head_gets_408(server):
    raw = request_bytes()
    with connect(server) as sock:
        for b in raw[:20]:                     # slowloris: never the whole head
            try:
                sock.send(bytes([b]))
            except OSError:                    # answered and closed already
                break
            time.sleep(0.05)
        status, _, body = status_and_body(read_all(sock))
    assert status == 408
    assert_error_body(body, "request_timeout")


def test_a_body_shorter_than_its_content_length_gets_408(server):
    raw = request_bytes(content_length=500)
    with connect(server) as sock:
        sock.sendall(raw)                      # and then nothing: the route waits for the rest
        status, _, body = status_and_body(read_all(sock))
    assert status == 408
    assert_error_body(body, "request_timeout")
    assert server.get("/health")[0] == 200


def test_an_answer_given_before_the_body_is_the_only_one(server):
    """A route that answers without reading the body (an unknown path's 404) leaves the body
    unread: at the deadline the connection closes, with no 408 after the 404."""
    with connect(server) as sock:
        sock.sendall(request_bytes(path="/nowhere", content_length=500, keep_alive=True))
        data = read_all(sock)
    assert data.startswith(b"HTTP/1.1 404") and data.count(b"HTTP/1.1 ") == 1, data


def test_a_body_cut_by_a_close_is_no_500(server):
    before = errors(server, 500)
    for cut in (5, 40):
        with connect(server) as sock:
            sock.sendall(request_bytes(content_length=500)[:-cut])
        time.sleep(0.2)
    m = server.wait_metrics(lambda m: m["llambda_requests_running"] == 0)
    assert m["llambda_requests_running"] == 0
    assert errors(server, 500) == before
    assert "Traceback" not in "".join(server.log)
    assert server.post_json("/v1/completions", {"model": server.model_id, "prompt": "hi", "max_tokens": 2})[0] == 200


def test_answering_has_no_deadline(server):
    """The deadline covers receiving the request, not generating or reading the reply: a client
    that reads its stream late, and a keep-alive connection's second request, are served."""
    body = {"model": server.model_id, "prompt": "hi", "max_tokens": 8, "stream": True, "ignore_eos": True}
    with connect(server) as sock:
        sock.sendall(request_bytes(body=body, keep_alive=True))
        time.sleep(READ_TIMEOUT_S * 2.5)
        data = b""
        while b"0\r\n\r\n" not in data:       # the chunked stream's end
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
        assert b"data: [DONE]" in data
        time.sleep(READ_TIMEOUT_S / 2)         # within the keep-alive time: the second request
        sock.sendall(request_bytes())
        status, _, _ = status_and_body(read_all(sock))
    assert status == 200


def test_connections_per_client_are_capped(server):
    held = [connect(server) for _ in range(PER_CLIENT)]
    try:
        time.sleep(0.2)
        with connect(server) as extra:
            try:
                extra.sendall(request_bytes())
            except OSError:
                pass
            status, head, body = status_and_body(read_all(extra))
        assert status == 429
        assert "retry-after: 1" in head
        assert_error_body(body, "too_many_connections")
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    assert server.post_json("/v1/completions", {"model": server.model_id, "prompt": "hi", "max_tokens": 2})[0] == 200


def test_a_request_that_is_not_http_gets_an_openai_400(server):
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nBad Header\r\n\r\n")
        status, _, body = status_and_body(read_all(sock))
    assert status == 400
    assert_error_body(body, "invalid_http_request")


@pytest.mark.parametrize("flag,value", [("--read-timeout", "0"), ("--read-timeout", "nan"),
                                        ("--max-connections-per-client", "0"), ("--max-connections", "-3")])
def test_bad_connection_flags_are_one_line(flag, value):
    r = subprocess.run([sys.executable, "-m", "llambda.cli", "serve", flag, value], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert flag in r.stderr.strip().splitlines()[-1]
