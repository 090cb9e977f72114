"""Pull on the three-node cluster of this machine (tests/integration/cluster.py): decode READs
the prompt's KV from the prefill node across the nodes' interfaces, token-identical to one
engine, and a conversation's history is read back from the decode node. The node-loss paths are
the handoff's, shared by both modes: test_cluster.py runs them in push."""

from __future__ import annotations

import pytest

from tests.integration.cluster import CONFIG, assert_history_crosses_back, assert_kv_crosses_the_nodes, needs_root, running_cluster
from tests.integration.conftest import with_args

pytestmark = needs_root


@pytest.fixture(scope="module")
def cluster(log_dir):
    # vLLM's own read-back of conversation history (pull's default recomputes every turn).
    config = with_args(CONFIG, log_dir, mode="pull", conversations={"pull_history": "upstream"})
    yield from running_cluster(config, log_dir)


def test_pull_across_nodes_is_token_identical_and_the_kv_crosses_the_nodes_interfaces(cluster, reference):
    assert_kv_crosses_the_nodes(cluster, reference, CONFIG, writer="decode")


def test_a_conversations_history_crosses_back_from_the_decode_node_and_stays_identical(cluster, reference):
    assert_history_crosses_back(cluster, reference, CONFIG)
