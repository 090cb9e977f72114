"""The OpenAI-compatible HTTP ingress: Ray Serve LLM's, plus a health route and
OpenAI-shaped bodies for every HTTP error (FastAPI's own are ``{"detail": ...}``)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS, OpenAiIngress, init
from starlette.exceptions import HTTPException as StarletteHTTPException

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error"}


def openai_error(status: int, message: str, *, param: str | None = None) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={
            "error": {
                "message": message,
                "type": _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
                "param": param,
                "code": status,
            }
        },
    )


def make_app() -> FastAPI:
    app = init()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return openai_error(exc.status_code, str(exc.detail))

    return app


class Ingress(OpenAiIngress):
    async def health(self) -> dict:
        return {"status": "ok"}


ENDPOINTS = {**DEFAULT_ENDPOINTS, "health": lambda app: app.get("/health")}
