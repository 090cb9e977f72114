"""Error bodies as vLLM's server gives them (app/ingress/errors.py), on the real ingress app: Ray raises the engine's
refusals as OpenAIHTTPException, FastAPI a body its model cannot parse as RequestValidationError."""

from __future__ import annotations

import asyncio

import httpx
import pydantic
from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException

from app.config.args import IngressArgs
from app.ingress.server import make_app


class _Body(pydantic.BaseModel):
    messages: list[dict]


def _answers(*requests) -> list[httpx.Response]:
    app = make_app(IngressArgs(max_in_flight=4))

    @app.post("/v1/completions")
    async def refused(body: dict):
        raise OpenAIHTTPException(message="temperature must be non-negative, got -1.0.", status_code=400,
                                  type="VLLMValidationError")

    @app.post("/v1/chat/completions")
    async def parsed(body: _Body):
        return {"ok": True}

    async def send():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as client:
            return [await client.post(path, json=body) for path, body in requests]

    return asyncio.run(send())


def test_an_engine_refusal_carries_vllms_type_and_its_own_message():
    [r] = _answers(("/v1/completions", {"prompt": "hi"}))
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "temperature must be non-negative, got -1.0.", "type": "BadRequestError",
                                 "param": None, "code": 400}


def test_a_body_the_model_cannot_parse_is_a_400_typed_as_vllm_types_it_naming_the_field():
    [r] = _answers(("/v1/chat/completions", {"model": "m"}))
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "Bad Request" and error["param"] == "messages" and "messages: Field required" in error["message"]
