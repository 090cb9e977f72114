"""KV identity: decode uses a KV only if it was computed from exactly the tokens decode continues
(vLLM-side; imports neither Ray nor ``app``).

The KV checksums (``connector.kv_checksum``, ``connector.pull_checksum``) prove that the bytes that
landed are the bytes that were sent; they cannot see bytes computed from *other tokens*: a handoff that
pairs one prompt's KV with another prompt's decode (a completions prompt list decoded as one request
was such a bug) lands clean and answers wrong, with HTTP 200. So each side digests the prompt token ids
it computed or continues (:func:`identity_of`, a BLAKE2b-8 of the ids), and the two are compared before
any byte moves:

* pull: prefill's response carries its digest (``KV_IDENTITY_KEY``, in the ``kv_transfer_params`` decode
  gets); decode's scheduler compares it with its own prompt's before it plans the READ, and on a
  mismatch computes the prompt itself: vLLM then READs nothing and only tells prefill to free its blocks.
* push: decode's registration carries decode's digest; prefill's scheduler hands its workers the digest of
  each leg it finishes, and prefill's writer compares before it WRITEs. On a mismatch it WRITEs nothing,
  tells decode at once (``WONT_WRITE_NOTIF`` with :data:`MISMATCH`, ``connector.push_deadline``), and
  frees its own blocks.

Either way decode recomputes (counted ``kv_mismatch``, alerted), and the answer is right. The digest costs
one pass over the ids a side: 0.1 ms at 4k tokens, ~3-4 ms at 128k (docs/benchmarks.md). A KV that is
reused from a conversation's history is checked by its own means (the verified prefix), not by this.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import struct
from collections.abc import Sequence

from connector.feature import Feature
from connector.params import KV_IDENTITY_KEY, is_decode_leg, is_prefill_leg
from connector.side_notifs import WONT_WRITE_NOTIF
from connector.stages import DecodeKvStamps, KvFailure, send_stamps

logger = logging.getLogger("vllm.rendezvous")

IDENTITIES_ATTR = "rendezvous_kv_identities"  # push metadata to prefill's workers: request id -> its digest
_KEPT = 10_000  # digests a prefill worker keeps for legs not yet written
MISMATCH = b" " + KvFailure.MISMATCH.value.encode()  # after the request id in a WONT_WRITE_NOTIF


def identity_of(token_ids: Sequence[int] | None) -> str:
    """The digest of a prompt's token ids (16 hex digits): BLAKE2b-8 of them as little-endian 32-bit words (the same
    on every host; a vocabulary has far fewer than 2**32 ids)."""
    ids = token_ids or ()
    return hashlib.blake2b(struct.pack(f"<{len(ids)}I", *ids), digest_size=8).hexdigest()


def refused(request_id: str, what: str) -> None:
    """Decode side: the KV offered for ``request_id`` was computed from other tokens; decode recomputes."""
    logger.warning("KV of %s was computed from other tokens than its prompt (%s): not used, decode recomputes the "
                   "prompt", request_id, what)
    send_stamps(DecodeKvStamps(request_id, failed=KvFailure.MISMATCH.value))


class PullIdentity:
    """On the pull scheduler: prefill's response names its prompt; decode checks it before its READ."""

    def __init__(self) -> None:
        self._refused: set[str] = set()  # decode legs already refused (vLLM may ask again next step)

    def matched_tokens_refused(self, request) -> bool:
        """Before vLLM's get_num_new_matched_tokens: True if the leg's KV is not its prompt's (then 0 tokens
        match and vLLM frees prefill's blocks without reading them)."""
        params = request.kv_transfer_params
        if request.request_id in self._refused:
            return True
        if not is_decode_leg(params) or KV_IDENTITY_KEY not in params:
            return False
        said = params[KV_IDENTITY_KEY]
        if said == identity_of(request.prompt_token_ids):
            return False
        self._refused.add(request.request_id)
        refused(request.request_id, f"prefill's digest {said}")
        return True

    def finished(self, request, prefill_leg: bool, params) -> None:
        """After vLLM's request_finished (``prefill_leg``: read before it, which rewrites the params): a prefill
        leg's response names the tokens its KV is of."""
        self._refused.discard(request.request_id)
        if prefill_leg and isinstance(params, dict):
            params[KV_IDENTITY_KEY] = identity_of(request.prompt_token_ids)


