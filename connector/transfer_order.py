"""KV transfers start before the step's forward pass where the forward blocks (vLLM-side;
imports neither Ray nor ``app``).

vLLM (0.29 to 0.32) starts a step's asynchronous KV transfers *after* the forward launch
(``KVConnectorModelRunnerMixin._get_kv_connector_output``: "keeping their host-side
submission cost off the critical path"). On a GPU the launch returns at once, so that is
the start of the step. On CPU the forward is synchronous: the transfers wait for the whole
forward. In push, a prefill request that finished in step N has its blocks handed to the
worker with step N+1, so its WRITE waited for all of step N+1 — under load, the next
prompt's whole prefill (measured: ``transfer`` median 3.0 s against 26 ms alone,
docs/investigations.md "Push under a burst"). Pull's READ and push's registration waited for a
decode step the same way.

Where the forward blocks, a step that starts transfers is marked as having synchronous
KV loads (``SchedulerOutput.has_sync_kv_loads``), the flag vLLM's model runners read to
start the connector before the forward. It changes nothing else. The work done there is
small: push only queues for its writer thread; pull submits its READs.
"""

from __future__ import annotations

from typing import Any


def forward_blocks() -> bool:
    """True where the model runner's forward returns only when it is computed (CPU)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def starts_transfers(meta: Any) -> bool:
    """True if this step's connector metadata starts a transfer or a registration."""
    return bool(
        meta.push_finished_blocks  # prefill, push: WRITEs
        or meta.push_registrations  # decode, push: registrations to send
        or meta.reqs_to_recv  # decode, pull: READs; prefill, push: history READs
    )


class TransfersFirst:
    """On the connector scheduler: mark steps that start transfers so the worker starts them first."""

    def __init__(self) -> None:
        self._transfers_first: bool | None = None  # looked up at the first step (the platform is set by then)

    def built(self, meta, scheduler_output) -> None:
        """After vLLM's build_connector_meta."""
        if self._transfers_first is None:
            self._transfers_first = forward_blocks()
        if self._transfers_first and starts_transfers(meta):
            scheduler_output.has_sync_kv_loads = True
