"""Skip Ray Serve LLM's node initialization when it has nothing to download.

Before an engine starts, Ray Serve LLM runs one Ray task on every node of the replica's placement
group to fetch the model from a cloud mirror. Without a mirror (a local directory, the embedded
model, a hub id vLLM fetches itself) that task downloads nothing, yet each one is a fresh process
that imports vLLM first: about 20 s of CPU per replica on a 2-core node, while the replicas next to
it are starting too. So the task runs only when Ray's own rule says it would download something.
"""

from __future__ import annotations

import logging

from ray.llm._internal.common.callbacks.base import CallbackBase
from ray.llm._internal.common.utils.cloud_utils import is_remote_path

logger = logging.getLogger("ray.serve." + __name__)  # under ray.serve: its handlers write the replica logs


class SkipIdleNodeInit(CallbackBase):
    """``LLMConfig.callback_config`` of both roles (app.config.llm_configs)."""

    async def on_before_node_init(self) -> None:
        engine = self.llm_config.get_engine_config()
        if engine.mirror_config is None and not is_remote_path(engine.actual_hf_model_id):
            self.ctx.run_init_node = False
            logger.info("model %s needs no download: node initialization skipped", engine.actual_hf_model_id)
