"""Error bodies as vLLM's OpenAI server gives them: ``{"error": {"message", "type", "param", "code"}}``.

Every error of the ingress takes this shape: FastAPI's own (``{"detail": ...}``), the engine's refusals (Ray raises
them as ``OpenAIHTTPException`` and its handler wraps the message, "Message: ..., Internal exception: ...", and types
it by its own exception class), a body the endpoint's model cannot parse, and the ingress's own (admission, size,
readiness, queue deadline). The ``type`` is vLLM's where vLLM's server answers the same status (``BadRequestError``,
``NotFoundError``; a body it cannot parse: the status's phrase), OpenAI's for the statuses only we answer."""

from __future__ import annotations

from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException
from starlette.exceptions import HTTPException as StarletteHTTPException

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "authentication_error",
    404: "NotFoundError",
    405: "BadRequestError",
    413: "BadRequestError",
    429: "rate_limit_error",
}


def openai_error(status: int, message: str, *, param: str | None = None, headers: dict | None = None,
                 kind: str | None = None) -> JSONResponse:
    """An error body; ``kind``: its ``type``, if not the status's."""
    return JSONResponse(
        status_code=status,
        headers=headers,
        content={
            "error": {
                "message": message,
                "type": kind or _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "server_error"),
                "param": param,
                "code": status,
            }
        },
    )


def answer_errors_as_vllm(app: FastAPI) -> None:
    """Handlers on ``app`` for the errors raised under it (added after Ray's, so they win)."""

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return openai_error(exc.status_code, str(exc.detail))

    @app.exception_handler(OpenAIHTTPException)
    async def _engine_error(request: Request, exc: OpenAIHTTPException) -> JSONResponse:
        return openai_error(exc.status_code, exc.message)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        where = lambda error: ".".join(str(p) for p in error.get("loc", ()) if p != "body")  # noqa: E731
        message = "; ".join(f"{where(e) or 'body'}: {e.get('msg')}" for e in errors) or "invalid request body"
        return openai_error(400, message, param=(where(errors[0]) or None) if errors else None,
                            kind=HTTPStatus.BAD_REQUEST.phrase)
