"""connector.nixl_progress: the idle floor of NIXL's progress threads, by the backends an agent runs."""

from __future__ import annotations

import pytest

from connector.nixl_progress import LIBFABRIC_POLL_US, PROGRESS_POLL_US, progress_floor_us


@pytest.mark.parametrize("backends, floor_us", [
    (["UCX"], PROGRESS_POLL_US),  # wakes on its workers' events: the floor costs no latency
    # Polls its completion queues and wakes only on the timeout (NIXL's libfabric progressThread): at 0 it spins a
    # core per agent, 8 per P5en engine. A short floor trades at most that much latency for the core.
    (["LIBFABRIC"], LIBFABRIC_POLL_US),
    (["UCX", "LIBFABRIC"], LIBFABRIC_POLL_US),  # one pthrDelay for all of an agent's backends: the shorter
    (["GDS"], None),  # a backend whose thread we have not read: left as NIXL sets it
    (["UCX", "GDS"], None),
    ([], None),
])
def test_each_backend_gets_the_floor_its_progress_thread_can_take(backends, floor_us):
    assert progress_floor_us(backends) == floor_us
    assert LIBFABRIC_POLL_US < PROGRESS_POLL_US
