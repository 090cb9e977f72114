"""``serve run`` entry point: ``import_path: app.builder:build_app``.

Graph: ingress (OpenAI HTTP) → decode deployment (picked on arrival by Serve's router,
orchestrates) → prefill deployment (bound by the decode replica before dispatch). In pull
mode with late binding the ingress sends a prefilled request through the decode router
once more (``app.routing.late_binding``).
"""

from __future__ import annotations

import logging
from typing import Any

from ray import serve
from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
from ray.llm._internal.serve.core.ingress.ingress import make_fastapi_ingress
from ray.llm._internal.serve.core.server.builder import build_llm_deployment
from ray.serve.deployment import Application

from app.config.args import AppArgs
from app.config.llm_configs import ingress_actor_options, llm_config
from app.decode.server import DecodeServer
from app.ingress.readiness import DECODE_PREFIX, PREFILL_PREFIX, ReadinessProbe
from app.ingress.server import ENDPOINTS, Ingress, make_app
from app.model_source import resolve_model_source
from app.prefill.server import PrefillServer
from connector.ports import Role

logger = logging.getLogger("ray.serve." + __name__)


def build_app(args: dict[str, Any] | AppArgs | None = None) -> Application:
    app_args = AppArgs.parse(args)
    if advice := app_args.deadline_advice():
        logger.warning("%s", advice)
    source = resolve_model_source(app_args.model.source)
    prefill_config = LLMConfig.model_validate(llm_config(app_args, Role.PREFILL, source))
    decode_config = LLMConfig.model_validate(llm_config(app_args, Role.DECODE, source))

    prefill = build_llm_deployment(prefill_config, name_prefix=PREFILL_PREFIX, deployment_cls=PrefillServer)
    decode = build_llm_deployment(
        decode_config,
        name_prefix=DECODE_PREFIX,
        bind_kwargs={
            "prefill_server": prefill,
            "mode": app_args.mode.value,
            "late_binding": app_args.late_binding,
            "local_prefill_below_tokens": app_args.routing.local_prefill_below_tokens,
            "handoff": app_args.handoff,
            "conversations": app_args.conversations if app_args.conversations.enabled else None,
            "isolate_uncached": app_args.isolate_uncached_requests,
        },
        deployment_cls=DecodeServer,
    )
    model_id = app_args.model.id
    ingress = serve.deployment(
        make_fastapi_ingress(Ingress, endpoint_map=ENDPOINTS, app=make_app(app_args.ingress, ReadinessProbe(app_args.mode.value))),
        name="OpenAiIngress",
        num_replicas=app_args.ingress.replicas,
        max_ongoing_requests=app_args.ingress.max_ongoing_requests,
        max_surge_percent=app_args.ingress.max_surge_percent,
        graceful_shutdown_timeout_s=app_args.ingress.graceful_shutdown_timeout_s,
        ray_actor_options=ingress_actor_options(app_args.ingress),
    )
    return ingress.bind(
        llm_deployments={model_id: decode},
        model_cards={model_id: to_model_metadata(model_id, decode_config)},
    )
