"""Errors as the OpenAI API shapes them: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can cause ends here as a 4xx with that body, never a traceback, and the
server goes on serving: ApiError from the routes, pydantic's ValidationError from a body that
does not parse, Starlette's HTTPException for unknown paths and methods.
"""
import logging

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "json-or-python"}


class ApiError(Exception):
    def __init__(self, status, message, type="invalid_request_error", param=None, code=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


def error_body(message, type="invalid_request_error", param=None, code=None):
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def from_validation(error: ValidationError):
    """The first problem of a body that failed validation, naming its field as OpenAI does
    (``messages[0].content``)."""
    first = error.errors(include_url=False)[0]
    # a union reports each member it tried as a part of the path ('str', 'list[str]', ...): no field is named so
    loc = [part for part in first["loc"]
           if isinstance(part, int) or not (part in _TYPE_TAGS or "[" in part or "-" in part)]
    param = ""
    for part in loc:
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else part)
    kind = first["type"]
    if kind == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first['msg']}", param=None, code="json_invalid")
    if kind == "missing":
        return ApiError(400, f"missing required parameter: '{param}'", param=param, code="missing_required_parameter")
    where = f"'{param}': " if param else "the body: "
    return ApiError(400, f"{where}{first['msg']}", param=param or None, code=kind)


def install(app, on_error=None):
    """Register the handlers on ``app``; ``on_error(status)`` is told of every error answered."""

    def respond(e: ApiError):
        if on_error is not None:
            on_error(e.status)
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return respond(e)

    @app.exception_handler(ValidationError)
    async def invalid(request: Request, e: ValidationError):
        return respond(from_validation(e))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {e.detail}"
        return respond(ApiError(e.status_code, message, type=kind, headers=getattr(e, "headers", None)))

    @app.exception_handler(Exception)
    async def crashed(request: Request, e: Exception):
        logging.getLogger("llambda.server").error("%s %s failed", request.method, request.url.path, exc_info=e)
        return respond(ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))
