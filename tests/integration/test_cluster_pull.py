"""Pull on the three-node cluster of this machine (tests/integration/cluster.py): decode READs the
prompt's KV from the prefill node across the nodes' interfaces, in one transfer, and answers are
token-identical to one engine. The node-loss paths are the handoff's, shared by both modes, and
test_cluster.py runs them in push, with a conversation's history crossing back; tensor-parallel
combinations run on one node (test_tensor_parallel.py): across these nodes, pull into decode TP 3
hung its READ in two of three attempts (docs/cluster.md, "Several ranks")."""

from __future__ import annotations

import pytest

from tests.integration.cluster import CONFIG, assert_kv_crosses_the_nodes, needs_root, running_cluster
from tests.integration.apps import with_args

pytestmark = needs_root


@pytest.fixture(scope="module")
def cluster(log_dir):
    yield from running_cluster(with_args(CONFIG, log_dir, mode="pull"), log_dir)


def test_pull_across_nodes_is_token_identical_and_the_kv_crosses_the_nodes_interfaces(cluster, reference):
    assert_kv_crosses_the_nodes(cluster, reference, CONFIG, writer="decode")
