"""Our own NIXL notifications, kept from vLLM's parser (vLLM-side; no Ray, no ``app``).

The push worker's writer thread forwards every notification that is not a registration to a
queue the engine's main thread reads, and vLLM parses each as ``"<request id>:<tp size>"``.
Ours (the WRITE's start, the KV's sums, an aborted leg, a chunk WRITE, the completion of a history READ) would crash that
parser. Taking them out when the main thread reads the queue races the writer thread, which
may forward one between our read and vLLM's (seen under load: a ``UnicodeDecodeError`` killed
the decode engine). So the queue routes ours to side queues as they are put
(:class:`SideRoutingQueue`), and each of our features takes its own (:func:`take`).
"""

from __future__ import annotations

import queue

HISTORY_READ_ID = "rdv-history-read"  # the remote request id of prefill's history READ (connector.push_reuse)
WRITE_STARTED_NOTIF = b"rdv-write-started:"  # connector.stages
KV_SUMS_NOTIF = b"rdv-kv-sums:"  # connector.kv_checksum
WONT_WRITE_NOTIF = b"rdv-wont-write:"  # connector.push_deadline
CHUNK_NOTIF = b"rdv-chunk:"  # connector.progressive: a chunk WRITE landed (not the completion vLLM counts)
PREFIXES = (WRITE_STARTED_NOTIF, KV_SUMS_NOTIF, WONT_WRITE_NOTIF, CHUNK_NOTIF, HISTORY_READ_ID.encode())


class SideRoutingQueue(queue.Queue):
    """vLLM's notification queue, with ours routed to a side queue per prefix as they are put."""

    def __init__(self) -> None:
        super().__init__()
        self.side = {prefix: queue.Queue() for prefix in PREFIXES}

    def put(self, item, block=True, timeout=None) -> None:
        if not self.put_aside(item):
            super().put(item, block, timeout)

    def put_aside(self, item) -> bool:
        for prefix, side in self.side.items():
            if isinstance(item, bytes) and item.startswith(prefix):
                side.put(item)
                return True
        return False


def take(notifs: queue.Queue, prefix: bytes) -> list[bytes]:
    """The notifications with ``prefix`` that reached ``notifs`` (none if it routes nothing aside)."""
    side = getattr(notifs, "side", {}).get(prefix)
    taken = []
    while side is not None:
        try:
            taken.append(side.get_nowait())
        except queue.Empty:
            break
    return taken
