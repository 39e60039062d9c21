"""`llambda serve` as deployed (issue 36, part 1): API keys on every route but /health, CORS,
TLS with a self-signed certificate made here, and the warning for a server open beyond
loopback without a key. Real servers on loopback with a tiny random model (ServerProcess);
every wait is bounded."""
import datetime
import http.client
import ipaddress
import json
import ssl
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
x509 = pytest.importorskip("cryptography.x509")

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llambda.errors import UserError
from llambda.server import auth
from synth import write_random_llama
from server_process import ServerProcess

N_CTX = 128
KEYS = ("sk-first-0123456789", "sk-second-abcdef")        # in a key file, with a comment and blank lines
GOOD_ORIGIN, BAD_ORIGIN = "https://chat.example", "https://evil.example"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("security") / "tiny.gguf"
    write_random_llama(path, n_layer=1, dim=64, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=300,
                       tensor_type="Q8_0", n_ctx=N_CTX, seed=5)
    return path


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(f"# llambda keys\n\n{KEYS[0]}\n   \n# the second client\n  {KEYS[1]}  \n")
    return path


@pytest.fixture(scope="module")
def keyed(model_path, key_file):
    """Two keys from a file, one browser origin allowed, /metrics behind the key."""
    s = ServerProcess(model_path, "--ctx", str(N_CTX), "--parallel", "2", "--threads", "1",
                      "--api-key-file", str(key_file), "--cors-origins", GOOD_ORIGIN)
    yield s
    assert s.stop() == 0, "".join(s.log)


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


def routes(server):
    """Every route of the API: (method, path, body)."""
    chat = dict(model=server.model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    return [("GET", "/v1/models", None), ("GET", f"/v1/models/{server.model_id}", None),
            ("POST", "/v1/completions", dict(model=server.model_id, prompt="hi", max_tokens=2)),
            ("POST", "/v1/chat/completions", chat),
            ("POST", "/v1/chat/completions", dict(chat, stream=True)),
            ("GET", "/metrics", None)]


def assert_refused(status, headers, raw, code="invalid_api_key"):
    assert status == 401, raw
    assert headers.get("www-authenticate") == "Bearer" or headers.get("WWW-Authenticate") == "Bearer"
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, code)
    assert KEYS[0] not in error["message"]
    return error


# -- keys ---------------------------------------------------------------------------------
def test_every_route_needs_a_key(keyed):
    for method, path, body in routes(keyed):
        missing = assert_refused(*keyed.request(method, path, body))
        assert "Authorization: Bearer" in missing["message"]
        wrong = assert_refused(*keyed.request(method, path, body, headers=bearer("sk-wrong")))
        assert wrong["message"] != missing["message"]
        # a prefix, the key with more after it, another auth scheme: all refused
        for almost in (bearer(KEYS[0][:-1]), bearer(KEYS[0] + "x"), {"Authorization": f"Basic {KEYS[0]}"},
                       {"x-api-key": KEYS[1][1:]}):
            assert_refused(*keyed.request(method, path, body, headers=almost))
        for key in KEYS:
            status, headers, raw = keyed.request(method, path, body, headers=bearer(key))
            assert status == 200, (method, path, raw)
        status, _, raw = keyed.request(method, path, body, headers={"x-api-key": KEYS[1]})
        assert status == 200, (method, path, raw)


def test_health_and_the_chat_page_need_no_key(keyed):
    assert keyed.get("/health")[0] == 200
    assert keyed.request("GET", "/health", headers=bearer("sk-wrong"))[0] == 200
    # the chat page and its files load without a key (a browser cannot send one on page load);
    # what they answer is the page's business, but never 401
    for path in ("/", "/static/app.js"):
        assert keyed.get(path)[0] != 401
    assert_refused(*keyed.request("POST", "/", {}))             # only GET/HEAD of the page are open
    assert_refused(*keyed.get("/static/../v1/models"))
    for path in ("/openapi.json", "/docs", "/v1/nothing"):     # everything else, known or not, needs the key
        assert_refused(*keyed.get(path))


