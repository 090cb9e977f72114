"""Pull on the three-node cluster of this machine (tests/integration/cluster.py), with decode in
tensor parallel 3 and prefill in TP 1: each decode rank READs its third of the prompt's KV from
the prefill node across the nodes' interfaces (three READs a request), and answers are
token-identical to one TP 1 engine. The other TP combinations are in test_tensor_parallel.py; the
node-loss paths are the handoff's, shared by both modes, and test_cluster.py runs them in push
with a conversation's history crossing back. Not here: a pull conversation with vLLM's own
read-back (``pull_history: upstream``) into decode TP 3: its second turn's decode never started
(docs/cluster.md, "Several ranks"); test_pull.py covers that read-back at TP 1."""

from __future__ import annotations

import pytest
import yaml

from tests.integration.cluster import CONFIG, assert_kv_crosses_the_nodes, needs_root, running_cluster
from tests.integration.conftest import with_args

pytestmark = needs_root

DECODE_TP = 3


@pytest.fixture(scope="module")
def cluster(log_dir):
    decode = yaml.safe_load(open(CONFIG))["applications"][0]["args"]["decode"]
    config = with_args(CONFIG, log_dir, mode="pull", decode={**decode, "engine_kwargs": {"tensor_parallel_size": DECODE_TP}})
    yield from running_cluster(config, log_dir)


def test_pull_across_nodes_into_three_decode_ranks_is_token_identical_and_the_kv_crosses(cluster, reference):
    assert_kv_crosses_the_nodes(cluster, reference, CONFIG, writer="decode", ranks=DECODE_TP)
