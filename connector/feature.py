"""What our engine-side features have in common (vLLM-side; imports neither Ray nor ``app``).

A feature (a KV deadline, history reuse, the idle wait, checksums, the stage clock) is an object
composed into one of vLLM's connector schedulers or workers, its *host*: the composed classes
(``connector.push_connector``, ``connector.pull_connector``) override each vLLM hook once and call
the features in an order written there. A feature keeps its own state on itself and reads the host
only by the names it declares in ``UPSTREAM``, so what each feature relies on of vLLM is written
next to it (and listed in ``connector.seams``). It never writes the host implicitly: where it must
(a queue vLLM reads, replaced by one that wakes the engine), it says ``self.host.<name> = ...``.
"""

from __future__ import annotations

from typing import Any, ClassVar


class Feature:
    UPSTREAM: ClassVar[frozenset[str]] = frozenset()  # the host's attributes and methods this feature reads

    def __init__(self, host: Any) -> None:
        self.host = host

    def __getattr__(self, name: str) -> Any:
        # Only for names not set on the feature itself: its own state always wins.
        if name in type(self).UPSTREAM:
            return getattr(self.__dict__["host"], name)
        raise AttributeError(f"{type(self).__name__} has no {name!r} (a name it reads of vLLM's "
                             f"{type(self.__dict__.get('host')).__name__} must be in its UPSTREAM)")
