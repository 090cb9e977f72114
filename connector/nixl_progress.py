"""NIXL's UCX progress thread without the busy loop (vLLM-side; no Ray, no ``app``).

NIXL's Python ``nixl_agent`` sets ``pthrDelay = 0`` on every agent it creates. The UCX
backend's progress thread sleeps in ``poll()`` for that long between rounds, rounded up
to whole milliseconds: 0 ms, so once an agent has a connection its thread spins on a
core for as long as the engine lives, transfers or not. Measured here (NIXL 1.3.2, two
connected agents, idle): 1.99 cores at 0 ms, 0.05 at 1 ms, with the same transfer times,
because the thread is woken by the UCX workers' event descriptors, not by the timeout.
On a 2-core box three such engines took most of the CPU from the engines' real work. At
10 ms (2026-12-05, vLLM 0.32) a decode engine waiting for pushed KV spends 0.018 of a core
less than at 1 ms, with the same TTFT (docs/investigations.md, "Why push lost on long prompts").

The LIBFABRIC backend (EFA) spins the same way, and worse: its progress thread polls its
completion queues with ``fi_cq_read`` (opened with ``FI_WAIT_NONE``) and sleeps ``pthrDelay``
only after a round that found nothing, with no event to wake it (read in NIXL's
``libfabric_backend.cpp``, ``progressThread``). At 0 that is a core per agent, one agent per
rank: 8 per engine on a P5en. Its floor is a trade instead: :data:`LIBFABRIC_POLL_US` of idle
sleep costs a completion that arrives during it at most that long (the thread skips the sleep
while completions keep coming), and frees all but a sliver of each core.

The delay is fixed inside ``nixl_agent.__init__``, so the only seam is the config class
it instantiates: we swap in a subclass whose ``pthrDelay`` never goes below the floor of
the backends in use (:func:`progress_floor_us`). Pinned in tests/unit/connector/test_upstream_probes.py.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("vllm.rendezvous")

# UCX wakes its thread on its workers' events, so the timeout only bounds an idle round: 10 ms costs no
# latency (NIXL's own floor for poll() is 1 ms, "at least 1ms", ucx_backend.cpp; 0 disables it).
PROGRESS_POLL_US = 10_000
# LIBFABRIC wakes on nothing but this timeout: at most 0.1 ms added to a completion that arrives while
# its thread sleeps (against a GPU TTFT of hundreds of ms), for a thread that no longer spins a core.
LIBFABRIC_POLL_US = 100
_FLOORS_US = {"UCX": PROGRESS_POLL_US, "LIBFABRIC": LIBFABRIC_POLL_US}


def progress_floor_us(backends) -> int | None:
    """The idle delay floor for agents of these backends (one pthrDelay serves all of an agent's), or
    None where a backend's progress thread is not known to us: left as NIXL sets it."""
    floors = [_FLOORS_US.get(backend) for backend in backends]
    return None if not floors or None in floors else min(floors)


def calm_progress_threads(backends=("UCX",)) -> bool:
    """Make NIXL agents created from now on in this process wait at least their backends'
    floor (:func:`progress_floor_us`) between progress rounds when idle. True if in effect."""
    min_delay_us = progress_floor_us(list(backends))
    if min_delay_us is None:
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


def reads_cancel(backends) -> bool:
    """Whether releasing a posted READ's handle cancels it: UCX's does; NIXL's LIBFABRIC backend reports the
    release as done and leaves posted reads to land (connector.pull_deadline keeps their blocks)."""
    return list(backends) == ["UCX"]
