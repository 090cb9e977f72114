"""The envelope (app.request.envelope): what a request carries between the ingress and the deployments, by the
names on the wire, read back through its typed accessors."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest, CompletionRequest

from app.request.envelope import (
    CONVERSATION_HEADER,
    DECODE_PICKED_AT,
    FIELDS,
    PREFILLED_KEY,
    PROMPT_TOKENS,
    QUEUE_DEADLINE_AT,
    PrefillPicks,
    Route,
    TurnReason,
    conversation_id_of,
    prefilled_of,
    with_prefilled,
)
from connector.params import TransferMode


def _requests():
    return [CompletionRequest(model="m", prompt="hi"), ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])]


def _write_stamp(field, value):
    def write(request):
        field.write(request, value)
        return request
    return write


# (what, the name on the wire, write it: request -> the request that carries it, read it, the value)
ACCESSORS = [
    ("prompt tokens", "rendezvous_prompt_tokens", lambda r: PROMPT_TOKENS.copy_with(r, 42), PROMPT_TOKENS.read, 42),
    ("decode picked", "rendezvous_decode_picked", _write_stamp(DECODE_PICKED_AT, 12.5), DECODE_PICKED_AT.read, 12.5),
    ("queue deadline", "rendezvous_queue_deadline", _write_stamp(QUEUE_DEADLINE_AT, 99.0), QUEUE_DEADLINE_AT.read, 99.0),
    ("prefilled", "rendezvous_prefilled", lambda r: with_prefilled(r, {"request_id": "rdv-1"}), prefilled_of,
     {"request_id": "rdv-1"}),
]


@pytest.mark.parametrize("what, wire, write, read, value", ACCESSORS, ids=[a[0] for a in ACCESSORS])
def test_each_accessor_round_trips_on_vllms_request_models_and_their_copies(what, wire, write, read, value):
    """Through the replica's model_copy and Ray's pickling, under the name on the wire."""
    for request in _requests():
        assert read(request) is None
        carried = write(request)
        copied = pickle.loads(pickle.dumps(carried.model_copy(update={"request_id": "rdv-1"})))
        assert read(copied) == value
        assert wire in carried.model_dump() or wire in (carried.kv_transfer_params or {})


def test_every_field_is_listed_once_by_the_name_on_the_wire():
    assert [f.name for f in FIELDS] == ["rendezvous_prompt_tokens", "rendezvous_decode_picked", "rendezvous_queue_deadline"]
    assert PREFILLED_KEY == "rendezvous_prefilled" and CONVERSATION_HEADER == "x-conversation-id"


@pytest.mark.parametrize("field", [DECODE_PICKED_AT, QUEUE_DEADLINE_AT], ids=lambda f: f.name)
def test_a_request_type_that_takes_no_extra_field_carries_nothing(field):
    class Closed:
        __slots__ = ("request_id",)

    closed = Closed()
    field.write(closed, 1.0)  # no error: nothing is carried
    assert field.read(closed) is None


@pytest.mark.parametrize(
    "field, raw, read",
    [
        (PROMPT_TOKENS, "42", None),  # only an int counts
        (PROMPT_TOKENS, True, None),
        (PROMPT_TOKENS, -1, None),
        (PROMPT_TOKENS, 0, 0),
        (DECODE_PICKED_AT, 12, None),  # only a float counts
        (QUEUE_DEADLINE_AT, "99.0", None),
    ],
)
def test_a_field_of_the_wrong_type_reads_as_absent(field, raw, read):
    assert field.read(SimpleNamespace(**{field.name: raw})) == read


@pytest.mark.parametrize("params", [None, {}, {PREFILLED_KEY: "not a dict"}, {"other": {}}])
def test_no_prefilled_without_its_dict(params):
    assert prefilled_of(SimpleNamespace(kv_transfer_params=params)) is None


def test_with_prefilled_replaces_whatever_params_the_body_had():
    body = CompletionRequest(model="m", prompt="hi", kv_transfer_params={"remote_host": "elsewhere"})
    assert with_prefilled(body, {"a": 1}).kv_transfer_params == {PREFILLED_KEY: {"a": 1}}


@pytest.mark.parametrize(
    "raw_request_info, conversation",
    [(SimpleNamespace(headers={CONVERSATION_HEADER: "c-1"}), "c-1"), (SimpleNamespace(headers=None), None),
     (SimpleNamespace(headers={}), None), (None, None)],
)
def test_the_conversation_is_read_from_the_header(raw_request_info, conversation):
    assert conversation_id_of(raw_request_info) == conversation


@pytest.mark.parametrize(
    "enum, wire",
    [
        (Route, {"LOCAL": "local", "REMOTE": "remote", "FALLBACK": "fallback", "HANDED_OFF": "handed_off"}),
        (TurnReason, {"ATTEMPT": "attempt", "FIRST_TURN": "first_turn", "EXPIRED": "expired",
                      "REPLICA_GONE": "replica_gone"}),
        (TransferMode, {"PUSH": "push", "PULL": "pull"}),
    ],
    ids=lambda e: getattr(e, "__name__", ""),
)
def test_the_vocabularies_values_are_the_strings_on_the_wire(enum, wire):
    """Metric labels, log lines and the timeline's JSON carry these strings: a new member is a new label value."""
    assert {m.name: m.value for m in enum} == wire
    assert all(enum(value) is enum[name] and enum[name] == value for name, value in wire.items())


def test_the_prefill_picks_are_read_once_and_bounded():
    picks = PrefillPicks(kept=3)
    for i in range(5):
        picks.record(f"r{i}", float(i), tokens_ahead=10 * i)
    assert len(picks) == 3  # the oldest dropped first
    assert picks.tokens_ahead("r0") is None and picks.take_picked_at("r1") is None
    assert picks.tokens_ahead("r4") == 40 and picks.tokens_ahead("r4") == 40  # read as often as the deadlines ask
    assert picks.take_picked_at("r4") == 4.0 and picks.take_picked_at("r4") is None  # the timeline's, once
    picks.record("r2", 7.0, 1)  # picked again: the last pick counts
    assert (picks.take_picked_at("r2"), len(picks)) == (7.0, 1)