def test_the_official_client_with_a_key_streams(keyed):
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEYS[1], max_retries=0, timeout=60)
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=keyed.model_id, messages=[{"role": "user", "content": "hello"}], max_tokens=4, stream=True,
        extra_body={"ignore_eos": True}) if c.choices]
    assert len(pieces) >= 2
    refused = openai.OpenAI(base_url=keyed.url + "/v1", api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as e:
        refused.chat.completions.create(model=keyed.model_id, messages=[{"role": "user", "content": "x"}],
                                        max_tokens=1, stream=True)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"


def test_refusals_are_counted(keyed):
    def refused_count():
        status, _, raw = keyed.request("GET", "/metrics", headers=bearer(KEYS[0]))
        assert status == 200
        lines = [line for line in raw.decode().splitlines()
                 if line.startswith('llambda_http_errors_total{status="401"}')]
        return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0
    before = refused_count()
    assert_refused(*keyed.get("/v1/models"))
    assert refused_count() == before + 1


# -- CORS -----------------------------------------------------------------------------------
def preflight(server, origin):
    return server.request("OPTIONS", "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_for_an_allowed_and_a_refused_origin(keyed):
    status, headers, _ = preflight(keyed, GOOD_ORIGIN)          # no key: a browser sends none here
    h = {k.lower(): v for k, v in headers.items()}
    assert status == 200 and h["access-control-allow-origin"] == GOOD_ORIGIN
    assert "POST" in h["access-control-allow-methods"]
    allowed = {x.strip() for x in h["access-control-allow-headers"].lower().split(",")}
    assert {"authorization", "content-type"} <= allowed
    status, headers, _ = preflight(keyed, BAD_ORIGIN)
    assert status == 400 and "access-control-allow-origin" not in {k.lower() for k in headers}

    for origin, allowed in ((GOOD_ORIGIN, True), (BAD_ORIGIN, False)):
        for key_headers, want in ((bearer(KEYS[0]), 200), ({}, 401)):    # a page can read its 401 too
            status, headers, _ = keyed.request("GET", "/v1/models", headers={"Origin": origin, **key_headers})
            h = {k.lower(): v for k, v in headers.items()}
            assert status == want
            assert h.get("access-control-allow-origin") == (origin if allowed else None)
            if allowed:
                assert "retry-after" in h["access-control-expose-headers"].lower()


# -- TLS ------------------------------------------------------------------------------------
def self_signed(tmp_path, name="server"):
    """(key file, certificate file) of a self-signed certificate for 127.0.0.1 and localhost."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "llambda test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(ski, critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(key, hashes.SHA256()))
    key_path, cert_path = tmp_path / f"{name}.key", tmp_path / f"{name}.pem"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


def test_tls_with_a_self_signed_certificate(model_path, tmp_path):
    key_path, cert_path = self_signed(tmp_path)
    trust = ssl.create_default_context(cafile=str(cert_path))
    s = ServerProcess(model_path, "--ctx", str(N_CTX), "--parallel", "1", "--threads", "1",
                      "--ssl-keyfile", str(key_path), "--ssl-certfile", str(cert_path),
                      "--api-key", "sk-tls", "--metrics-public",
                      headers=bearer("sk-tls"), ssl_context=trust)
    try:
        assert s.url.startswith("https://127.0.0.1:")
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="sk-tls", max_retries=0, timeout=60,
                               http_client=openai.DefaultHttpxClient(verify=trust))
        r = client.chat.completions.create(model=s.model_id, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
        assert [m.id for m in client.models.list().data] == [s.model_id]
        # --metrics-public: /metrics answers a wrong key, the API does not
        assert s.request("GET", "/metrics", headers=bearer("sk-wrong"))[0] == 200
        assert s.metrics()["llambda_generated_tokens_total"] >= 3
        assert_refused(*s.request("GET", "/v1/models", headers=bearer("sk-wrong")))
        # no CORS unless asked for
        h = {k.lower() for k in s.request("GET", "/v1/models", headers={"Origin": GOOD_ORIGIN})[1]}
        assert "access-control-allow-origin" not in h
        # a client that does not trust the certificate, or speaks plain HTTP, gets nowhere
        with pytest.raises(urllib.error.URLError) as e:
            urllib.request.urlopen(s.url + "/health", timeout=10)
        assert isinstance(e.value.reason, ssl.SSLCertVerificationError)
        with pytest.raises((OSError, http.client.HTTPException)):
            urllib.request.urlopen(s.url.replace("https://", "http://") + "/health", timeout=10).read()
        assert not any("warning" in line for line in s.log)
    finally:
        assert s.stop() == 0, "".join(s.log)


# -- the warning ----------------------------------------------------------------------------
def test_open_beyond_loopback_without_a_key_warns(model_path):
    s = ServerProcess(model_path, "--host", "0.0.0.0", "--ctx", str(N_CTX), "--parallel", "1", "--threads", "1")
    assert s.stop() == 0, "".join(s.log)            # stopped at once: only its start-up lines matter
    warnings = [line for line in s.log if "warning" in line]
    assert len(warnings) == 1 and "0.0.0.0" in warnings[0] and "--api-key" in warnings[0], s.log


def test_no_warning_on_loopback(keyed):
    assert not any("warning" in line for line in keyed.log)


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("localhost", True), ("::ffff:127.0.0.1", True),
    ("0.0.0.0", False), ("::", False), ("192.168.1.20", False), ("10.0.0.1", False), ("fe80::1%eth0", False),
    ("example.org", False),
])
def test_is_loopback(host, loopback):
    assert auth.is_loopback(host) is loopback


# -- what the user gives, checked -----------------------------------------------------------
def test_key_file_rules(tmp_path, key_file):
    assert auth.read_key_file(key_file) == list(KEYS)
    for text, needle in (("", "holds no key"), ("# only a comment\n\n", "holds no key"),
                         ("sk-one\nsk two\n", "line 2"), ("sk-caf\u00e9\n", "line 1")):
        path = tmp_path / "k.txt"
        path.write_text(text, encoding="utf-8")
        with pytest.raises(UserError, match=needle) as e:
            auth.read_key_file(path)
        assert str(path) in str(e.value) and "\n" not in str(e.value)
    path.write_bytes(b"\xff\xfe sk")
    with pytest.raises(UserError, match="UTF-8"):
        auth.read_key_file(path)
    with pytest.raises(UserError, match="no such file"):
        auth.read_key_file(tmp_path / "nope.txt")
    with pytest.raises(UserError, match="cannot read"):
        auth.read_key_file(tmp_path)                     # a directory


def test_origins_and_keys_checked():
    assert auth.check_origins(["*", "HTTPS://Chat.Example", "http://localhost:5173"]) == [
        "*", "https://chat.example", "http://localhost:5173"]
    for bad in ("https://chat.example/", "chat.example", "https://chat.example/app", ""):
        with pytest.raises(UserError, match="--cors-origins"):
            auth.check_origins([bad])
    for bad in ("", "has space", "tab\there", "caf\u00e9"):
        with pytest.raises(UserError, match="--api-key"):
            auth.check_keys([bad])
    with pytest.raises(UserError):
        auth.check_keys("sk-a-string-not-a-list")


def test_create_app_checks_its_arguments():
    from types import SimpleNamespace
    from llambda.server import create_app
    model = SimpleNamespace(stats=lambda: {})
    with pytest.raises(UserError, match="--api-key"):
        create_app(model, "m", api_keys=[""])
    with pytest.raises(UserError, match="--cors-origins"):
        create_app(model, "m", cors_origins=["https://x.example/"])


def test_every_key_is_compared(monkeypatch):
    """No early exit: a match on the first key still compares against the others."""
    calls = []
    guard = auth.RequireApiKey(None, ["sk-a", "sk-b", "sk-c"])
    real = auth.hmac.compare_digest

    def counting(a, b):
        calls.append(1)
        return real(a, b)
    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    assert guard.matches(b"sk-a") and guard.matches(b"sk-c") and not guard.matches(b"sk-d")
    assert len(calls) == 9