class PushIdentityScheduler(Feature):
    """On the push scheduler. Decode: its registration names its prompt. Prefill: tells its workers the
    digest of each leg it finishes."""

    UPSTREAM = frozenset({"_push_pending_registrations"})

    def __init__(self, host) -> None:
        super().__init__(host)
        self._finished: dict[str, str] = {}  # prefill legs finished since the last step's metadata

    def allocated(self, request) -> None:
        """After vLLM's update_state_after_alloc (which staged a decode leg's registration)."""
        registration = self._push_pending_registrations.get(request.request_id)
        if registration is not None:
            registration.setdefault(KV_IDENTITY_KEY, identity_of(request.prompt_token_ids))

    def finishing(self, request) -> None:
        """Before vLLM's request_finished (which rewrites the params)."""
        if is_prefill_leg(request.kv_transfer_params):
            self._finished[request.request_id] = identity_of(request.prompt_token_ids)

    def built(self, meta) -> None:
        """After vLLM's build_connector_meta: the digests go with the finished blocks to the workers."""
        if self._finished:
            setattr(meta, IDENTITIES_ATTR, self._finished)
            self._finished = {}


class PushIdentityWorker(Feature):
    """On the push worker. Prefill: its writer WRITEs a registration only if it names the leg's prompt."""

    UPSTREAM = frozenset({"_reqs_to_send", "_reqs_to_process", "_remote_agents", "nixl_wrapper"})

    def __init__(self, host) -> None:
        super().__init__(host)
        self._expected: dict[str, str] = {}  # prefill leg -> its digest, until its WRITE
        self._said: dict[str, str] = {}  # prefill leg -> the digest its registration names, until its WRITE
        self._refused: queue.SimpleQueue = queue.SimpleQueue()  # legs not written: free their blocks (main thread)

    def loading(self, metadata) -> None:
        """Before vLLM's start_load_kv (which hands the finished blocks to the writer thread)."""
        self._expected.update(getattr(metadata, IDENTITIES_ATTR, None) or {})
        while len(self._expected) > _KEPT:  # legs aborted before their WRITE never come back for theirs
            self._expected.pop(next(iter(self._expected)), None)

    def matched(self, request_id: str, registration: dict) -> None:
        """The writer thread, before vLLM's _do_start_push_kv (which may first wait for the handshake)."""
        if KV_IDENTITY_KEY in registration:
            self._said[request_id] = registration[KV_IDENTITY_KEY]

    def may_write(self, request_id: str, meta) -> bool:
        """The writer thread, before the WRITE (the handshake with decode is done: it can be told)."""
        expected, said = self._expected.pop(request_id, None), self._said.pop(request_id, None)
        if expected is None or said is None or said == expected:
            return True
        logger.warning("registration for %s names other tokens (decode's digest %s, this leg's %s): not pushing",
                       request_id, said, expected)
        for agent in (self._remote_agents.get(meta.remote.engine_id) or {}).values():
            try:
                self.nixl_wrapper.send_notif(agent, notif_msg=WONT_WRITE_NOTIF + meta.remote.request_id.encode() + MISMATCH)
            except Exception:  # decode's KV deadline frees its blocks all the same
                logger.debug("mismatch notice for %s not sent", request_id, exc_info=True)
        self._refused.put(request_id)
        return False

    def release(self, results) -> None:
        """After vLLM's get_transfer_results: legs refused are done sending (their blocks go back now); legs done
        or expired are forgotten."""
        for request_id in results.finished_sending:
            self._expected.pop(request_id, None)
            self._said.pop(request_id, None)
        while True:
            try:
                request_id = self._refused.get_nowait()
            except queue.Empty:
                return
            if request_id in self._reqs_to_send or request_id in self._reqs_to_process:
                self._reqs_to_send.pop(request_id, None)
                self._reqs_to_process.discard(request_id)
                results.finished_sending.add(request_id)
