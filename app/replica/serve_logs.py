"""Keep Ray Serve's replica log handler working across the engine's start.

vLLM 0.32's ``AsyncLLM`` applies its logging ``dictConfig`` in the process that creates it
(``configure_logging_if_needed``), our replica's; ``dictConfig`` first closes every handler of the process,
and a closed ``MemoryHandler`` forgets its target. Serve's controller, recovering after a head restart
(GCS fault tolerance), asks every replica for that handler's file (``ReplicaActor.is_allocated``) and
stops each one that cannot answer: every engine would start again, model load included. So the targets
are put back once the engine has started; a closed ``FileHandler`` reopens its file on the next record.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from logging.handlers import MemoryHandler

from ray.serve._private.constants import SERVE_LOGGER_NAME


@contextlib.contextmanager
def serve_log_targets_kept() -> Iterator[None]:
    """Around the engine's start: the targets of Serve's buffered replica-log handlers, put back if lost."""
    kept = [(h, h.target) for h in logging.getLogger(SERVE_LOGGER_NAME).handlers if isinstance(h, MemoryHandler)]
    try:
        yield
    finally:
        for handler, target in kept:
            if handler.target is None and target is not None:
                handler.setTarget(target)
