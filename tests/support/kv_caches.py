"""vLLM's push worker as ``connector.kv_checksum`` reads it, over real KV tensors (``Upstream``), and which part
of a block vLLM moves between two tensor-parallel ranks (``chunks_moved``): shared by the KV checksum tests of
push (tests/unit/connector/test_kv_checksum.py) and pull (test_pull_checksum.py)."""

from __future__ import annotations

import queue
from types import SimpleNamespace

import msgspec
import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_REG_NOTIF_PREFIX

from connector.side_notifs import SideRoutingQueue

LAYERS, BLOCKS, BLOCK_ELEMS, KV_HEADS = 3, 8, 64, 4


class Upstream:
    """What KvChecksums reads of vLLM's push worker, with KV caches of LAYERS x BLOCKS blocks."""

    def __init__(self, engine_id: str, seed: int, tp_rank: int = 0, world_size: int = 1, remote_tp: int = 1):
        self.engine_id, self.tp_rank, self.world_size = engine_id, tp_rank, world_size
        self._has_mamba, self.use_host_buffer, self._physical_blocks_per_logical_kv_block = False, False, 1
        generator = torch.Generator().manual_seed(seed)
        # [2 (K, V), blocks, elems]: a block's K and V are not adjacent, as in vLLM's CPU layout. A rank
        # holds its share of KV_HEADS heads, each a contiguous chunk of the block (vLLM splits them so).
        elems = BLOCK_ELEMS // world_size
        self.device_kv_caches = {f"layer{i}": torch.randn(2, BLOCKS, elems, generator=generator)
                                 for i in range(LAYERS)}
        rows = []
        for cache in self.device_kv_caches.values():
            for half in range(2):
                for block in range(BLOCKS):
                    rows.append((cache[half, block].data_ptr(), elems * 4, 0))
        self.src_blocks_data, self.num_regions, self.num_blocks = np.array(rows, dtype=np.int64), LAYERS * 2, BLOCKS
        self._pending_completion_notifs: queue.Queue = SideRoutingQueue()
        self._recving_transfers: dict[str, list] = {}
        self._recving_metadata: dict[str, SimpleNamespace] = {}
        self._invalid_block_ids: queue.Queue = queue.Queue()
        self._failed_recv_reqs: queue.Queue = queue.Queue()
        self.notifs_sent: list[tuple[str, bytes]] = []
        self.nixl_wrapper = SimpleNamespace(send_notif=lambda agent, notif_msg: self.notifs_sent.append((agent, notif_msg)))
        self._remote_agents = {"decode": {(0, 0): "decode-agent-0", (0, 1): "decode-agent-1"}}  # (pp rank, tp rank)
        info = SimpleNamespace(remote_tp_size=remote_tp, remote_block_size=16, remote_physical_blocks_per_logical=1)
        self.transfer_topo = SimpleNamespace(get_engine_info=lambda engine_id: info, block_size_ratio=lambda size: 1,
                                             total_num_kv_heads=KV_HEADS, is_mla=False)
        # vLLM's TP mapping as compute_tp_mapping makes it (heads not shared): the decode ranks we WRITE to.
        ranks = (tuple(range(tp_rank * remote_tp // world_size, (tp_rank + 1) * remote_tp // world_size))
                 if remote_tp > world_size else (tp_rank * remote_tp // world_size,))
        self.tp_mappings = {"decode": SimpleNamespace(all_source_ranks=ranks,
                                                      rank_to_attention_slot={r: i for i, r in enumerate(ranks)})}
        self.peer: Upstream | None = None
        self.targets: list | None = None  # (peer, our chunk, its chunk) per decode rank: different TP sizes
        self.registrations_sent: list[bytes] = []
        self.registrations_seen: list[bytes] = []

    def _xfer_blocks_for_req(self, req_id, meta):  # the WRITE: region by region, block by block
        for peer, ours, its in self.targets or [(self.peer, slice(None), slice(None))]:
            for mine, theirs in zip(self.registered().values(), peer.registered().values()):
                for local, remote in zip(meta.local_physical_block_ids[0][-len(meta.remote.block_ids[0]):],
                                         meta.remote.block_ids[0]):
                    theirs[:, remote, its] = mine[:, local, ours]

    def registered(self) -> dict:
        """The memory NIXL moves: the host staging buffers where vLLM uses them."""
        return self.host_xfer_buffers if self.use_host_buffer else self.device_kv_caches

    def stage_through_host(self) -> None:
        """kv_buffer_device "cpu" on a device NIXL cannot register (Neuron): NIXL moves host buffers, registered
        in the descriptors; the device caches hold other bytes until vLLM copies them over."""
        self.use_host_buffer, self.host_xfer_buffers = True, self.device_kv_caches
        self.device_kv_caches = {name: torch.zeros_like(cache) for name, cache in self.host_xfer_buffers.items()}

    def _get_new_notifs(self):
        return set()

    def _logical_to_kernel_block_ids(self, block_ids, physical_per_logical):
        return block_ids

    def _do_send_reg_notif(self, req_id, reg_data):
        self.registrations_sent.append(PUSH_REG_NOTIF_PREFIX + msgspec.msgpack.encode(reg_data))

    def _handle_push_reg_notif(self, notif):
        self.registrations_seen.append(notif)

    def _pop_done_transfers(self, transfers):  # vLLM 0.32: (done, failed)
        done = set(transfers)
        transfers.clear()
        return done, set()


def chunks_moved(sender_tp: int, sender_rank: int, reader_tp: int, reader_rank: int) -> tuple[slice, slice] | None:
    """(the sender's slice, the reader's slice) of a block that vLLM moves between these two ranks (its
    KV-head chunks, connector.sum_ranks), or None if it moves nothing between them."""
    elems = BLOCK_ELEMS // max(sender_tp, reader_tp)
    if sender_tp >= reader_tp:  # the sender's whole block into chunk (sender rank % k) of the reader's
        k = sender_tp // reader_tp
        at = sender_rank % k * elems
        return (slice(None), slice(at, at + elems)) if sender_rank // k == reader_rank else None
    k = reader_tp // sender_tp  # chunk (reader rank % k) of the sender's block into the reader's whole block
    at = reader_rank % k * elems
    return (slice(at, at + elems), slice(None)) if reader_rank // k == sender_rank else None
