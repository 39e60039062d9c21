"""Who may call the server: API keys, and the browser origins allowed to call it (CORS).

    install(app, api_keys=["sk-local-1"], metrics_public=False, cors_origins=["https://example.org"])

A request shows its key as ``Authorization: Bearer KEY`` (OpenAI's clients) or ``x-api-key: KEY``
(Anthropic's). The check is a pure ASGI middleware, not a FastAPI dependency: it answers before
any route runs, so it guards streamed responses and every route added later alike. Without keys
nothing is checked.

Open without a key, whatever the keys:
- ``/health``: load balancers and orchestrators probe it without credentials;
- CORS preflights (OPTIONS with Origin and Access-Control-Request-Method): a browser sends them
  without credentials, before the real request that carries the key;
- ``GET``/``HEAD`` of ``/`` and ``/static/...``, the chat page: a browser loading a page cannot
  send a header, so the page asks for the key and sends it with its own API calls;
- ``/metrics`` with ``metrics_public``.

Keys are compared as SHA-256 digests with hmac.compare_digest against every key, with no early
exit: how long a refusal takes says nothing about how much of a key was right, nor which key.

This module imports only the standard library at the top (the CLI reads key files with it even
where the serve extra is missing); Starlette is imported by install().
"""
import hashlib
import hmac
import ipaddress
import json
import re
from pathlib import Path

from llambda.errors import UserError

OPEN_PATHS = ("/health",)
PAGE_PATHS = ("/",)                 # GET/HEAD only, as is everything under PAGE_PREFIXES
PAGE_PREFIXES = ("/static/",)
CORS_ALLOWED_METHODS = ("GET", "POST", "OPTIONS")
CORS_EXPOSED_HEADERS = ("Retry-After",)        # a page may read when to try again after a 429
# an origin as a browser sends it: scheme://host[:port], no path (https://a.example/ never matches)
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s?#@]+")


# -- checking what the user gave -------------------------------------------------------
def check_key(key, source="--api-key"):
    """A key must survive an HTTP header unchanged: printable ASCII, no spaces. The key itself
    is never repeated in the message (it is a secret, and may sit in a shared log)."""
    if not isinstance(key, str) or not key:
        raise UserError(f"{source}: an API key may not be empty")
    if not all("!" <= c <= "~" for c in key):
        raise UserError(f"{source}: an API key must be printable ASCII without spaces "
                        f"(a key of {len(key)} characters is not)")
    return key


def check_keys(keys, source="--api-key"):
    if isinstance(keys, str):
        raise UserError(f"{source}: expected a list of keys, not one string")
    return [check_key(k, source) for k in keys]


def read_key_file(path):
    """The keys in ``path``: one a line, blank lines and ``#`` comment lines skipped."""
    source = f"--api-key-file {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{source}: no such file") from None
    except UnicodeDecodeError:
        raise UserError(f"{source}: not UTF-8 text") from None
    except OSError as e:
        raise UserError(f"{source}: cannot read it ({e.strerror or e})") from None
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(check_key(line, f"{source}, line {number}"))
    if not keys:
        raise UserError(f"{source}: holds no key (one key a line; blank lines and # comments are skipped)")
    return keys


def check_origins(origins, source="--cors-origins"):
    """Origins as browsers send them (lower case): ``*`` or scheme://host[:port]."""
    if isinstance(origins, str):
        raise UserError(f"{source}: expected a list of origins, not one string")
    out = []
    for origin in origins:
        o = origin.strip().lower() if isinstance(origin, str) else origin
        if o != "*" and not (isinstance(o, str) and _ORIGIN.fullmatch(o)):
            raise UserError(f"{source}: {origin!r} is not an origin: expected * or scheme://host[:port] "
                            "with no path, not even a trailing /")
        out.append(o)
    return out


def is_loopback(host):
    """Whether an address (as a socket reports it) is reachable from this machine only."""
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return host == "localhost"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


# -- the check on each request ---------------------------------------------------------
def _digest(key: bytes):
    return hashlib.sha256(key).digest()


def _presented(headers):
    """The keys a request shows: Bearer credentials of Authorization, and x-api-key."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer":
                yield token.strip()
        elif name == b"x-api-key":
            yield value.strip()


def _is_preflight(scope):
    names = {name for name, _ in scope["headers"]}
    return scope["method"] == "OPTIONS" and b"origin" in names and b"access-control-request-method" in names


class RequireApiKey:
    """ASGI middleware: a request without one of ``keys`` gets 401 in OpenAI's error shape
    (a WebSocket is closed with 1008), except on the open routes (module docstring)."""

    def __init__(self, app, keys, metrics_public=False, on_refused=None):
        from .errors import error_body
        self.app = app
        self.digests = [_digest(k.encode()) for k in check_keys(keys)]
        self.open_paths = set(OPEN_PATHS) | ({"/metrics"} if metrics_public else set())
        self.on_refused = on_refused
        how = "send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
        self.bodies = {
            "missing": json.dumps(error_body(f"this server needs an API key: {how}",
                                             param=None, code="invalid_api_key")).encode(),
            "wrong": json.dumps(error_body("the API key is not valid for this server",
                                           param=None, code="invalid_api_key")).encode(),
        }

    def is_open(self, scope):
        path = scope["path"]
        if path in self.open_paths:
            return True
        if scope["type"] != "http":
            return False
        if (scope["method"] in ("GET", "HEAD") and (path in PAGE_PATHS or path.startswith(PAGE_PREFIXES))
                and ".." not in path.split("/")):      # /static/../v1/models routes nowhere; refused anyway
            return True
        return _is_preflight(scope)

    def matches(self, token: bytes):
        """Whether ``token`` is one of the keys: every key is compared, whatever the outcome."""
        given = _digest(token)
        found = False
        for digest in self.digests:
            found |= hmac.compare_digest(given, digest)
        return found

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or self.is_open(scope):
            return await self.app(scope, receive, send)
        tokens = list(_presented(scope["headers"]))
        verdicts = [self.matches(t) for t in tokens]       # each shown key checked in full
        if any(verdicts):
            return await self.app(scope, receive, send)
        if self.on_refused is not None:
            self.on_refused(401)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        body = self.bodies["wrong" if tokens else "missing"]
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def install(app, api_keys=(), metrics_public=False, cors_origins=(), on_refused=None):
    """Add the key check (when there are keys) and CORS (when there are origins) to a Starlette
    app. CORS is the outer one, so a browser can read a 401 too."""
    api_keys, cors_origins = check_keys(api_keys), check_origins(cors_origins)
    if api_keys:
        app.add_middleware(RequireApiKey, keys=api_keys, metrics_public=metrics_public, on_refused=on_refused)
    if cors_origins:
        from starlette.middleware.cors import CORSMiddleware
        # any request header: OpenAI's and Anthropic's browser clients send their own (x-stainless-*,
        # anthropic-version) beside Authorization and Content-Type; the origin list is the control
        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=CORS_ALLOWED_METHODS,
                           allow_headers=["*"], expose_headers=CORS_EXPOSED_HEADERS, allow_credentials=False)
    return app
