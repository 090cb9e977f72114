"""Our own fields on vLLM's request models (they accept extra fields): what the ingress or a
router tells the decode replica about a request, carried with it through Serve's calls."""

from __future__ import annotations

from typing import Any

# Output tokens assumed for a request that sets no max_tokens (load accounting, admission).
DEFAULT_OUTPUT_BUDGET = 256


def set_float_field(request: Any, name: str, value: float) -> None:
    try:
        setattr(request, name, value)
    except (AttributeError, TypeError, ValueError):  # a request type that takes no extra field: nothing is carried
        pass


def float_field(request: Any, name: str) -> float | None:
    value = getattr(request, name, None)
    return value if isinstance(value, float) else None
