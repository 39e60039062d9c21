"""POST /v1/embeddings, in OpenAI's shape, over Model.embed (llambda/serving/embedding.py).

    {"model", "input": "text" | ["text", ...] | [id, ...] | [[id, ...], ...],
     "encoding_format": "float" | "base64", "dimensions": n, "user": ...}
    -> {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": [...]}],
        "model", "usage": {"prompt_tokens", "total_tokens"}}

Vectors are L2-normalized, as OpenAI's and llama-server's are, pooled as the server's
``--pooling`` or the GGUF says (mean for a model that says nothing). ``base64`` is the
little-endian float32 bytes of each vector, as OpenAI sends them (its Python client decodes
them). ``dimensions`` shortens OpenAI's own models; a llambda model has one width, so any
other value is a 400 that says it. ``user`` is ignored. Text is tokenized as llama-server
does (BOS/EOS where the model asks, special tokens parsed). Bad input is a 400 in OpenAI's
error shape naming ``input`` (``input[2]``: the third text).
"""
import asyncio
import base64
from typing import Literal, Optional, Union

import numpy as np
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from llambda.errors import UserError
from llambda.serving import embedding
from llambda.serving.engine import EngineBusy
from . import schemas
from .errors import ApiError

router = APIRouter()


class EmbeddingRequest(schemas._Body):
    model: str
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Optional[Literal["float", "base64"]] = None     # None: float
    dimensions: Optional[int] = None
    user: Optional[str] = None


def _check(served, req):
    """What every route checks before it runs anything: serving, and a model name it knows."""
    served.check_serving(req.model)
    width = served.model.config.dim
    if req.dimensions is not None and req.dimensions != width:
        raise ApiError(400, f"dimensions: this model's embeddings have {width} dimensions and cannot be "
                            f"shortened to {req.dimensions} (leave dimensions out, or ask for {width})",
                       param="dimensions", code="unsupported_parameter")


async def _cancel_on_disconnect(request, batch):
    """A client that goes away cancels the texts not embedded yet (their KV blocks freed before
    the engine's next step), as a chat request's sequence is."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    batch.cancel()


def _encoded(vector, encoding_format):
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


@router.post("/v1/embeddings")
async def embeddings(request: Request):
    from .app import RETRY_AFTER_S, parse
    served = request.app.state.served
    model = served.model
    req = await parse(request, EmbeddingRequest)
    _check(served, req)
    try:
        token_lists = await run_in_threadpool(embedding.token_lists, model, req.input, "input")
    except UserError as e:
        raise ApiError(400, str(e), param="input", code="invalid_input") from None
    try:
        batch = embedding.Batch(model.engine, token_lists, model.pooling)
    except UserError as e:                      # the GGUF's pooling_type gives no vector (rank)
        raise ApiError(400, str(e), param="model", code="unsupported_model") from None
    watcher = asyncio.ensure_future(_cancel_on_disconnect(request, batch))
    try:
        vectors = embedding.normalized(await run_in_threadpool(batch.run))
    except EngineBusy as e:
        raise ApiError(429, str(e), type="rate_limit_error", code="server_busy",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except UserError as e:
        if served.draining:                     # closed under it: not the request's fault
            raise ApiError(503, "the request was cancelled: the server is shutting down", type="server_error",
                           code="shutting_down") from None
        raise ApiError(400, str(e), param="input") from None
    finally:
        watcher.cancel()
    tokens = sum(len(ids) for ids in token_lists)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
            for i, v in enumerate(np.asarray(vectors))]
    return JSONResponse({"object": "list", "data": data, "model": req.model,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
