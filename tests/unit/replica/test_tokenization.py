"""/tokenize and /detokenize reach vLLM's tokenization server (app/replica/tokenization.py)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

from app.replica.tokenization import serve_tokenization


def test_ray_looks_for_the_tokenization_server_under_a_name_vllm_dropped():
    """Why the replica hands it over: without it Ray answers every /tokenize with a 400."""
    from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine
    from vllm.entrypoints.launchers.api_server import app_state

    vllm_builds = inspect.getsource(app_state.init_app_state)
    assert "state.serving_tokenization = " in vllm_builds and "openai_serving_tokenization" not in vllm_builds
    ray_reads = inspect.getsource(VLLMEngine.start)
    assert '"openai_serving_tokenization"' in ray_reads and '"serving_tokenization"' not in ray_reads


def test_the_engine_gets_the_server_vllm_built_and_keeps_one_ray_found():
    server, found = object(), object()
    engine = SimpleNamespace(_oai_serving_tokenization=None, _app_state=SimpleNamespace(serving_tokenization=server))
    assert serve_tokenization(engine) and engine._oai_serving_tokenization is server
    engine = SimpleNamespace(_oai_serving_tokenization=found, _app_state=SimpleNamespace(serving_tokenization=server))
    assert serve_tokenization(engine) and engine._oai_serving_tokenization is found
    assert not serve_tokenization(SimpleNamespace(_oai_serving_tokenization=None, _app_state=None))
