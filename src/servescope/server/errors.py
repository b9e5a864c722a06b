"""OpenAI-style error responses: {"error": {"message", "type", "param", "code"}}.

Every client mistake maps to a 4xx with `param` naming the field; only a bug is a 500, and its
message never carries a traceback.
"""

from __future__ import annotations

import json
import logging
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from servescope.engine.async_engine import EngineClosedError, QueueFullError
from servescope.errors import InvalidParameterError

logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error with its HTTP status and OpenAI fields, raised by the serving code."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
               type: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type or _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


ANTHROPIC_PREFIX = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                   type: Optional[str] = None, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code, type), status_code=status, headers=headers)


def to_api_error(e: BaseException) -> APIError:
    """Map an exception from the serving path to an APIError (also used inside SSE streams)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidParameterError):
        return APIError(400, e.message, param=e.param, code="invalid_value")
    if isinstance(e, QueueFullError):
        return APIError(429, f"{e}; retry after {RETRY_AFTER_SECONDS} s", code="rate_limit_exceeded",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(e, EngineClosedError):
        return APIError(503, str(e), code="engine_closed")
    logger.error("internal error while serving a request", exc_info=e)
    return APIError(500, f"internal server error ({type(e).__name__})", code="internal_error")


def validation_param(loc) -> Optional[str]:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'; union branch tags ('list[int]') are
    dropped with what follows them; the body root -> None."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header", "cookie"):
        parts = parts[1:]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif isinstance(p, str) and ("[" in p or p in ("str", "int", "float", "bool", "list", "dict",
                                                       "function-after", "json_invalid")):
            break
        else:
            out += ("." if out else "") + str(p)
    return out or None


def _validation_message(err: dict, param: Optional[str]) -> str:
    if err.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', 'parse error')}"
    msg = err.get("msg", "invalid value")
    if param is None:
        if err.get("type") in ("model_attributes_type", "dict_type", "model_type"):
            return "the request body must be a JSON object"
        return f"invalid request body: {msg}"
    return f"{param}: {msg}"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.code, e.type, e.headers)

    @app.exception_handler(InvalidParameterError)
    async def _invalid(request: Request, e: InvalidParameterError):
        a = to_api_error(e)
        return error_response(a.status, a.message, a.param, a.code)

    @app.exception_handler(QueueFullError)
    async def _full(request: Request, e: QueueFullError):
        a = to_api_error(e)
        return error_response(a.status, a.message, a.param, a.code, headers=a.headers)

    @app.exception_handler(EngineClosedError)
    async def _closed(request: Request, e: EngineClosedError):
        return error_response(503, str(e), code="engine_closed")

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        errs = e.errors()
        err = errs[0] if errs else {}
        param = None if err.get("type") == "json_invalid" else validation_param(err.get("loc", ()))
        code = "invalid_json" if err.get("type") == "json_invalid" else "invalid_type"
        return error_response(400, _validation_message(err, param), param, code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        status = e.status_code
        if status == 422:
            status = 400
        detail = e.detail if isinstance(e.detail, str) else json.dumps(e.detail, default=str)
        if request.url.path.startswith(ANTHROPIC_PREFIX):  # e.g. 405 on /v1/messages: Anthropic's shape
            return JSONResponse(anthropic_error_body(status, detail), status_code=status,
                                headers=getattr(e, "headers", None))
        return error_response(status, detail, None, None, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        a = to_api_error(e)
        return error_response(a.status, a.message, a.param, a.code, headers=a.headers)
