"""``llambda serve``: load a model once and serve it over HTTP with uvicorn until SIGTERM or SIGINT.

Shutdown: uvicorn stops accepting connections at the signal and waits for the open ones; the
server refuses new requests at once (503), lets running requests go on for ``grace_s``, then
cancels what is left (a stream ends with an error event, a plain request with a 503), so the
process exits 0 within a few seconds of the signal whatever the clients asked for.

Slow clients (connections.py): a request's head and body must arrive within ``read_timeout_s``
of its first byte (408 otherwise); connections are capped per client address and in total.

Security (auth.py): API keys on every route but /health (and the chat page), CORS origins,
TLS from a certificate and key handed to uvicorn; every flag is checked before the model loads.
Listening beyond loopback without a key prints a warning.
"""
import os
import signal
import socket
import ssl
import sys
from pathlib import Path

from llambda.errors import UserError
from . import auth


def model_names(model, model_arg):
    """The id /v1/models shows (the GGUF's file name without .gguf) and the other names a
    request may use for the model: the file name, the ``--model`` argument as given, the
    catalogue name. (``--alias`` names come on top: check_aliases.)"""
    from llambda.model import catalog
    from llambda.model import default_model
    if model_arg is None:
        file_name, extra = default_model.FILE_NAME, [catalog.DEFAULT]
    elif not Path(model_arg).exists() and model_arg in catalog.models():
        file_name, extra = catalog.lookup(model_arg).file_name, [model_arg]
    else:
        file_name, extra = Path(model_arg).name, [str(model_arg)]
    names = [Path(file_name).stem, file_name, *extra, Path(model.path).stem]    # the last: the converted file
    return names[0], set(names[1:]) - {names[0]}


def check_aliases(aliases):
    """``--alias`` names, in order, each once: more names for the model (``--alias gpt-4o-mini``),
    which /v1/models lists after the id (as vLLM lists its --served-model-name names)."""
    for name in aliases:
        if not isinstance(name, str) or not name.strip() or name != name.strip():
            raise UserError(f"--alias: expected a model name without surrounding spaces, got {name!r}")
    return list(dict.fromkeys(aliases))


def listen(host, port):
    """A bound, listening socket: port 0 picks a free port (tests, benches read it back)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


def check_tls(keyfile, certfile):
    """Both files or neither; a certificate and key that load together. Checked before the model
    loads, so a typo costs a second, not a model load and a traceback from uvicorn."""
    if keyfile is None and certfile is None:
        return False
    if keyfile is None or certfile is None:
        given, missing = ("--ssl-certfile", "--ssl-keyfile") if keyfile is None else ("--ssl-keyfile", "--ssl-certfile")
        raise UserError(f"{given} needs {missing} too (TLS takes both the certificate and its private key)")
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile)):
        if not Path(path).is_file():
            raise UserError(f"{flag} {path}: no such file")
        if not os.access(path, os.R_OK):
            raise UserError(f"{flag} {path}: not readable by this user")
    try:
        # an encrypted key is not supported: the empty password makes it fail here instead of
        # prompting on the terminal
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile, keyfile, password=b"")
    except (ssl.SSLError, OSError) as e:
        raise UserError(f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile}: not a PEM certificate and its "
                        f"unencrypted private key ({getattr(e, 'reason', None) or e})") from None
    return True


def serve(model_arg=None, *, host="127.0.0.1", port=8080, parallel=4, n_ctx=None, threads=None, max_waiting=64,
          grace_s=3.0, log_level="warning", kv_cache_mb=None, kv_type=None, api_keys=(), metrics_public=False,
          cors_origins=(), ssl_keyfile=None, ssl_certfile=None, aliases=(), reasoning_format="auto",
          tool_format=None, chat_template=None, pooling=None, read_timeout_s=30.0, max_connections_per_client=64,
          max_connections=1024):
    try:
        import uvicorn
        from .app import create_app
        from . import connections
    except ImportError as e:
        raise UserError(f"llambda serve needs the serve extra ({e.name} is missing): "
                        "pip install 'llambda[serve]'") from None
    import llambda

    # what the user gave, checked before the model loads
    api_keys, cors_origins = auth.check_keys(api_keys), auth.check_origins(cors_origins)
    tls = check_tls(ssl_keyfile, ssl_certfile)
    aliases = check_aliases(aliases)
    for flag, value in (("--read-timeout", read_timeout_s), ("--max-connections-per-client", max_connections_per_client),
                        ("--max-connections", max_connections)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise UserError(f"{flag}: expected a positive number, got {value!r}")
    if pooling is not None:
        from llambda.serving.embedding import check_pooling
        check_pooling(pooling, "--pooling")

    model = llambda.load(model_arg, n_ctx=n_ctx, threads=threads, parallel=parallel, max_waiting=max_waiting,
                         kv_cache_mb=kv_cache_mb, kv_type=kv_type, chat_template=chat_template)
    if pooling is not None:
        model.pooling = pooling       # /v1/embeddings' pooling, instead of the GGUF's pooling_type
    try:
        # every step shape's plan now, so that no request's first token waits for one
        model.engine.call(model.net.warm_plans)
        model_id, other_names = model_names(model, model_arg)
        app = create_app(model, model_id, other_names, api_keys=api_keys, metrics_public=metrics_public,
                         cors_origins=cors_origins, listed=aliases, reasoning_format=reasoning_format,
                         tool_format=tool_format)
        served = app.state.served
        sock = listen(host, port)

        class Server(uvicorn.Server):
            async def shutdown(self, sockets=None):
                served.drain(grace_s)
                await super().shutdown(sockets=sockets)

        # slow or idle clients time out, and connections are capped per client (connections.py)
        protocol = connections.connection_protocol(read_timeout_s, max_connections_per_client, max_connections,
                                                   on_refused=served.metrics.error)
        config = uvicorn.Config(app, http=protocol, log_level=log_level, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=grace_s + 5, timeout_keep_alive=5,
                                ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile)
        server = Server(config)
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        if not api_keys and not auth.is_loopback(bound_host):
            print(f"llambda: warning: listening on {shown}, beyond this machine, without an API key: anyone who "
                  "reaches the port may use the model (--api-key or --api-key-file)", file=sys.stderr, flush=True)
        scheme = "https" if tls else "http"
        print(f"llambda: serving {model_id} at {scheme}://{shown}:{bound_port}/v1 (parallel {parallel}, "
              f"context {model.n_ctx}, {max_waiting} may wait); Ctrl-C stops", file=sys.stderr, flush=True)
        # uvicorn re-raises the signal it caught once it has shut down, to end the process the
        # default way (killed by SIGTERM, KeyboardInterrupt for SIGINT): we end it with exit 0
        # instead, so both handlers it restores do nothing.
        previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            server.run(sockets=[sock])
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            sock.close()
    finally:
        model.close()
    print("llambda: server stopped", file=sys.stderr, flush=True)
    return 0
