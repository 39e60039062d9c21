"""llama-server's utility endpoints, in its shapes: the model's tokenizer and chat template over HTTP.

    POST /tokenize        {"content", "add_special": false, "parse_special": true, "with_pieces": false}
                          -> {"tokens": [id, ...]}, or with pieces [{"id", "piece"}, ...]
    POST /detokenize      {"tokens": [id, ...]} -> {"content": text}
    POST /apply-template  {"messages": [...]} -> {"prompt": text}

``content`` may also be llama-server's mixed list of strings and token ids (only the first string
gets the special tokens ``add_special`` adds). A piece is its text when its bytes are whole UTF-8,
else the list of its byte values (a character split between tokens). The prompt of
/apply-template is what /v1/chat/completions would generate from, to edit and send to
/v1/completions. Bad input is a 400 in OpenAI's error shape naming the field (docs/server.md).
"""
from typing import Annotated, Optional, Union

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import Field

from llambda.errors import UserError
from . import schemas
from .errors import ApiError

router = APIRouter()


class TokenizeRequest(schemas._Body):
    content: Union[str, list[Union[str, int]]]
    add_special: bool = False                # llama-server's default: no BOS unless asked
    parse_special: bool = True               # "<|im_start|>" in the text is that control token
    with_pieces: bool = False


class DetokenizeRequest(schemas._Body):
    tokens: list[int]


class ApplyTemplateRequest(schemas._Body):
    messages: Annotated[list[schemas.Message], Field(min_length=1)]
    # llama-server renders these too; here they are refused rather than left out of the prompt
    # (the chat route renders them through llambda/chat/turn.py, which gives ids, not text)
    tools: Optional[list] = None
    chat_template_kwargs: Optional[dict] = None


def _model(request):
    return request.app.state.served.model


async def _parse(request, schema):
    from .app import parse                   # (app.py includes this router: imported at call time)
    return await parse(request, schema)


def _check_id(tokenizer, token, field):
    if not 0 <= token < tokenizer.vocab_size:
        raise ApiError(400, f"{field}: token id {token} is outside the vocabulary (0..{tokenizer.vocab_size - 1})",
                       param=field, code="invalid_token_id")
    return token


def piece(tokenizer, token):
    """A token's piece as llama-server shows it: text, or its byte values when not whole UTF-8."""
    raw = tokenizer.token_bytes(token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


@router.post("/tokenize")
async def tokenize(request: Request):
    req = await _parse(request, TokenizeRequest)
    tokenizer = _model(request).tokenizer
    parts = [req.content] if isinstance(req.content, str) else req.content

    def ids():
        out = []
        for i, part in enumerate(parts):
            field = "content" if isinstance(req.content, str) else f"content[{i}]"
            if isinstance(part, int):
                out.append(_check_id(tokenizer, part, field))
                continue
            try:
                out += tokenizer.encode(part, add_special=req.add_special and i == 0,
                                        parse_special=req.parse_special)
            except UserError as e:
                raise ApiError(400, f"{field}: {e}", param=field) from None
        return out
    tokens = await run_in_threadpool(ids)
    if req.with_pieces:
        return {"tokens": [{"id": t, "piece": piece(tokenizer, t)} for t in tokens]}
    return {"tokens": tokens}


@router.post("/detokenize")
async def detokenize(request: Request):
    req = await _parse(request, DetokenizeRequest)
    tokenizer = _model(request).tokenizer
    for i, token in enumerate(req.tokens):
        _check_id(tokenizer, token, f"tokens[{i}]")
    return {"content": await run_in_threadpool(tokenizer.decode, req.tokens)}


@router.post("/apply-template")
async def apply_template(request: Request):
    req = await _parse(request, ApplyTemplateRequest)
    for field in ("tools", "chat_template_kwargs"):
        if getattr(req, field):
            raise ApiError(400, f"{field} is not supported by /apply-template (it renders messages alone)",
                           param=field, code="unsupported_parameter")
    problem = schemas.unsupported_content(req.messages)      # an image part was a 500 (found by the HTTP fuzzer)
    if problem is not None:
        raise ApiError(400, problem[1], param=problem[0], code="unsupported_parameter")
    model = _model(request)
    try:
        prompt = await run_in_threadpool(model.render_chat, schemas.message_dicts(req))
    except UserError as e:
        raise ApiError(400, str(e), param="messages") from None
    return {"prompt": prompt}
