"""NIXL's UCX progress thread without the busy loop (vLLM-side; no Ray, no ``app``).

NIXL's Python ``nixl_agent`` sets ``pthrDelay = 0`` on every agent it creates. The UCX
backend's progress thread sleeps in ``poll()`` for that long between rounds, rounded up
to whole milliseconds: 0 ms, so once an agent has a connection its thread spins on a
core for as long as the engine lives, transfers or not. Measured here (NIXL 1.3.2, two
connected agents, idle): 1.99 cores at 0 ms, 0.05 at 1 ms, with the same transfer times,
because the thread is woken by the UCX workers' event descriptors, not by the timeout.
On a 2-core box three such engines took most of the CPU from the engines' real work.

The delay is fixed inside ``nixl_agent.__init__``, so the only seam is the config class
it instantiates: we swap in a subclass whose ``pthrDelay`` never goes below
:data:`PROGRESS_POLL_US`. Pinned in tests/unit/test_seams.py.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("vllm.rendezvous")

# NIXL's own floor for poll() is 1 ms ("at least 1ms", ucx_backend.cpp); 0 disables it.
PROGRESS_POLL_US = 1000


def calm_progress_threads(backends=("UCX",), min_delay_us: int = PROGRESS_POLL_US) -> bool:
    """Make NIXL agents created from now on in this process wait at least
    ``min_delay_us`` between progress rounds when idle. True if in effect.

    UCX-only agents: only the UCX backend's thread is known to wake on events; another
    backend's progress thread might rely on the timeout, so it is left as NIXL set it."""
    if list(backends) != ["UCX"]:
        return False
    from vllm.distributed import nixl_utils

    agent_cls = nixl_utils.NixlWrapper  # loads NIXL the way vLLM's connector will
    bind = getattr(sys.modules.get(getattr(agent_cls, "__module__", ""), None), "nixlBind", None)
    base = getattr(bind, "nixlAgentConfig", None)
    if base is None or not hasattr(base, "pthrDelay"):
        logger.warning("NIXL agent config has no pthrDelay here; its progress thread may busy-poll a core")
        return False
    if getattr(base, "min_delay_us", None) is not None:
        return True  # already swapped in this process
    bind.nixlAgentConfig = _config_class(base, min_delay_us)
    return True


def _config_class(base: type, floor_us: int) -> type:
    class CalmAgentConfig(base):
        min_delay_us = floor_us

        @property
        def pthrDelay(self):  # noqa: N802 (NIXL's name)
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value):  # noqa: N802
            base.pthrDelay.__set__(self, max(int(value), self.min_delay_us))

    return CalmAgentConfig
