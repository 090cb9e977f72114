"""Faults injected on purpose, for tests and benchmarks only (vLLM-side and app-side; imports nothing heavy:
``app.tools.preflight`` reads it before anything starts).

With ``RENDEZVOUS_KV_FAULT_FILE`` naming a file
(and ``RENDEZVOUS_TEST_FAULTS=1``; ``app.tools.preflight`` refuses the first without the second), each
transfer reads the file: ``flip`` makes decode corrupt a byte of a WRITE that landed before its
check (as a bad transport would), ``flip-history`` the same on prefill for a history READ,
``shift`` makes prefill write every block into its neighbour's slot (pull: decode reads them so,
``connector.pull_checksum``), ``drop-rank`` makes the last
of several prefill TP ranks skip its WRITE (decode must not start on the other ranks' shares: it
waits for every producer rank's notification, then recomputes at the registration's deadline; pull:
decode never READs that rank's share, ``connector.pull_deadline``), ``stall-read`` makes a pull
worker post no READ (``connector.pull_deadline`` cancels it at its deadline). Progressive push
(``connector.progressive``): ``fail-chunk`` fails a leg's second chunk WRITE (decode recomputes,
``kv_failed``), ``late-registration`` holds decode's registration on prefill until the leg has
finished (its first WRITE then covers every chunk before the last). ``misroute`` (read in the decode
replica, ``connector.ray_backend``) gives the prefill leg another prompt than decode's: decode must
refuse that KV (``connector.kv_identity``) and recompute.
"""

from __future__ import annotations

import os

FAULT_FILE_ENV = "RENDEZVOUS_KV_FAULT_FILE"
FAULTS_ALLOWED_ENV = "RENDEZVOUS_TEST_FAULTS"
FAULTS = ("flip", "shift", "flip-history", "drop-rank", "stall-read", "fail-chunk", "late-registration",
          "misroute")


def injected_fault() -> str | None:
    """The fault the test harness asks for now, if any (read at each use: tests switch it on a running app)."""
    path = os.environ.get(FAULT_FILE_ENV)
    if not path or os.environ.get(FAULTS_ALLOWED_ENV) != "1":
        return None
    try:
        with open(path) as f:
            fault = f.read().strip()
    except OSError:
        return None
    return fault if fault in FAULTS else None
