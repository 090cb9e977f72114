"""Unit tests that build vLLM's real message queues make ZeroMQ IPC sockets in ``VLLM_RPC_BASE_PATH``
(default /tmp, where they stay): in the session's temporary directory instead."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def vllm_sockets_in_the_sessions_temp_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path_factory.mktemp("vllm-rpc")))
        yield
