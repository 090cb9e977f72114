"""Reading upstream source, for the seams list and the upstream probes (tests/unit/connector/)."""

from __future__ import annotations

import inspect


def class_source(klass) -> str:
    try:
        return inspect.getsource(klass)
    except (OSError, TypeError):  # builtins, C extensions
        return ""
