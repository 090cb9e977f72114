"""Pull on the three-node cluster of this machine (tests/integration/cluster.py), its worker nodes' links
shaped to a set rate: decode READs the prompt's KV from the prefill node across the nodes' interfaces and
through the shaped link, in one transfer, and answers are token-identical to one engine. The node-loss
paths are the handoff's, shared by both modes, and test_cluster.py runs them in push (unshaped), with a
conversation's history crossing back; tensor-parallel
combinations run on one node (test_tensor_parallel.py): across these nodes, pull into decode TP 3
hung its READ in two of three attempts (docs/cluster.md, "Several ranks")."""

from __future__ import annotations

import pytest

from tests.integration.cluster import CONFIG, assert_kv_crosses_the_nodes, needs_root, running_cluster
from tests.integration.apps import with_args

pytestmark = needs_root


# The worker nodes' links shaped (app.tools.cluster --link-mbit, Linux tbf): KV crosses a link of a set rate, as
# between machines; the rate at which a transfer is ~20 % of its prefill on this box (docs/cluster.md, "A shaped link").
LINK_MBIT = 800


@pytest.fixture(scope="module")
def cluster(log_dir):
    yield from running_cluster(with_args(CONFIG, log_dir, name="local-cpu-2node-pull", mode="pull"), log_dir,
                               link_mbit=LINK_MBIT)


def test_pull_across_nodes_is_token_identical_and_the_kv_crosses_the_nodes_shaped_links(cluster, reference):
    assert_kv_crosses_the_nodes(cluster, reference, CONFIG, writer="decode")
