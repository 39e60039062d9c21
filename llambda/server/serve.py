"""``llambda serve``: load a model once and serve it over HTTP with uvicorn until SIGTERM or SIGINT.

Shutdown: uvicorn stops accepting connections at the signal and waits for the open ones; the
server refuses new requests at once (503), lets running requests go on for ``grace_s``, then
cancels what is left (a stream ends with an error event, a plain request with a 503), so the
process exits 0 within a few seconds of the signal whatever the clients asked for.
"""
import signal
import socket
import sys
from pathlib import Path


def model_names(model, model_arg):
    """The id /v1/models shows (the GGUF's file name without .gguf) and the other names a
    request may use for the model: the file name, the ``--model`` argument as given, the
    catalogue name."""
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


def listen(host, port):
    """A bound, listening socket: port 0 picks a free port (tests, benches read it back)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


def serve(model_arg=None, *, host="127.0.0.1", port=8080, parallel=4, n_ctx=None, threads=None, max_waiting=64,
          grace_s=3.0, log_level="warning", kv_cache_mb=None, kv_type=None):
    try:
        import uvicorn
        from .app import create_app
    except ImportError as e:
        from llambda.errors import UserError
        raise UserError(f"llambda serve needs the serve extra ({e.name} is missing): "
                        "pip install 'llambda[serve]'") from None
    import llambda

    model = llambda.load(model_arg, n_ctx=n_ctx, threads=threads, parallel=parallel, max_waiting=max_waiting,
                         kv_cache_mb=kv_cache_mb, kv_type=kv_type)
    try:
        # every step shape's plan now, so that no request's first token waits for one
        model.engine.call(model.net.warm_plans)
        model_id, aliases = model_names(model, model_arg)
        app = create_app(model, model_id, aliases)
        served = app.state.served
        sock = listen(host, port)

        class Server(uvicorn.Server):
            async def shutdown(self, sockets=None):
                served.drain(grace_s)
                await super().shutdown(sockets=sockets)

        config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=grace_s + 5, timeout_keep_alive=5)
        server = Server(config)
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        print(f"llambda: serving {model_id} at http://{shown}:{bound_port}/v1 (parallel {parallel}, "
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
