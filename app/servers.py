"""The prefill and decode Serve deployments.

Ray Serve LLM's ``PDDecodeServer`` already does what push needs once a connector backend
asks for it: the ingress routes the request to a decode replica on arrival, the decode
replica binds a prefill replica (``choose_replica``) and sends both legs concurrently.
We add one thing: a fresh, unique request id per request. vLLM pairs the two legs by
that id, so it must never come from a client header that may repeat.
"""

from __future__ import annotations

import logging

from ray.llm._internal.serve.serving_patterns.prefill_decode.pd_server import (
    PDDecodeServer,
    PDPrefillServer,
)

from connector.params import new_transfer_request_id
from connector.ray_backend import register_backends

logger = logging.getLogger("rendezvous.servers")

# Replicas import this module when they unpickle their class; registering here makes the
# backends resolvable in every process, whoever built the app.
register_backends()


class PrefillServer(PDPrefillServer):
    pass


class DecodeServer(PDDecodeServer):
    def _with_transfer_id(self, request):
        transfer_id = new_transfer_request_id()
        logger.debug("request %s -> transfer id %s", request.request_id, transfer_id)
        return request.model_copy(update={"request_id": transfer_id})

    async def chat(self, request, raw_request_info=None):
        return self._pd_handle_request(self._with_transfer_id(request), raw_request_info)

    async def completions(self, request, raw_request_info=None):
        return self._pd_handle_request(self._with_transfer_id(request), raw_request_info)
