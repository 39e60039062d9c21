"""The OpenAI-compatible HTTP server (``llambda serve``; needs ``pip install 'llambda[serve]'``).

    app.py      routes: /v1/models, /v1/completions, /v1/chat/completions (SSE streaming), /health, /metrics
    schemas.py  request bodies (pydantic) and their mapping onto Model.submit
    errors.py   OpenAI-shaped error bodies for every 4xx/5xx
    metrics.py  the Prometheus view of the engine
    auth.py     API keys (an ASGI middleware) and CORS origins
    serve.py    model + uvicorn + graceful shutdown
    connections.py  uvicorn's h11 protocol with a read deadline (slowloris) and connection caps per client
    embeddings.py  POST /v1/embeddings over Model.embed (float or base64)
    responses.py   POST /v1/responses: OpenAI's Responses API, stateless, over the chat path
    anthropic_messages.py  POST /v1/messages[/count_tokens]: Anthropic's Messages API, over the chat path
    chat_bridge.py what those two share: their requests as chat requests, Served's turn and start
    static/     the chat page at / (index.html, chat.js, chat.css: no build step, no CDN)
"""
from .serve import serve

__all__ = ["serve", "create_app"]


def create_app(*args, **kwargs):
    """llambda.server.app.create_app (imported on use: FastAPI is an optional dependency)."""
    from .app import create_app
    return create_app(*args, **kwargs)
