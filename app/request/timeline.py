"""Where a request's time to first token went: one timeline per request (pure).

Each party stamps what it sees, in wall-clock seconds (time.time()): the ingress (arrival, first chunk out), its
decode router (the pick, carried to the decode replica on the request: ``app.request.envelope.DECODE_PICKED_AT``),
the decode replica (received, legs sent, prefill's answer in, first token out of its engine; its prefill router's
pick: ``envelope.PREFILL_PICKS``), the prefill engine (the leg queued, started, finished: in prefill's response) and
the decode engine (KV asked for and landed, its first step scheduled, and push's WRITE start that prefill's worker
told it: datagrams to its replica; that step's output, as vLLM's output processor times it:
``app.decode.first_token``); see ``connector.stages``. The decode replica sends its stamps to the ingress at the end of a stream
(before the response when not streamed) as a :class:`RequestTimeline`; the ingress adds its own, exports each
stage's duration (``rendezvous_stage_seconds``) and logs the whole timeline as one JSON line (``LOG_MARKER``),
which ``python -m bench timeline`` reads.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from app.request.envelope import Route
from connector.params import TransferMode
from connector.stages import DecodeKvStamps, KvFailure, PrefillStages

# Log lines that carry a timeline start with this, then the JSON.
LOG_MARKER = "rendezvous_timeline "

# Timestamps in the order a disaggregated request passes them.
ARRIVED = "arrived"  # ingress: the request came in
DECODE_PICKED = "decode_picked"  # ingress's decode router: a decode replica chosen (the last pick, if it picked again)
RECEIVED = "decode_received"  # decode replica: the request reached it
LEGS_SENT = "legs_sent"  # decode replica: prefill leg sent (push: with the decode leg)
PREFILL_PICKED = "prefill_picked"  # decode replica's prefill router: a prefill replica chosen
PREFILL_QUEUED = "prefill_queued"  # prefill engine: the leg arrived
PREFILL_STARTED = "prefill_started"  # prefill engine: the leg was first scheduled
PREFILL_FINISHED = "prefill_finished"  # prefill engine: its KV computed
PREFILL_ANSWERED = "prefill_answered"  # decode replica: prefill's response came back
KV_REQUESTED = "kv_requested"  # decode engine: blocks allocated (push: registered with prefill; pull: READ started)
FIRST_CHUNK_LANDED = "first_chunk_landed"  # progressive push: decode engine: the first chunk WRITE landed
WRITE_STARTED = "write_started"  # push: prefill's worker began the WRITE (via decode's engine)
KV_LANDED = "kv_landed"  # decode engine: the KV is all there
FIRST_SCHEDULED = "first_scheduled"  # decode engine: the step that computes its first token scheduled
ENGINE_OUTPUT = "engine_output"  # decode engine: that step's output (its first token) out of the engine core
FIRST_TOKEN = "first_token"  # decode replica: first output from its engine
FIRST_CHUNK = "first_chunk"  # ingress: first chunk to the client

# Stage name -> (from, to). A stage is exported when both stamps exist.
STAGES: dict[str, tuple[str, str]] = {
    "route": (ARRIVED, RECEIVED),  # decode pick and the hop to the replica:
    "decode_pick": (ARRIVED, DECODE_PICKED),  # ... the ingress reads, admits, and its router picks
    "decode_hop": (DECODE_PICKED, RECEIVED),  # ... the request travels to the replica
    "bind": (RECEIVED, LEGS_SENT),  # tokenizing, judging the request, binding a prefill replica
    "prefill_hop": (LEGS_SENT, PREFILL_QUEUED),  # to the prefill replica and through its serving layer
    # Received to the prefill router's pick (push: the peer binding, before the legs go out; pull: as the leg goes).
    "prefill_pick": (RECEIVED, PREFILL_PICKED),
    "prefill_queue": (PREFILL_QUEUED, PREFILL_STARTED),  # waiting in the prefill engine
    "prefill_compute": (PREFILL_STARTED, PREFILL_FINISHED),
    "register": (LEGS_SENT, KV_REQUESTED),  # push: decode leg into decode's engine, blocks registered
    "handoff": (PREFILL_FINISHED, FIRST_TOKEN),  # KV to decode (WRITE or READ) and decode's first step:
    "transfer": (PREFILL_FINISHED, KV_LANDED),  # ... push: WRITE; pull: answer to decode, READ
    # Progressive push: KV streamed into decode while prefill still computed (overlaps prefill_compute, not a step of TTFT).
    "streamed": (FIRST_CHUNK_LANDED, PREFILL_FINISHED),
    "write_wait": (PREFILL_FINISHED, WRITE_STARTED),  # ... push: until the writer thread starts the WRITE
    "write": (WRITE_STARTED, KV_LANDED),  # ... push: the WRITE, its notification, decode's engine seeing it
    "read": (KV_REQUESTED, KV_LANDED),  # ... pull: the READ and decode's engine seeing it done
    "first_step": (KV_LANDED, FIRST_TOKEN),  # ... decode's first step, its output to the replica:
    "schedule": (KV_LANDED, FIRST_SCHEDULED),  # ... the scheduler learned the KV landed, then scheduled it
    "forward": (FIRST_SCHEDULED, ENGINE_OUTPUT),  # ... the step (its last prompt token) and its output built
    "output": (ENGINE_OUTPUT, FIRST_TOKEN),  # ... engine core -> vLLM's frontend -> OpenAI layer -> replica
    "local_prefill": (RECEIVED, FIRST_TOKEN),  # decode prefilled it itself (route local/fallback)
    "deliver": (FIRST_TOKEN, FIRST_CHUNK),  # decode replica -> ingress -> client
    "ttft": (ARRIVED, FIRST_CHUNK),
}
# Stages that only make sense on one kind of route.
_REMOTE_ONLY = {"bind", "prefill_hop", "prefill_pick", "prefill_queue", "prefill_compute", "register", "handoff", "transfer",
                "streamed", "write_wait", "write", "read", "first_step", "schedule", "forward", "output"}
_LOCAL_ONLY = {"local_prefill"}
# Pull registers nothing: its blocks are allocated after prefill answered, then it READs.
_MODE_ONLY = {"register": TransferMode.PUSH, "streamed": TransferMode.PUSH, "write_wait": TransferMode.PUSH,
              "write": TransferMode.PUSH,
              "read": TransferMode.PULL}


@dataclass
class RequestTimeline:
    """The stamps of one request (decode replica -> ingress, in the response stream)."""

    request_id: str
    mode: TransferMode
    route: Route
    stream: bool
    stamps: dict[str, float] = field(default_factory=dict)
    kv_failure: str | None = None  # connector.stages.KvFailure: the KV never landed, decode recomputed the prompt
    chunk_writes: int = 0  # progressive push: the chunk WRITEs that landed before the last WRITE

    def __post_init__(self) -> None:
        self.mode, self.route = TransferMode(self.mode), Route(self.route)  # their strings, as a log line has them

    def stamp(self, name: str, at: float) -> None:
        self.stamps.setdefault(name, at)  # the first time counts

    def add_prefill_report(self, report: Any) -> None:
        """The prefill engine's own stamps (``connector.stages.PrefillStages`` on the wire), if it sent them."""
        stages = PrefillStages.from_wire(report)
        for name, value in ((PREFILL_QUEUED, stages.queued), (PREFILL_STARTED, stages.started),
                            (PREFILL_FINISHED, stages.finished)):
            if value is not None:
                self.stamp(name, value)

    def add_decode_kv_stamps(self, stamps: DecodeKvStamps) -> None:
        """The decode engine's own stamps, whichever this datagram carries."""
        for name, value in ((KV_REQUESTED, stamps.requested), (WRITE_STARTED, stamps.write_started),
                            (KV_LANDED, stamps.landed), (FIRST_SCHEDULED, stamps.scheduled)):
            if value is not None:
                self.stamp(name, value)
        if stamps.chunk_landed is not None:  # datagrams from several ranks, in any order: the earliest counts
            self.stamps[FIRST_CHUNK_LANDED] = min(self.stamps.get(FIRST_CHUNK_LANDED, stamps.chunk_landed), stamps.chunk_landed)
            self.chunk_writes = max(self.chunk_writes, (stamps.chunk or 0) + 1)
        # The worker's kv_mismatch and the scheduler's generic kv_failed report the same load: the specific one wins.
        if stamps.failed and (self.kv_failure is None or stamps.failed == KvFailure.MISMATCH.value):
            self.kv_failure = stamps.failed

    def stages(self) -> dict[str, float]:
        """Seconds per stage, for the stamps that exist (negative clock skew clamps to 0)."""
        out = {}
        for name, (start, end) in STAGES.items():
            remote = self.route == Route.REMOTE
            if remote and name in _LOCAL_ONLY or not remote and name in _REMOTE_ONLY:
                continue
            if _MODE_ONLY.get(name, self.mode) != self.mode:
                continue
            if start in self.stamps and end in self.stamps:
                out[name] = max(0.0, self.stamps[end] - self.stamps[start])
        return out

    def to_log_line(self) -> str:
        line = {**asdict(self), "mode": self.mode.value, "route": self.route.value, "stages": self.stages()}
        return LOG_MARKER + json.dumps(line, sort_keys=True)

    @classmethod
    def from_log_line(cls, line: str) -> RequestTimeline | None:
        at = line.find(LOG_MARKER)
        if at < 0:
            return None
        try:
            raw = json.loads(line[at + len(LOG_MARKER):])
        except ValueError:
            return None
        raw.pop("stages", None)
        try:
            return cls(**raw)
        except ValueError:  # a mode or route this version does not know
            return None
