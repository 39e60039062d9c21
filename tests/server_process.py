"""A real `llambda serve` in a child process on a free loopback port, for the server tests.

The child inherits the environment (LLAMBDA_BACKEND included), binds port 0 and prints the
address it got; every wait here is bounded in time.
"""
import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

START_TIMEOUT_S = 120


class ServerProcess:
    def __init__(self, model, *options, headers=None, ssl_context=None):
        """``headers`` go with every request made here (an API key); ``ssl_context`` verifies an
        https server's certificate."""
        self.headers, self.ssl_context = dict(headers or {}), ssl_context
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llambda.cli", "serve", "--model", str(model), "--port", "0", *options],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines = queue.Queue()
        self.log = []
        threading.Thread(target=self._drain, daemon=True).start()
        self.url = self._wait_for_address()
        self.wait_healthy()

    def _drain(self):
        for line in self.proc.stderr:
            self.log.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def _wait_for_address(self):
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            m = re.search(r"serving (\S+) at (https?://\S+)/v1", line)
            if m:
                self.model_id = m.group(1)
                return m.group(2)
        self.stop()
        raise RuntimeError("the server did not start:\n" + "".join(self.log))

    def wait_healthy(self, timeout_s=30):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the server never became healthy:\n" + "".join(self.log))

    # -- raw HTTP (urllib: no client library between the test and the bytes) ----------
    def request(self, method, path, body=None, headers=None, timeout=60):
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
        elif isinstance(body, str):
            body = body.encode()
        req = urllib.request.Request(self.url + path, data=body, method=method,
                                     headers={"Content-Type": "application/json", **self.headers, **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self.ssl_context) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def get(self, path):
        return self.request("GET", path)

    def post_json(self, path, body):
        status, headers, raw = self.request("POST", path, body)
        return status, headers, json.loads(raw)

    def metrics(self):
        status, _, raw = self.get("/metrics")
        assert status == 200
        out = {}
        for line in raw.decode().splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait_metrics(self, predicate, timeout_s=20):
        """Poll /metrics until predicate(metrics) holds; the last metrics either way."""
        deadline = time.monotonic() + timeout_s
        m = self.metrics()
        while not predicate(m) and time.monotonic() < deadline:
            time.sleep(0.05)
            m = self.metrics()
        return m

    # -- ending ---------------------------------------------------------------------
    def signal(self, sig=signal.SIGTERM):
        self.proc.send_signal(sig)

    def stop(self, timeout_s=30):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


# ---------------------------------------------------------------------------
# The default model's servers of the chat-shaped tests (tools, Responses, Messages)
# ---------------------------------------------------------------------------

QWEN3_TEMPLATE = __import__("pathlib").Path(__file__).parent / "fixtures" / "templates" / "Qwen-Qwen3-0.6B.jinja"
CLIENT_TIMEOUT_S = 120


def default_model_server(gguf, *options, headers=None):
    """`llambda serve` of the default model (a real vocabulary): 2 slots of 2048, one thread."""
    return ServerProcess(gguf, "--ctx", "2048", "--parallel", "2", "--threads", "1", *options, headers=headers)


def openai_client(server, api_key="none"):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=CLIENT_TIMEOUT_S)
