"""Tensor-parallel sums by one-shot peer reads (model/layers/peer_all_reduce.py) on the CPU: the switch,
which tensors take it, and what a sum stages and writes, over a stand-in for the symmetric-memory kernel.
The kernel itself runs on two GPUs (tests/gpu/test_tensor_parallel_gpu.py)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from deltaserve.errors import ConfigError
from deltaserve.model.layers import parallel
from deltaserve.model.layers.parallel import TensorParallel
from deltaserve.model.layers.peer_all_reduce import MAX_BYTES, MODE_ENV, PeerAllReduce, peer_all_reduce_wanted


def test_the_switch_is_nccl_unless_asked_and_a_bad_value_is_named(monkeypatch):
    monkeypatch.delenv(MODE_ENV, raising=False)
    assert not peer_all_reduce_wanted()
    monkeypatch.setenv(MODE_ENV, "peer")
    assert peer_all_reduce_wanted()
    monkeypatch.setenv(MODE_ENV, "multimem")
    with pytest.raises(
        ConfigError, match=r"DELTASERVE_TP_ALLREDUCE must be one of \['nccl', 'peer'\], got 'multimem'"
    ):
        peer_all_reduce_wanted()


class PeerOf:
    """The one-shot kernel as rank `rank` of two sees it: the peer's staged tensor is `peer`; the sum adds
    the ranks' buffers in rank order into `out`."""

    def __init__(self, rank: int, peer: torch.Tensor) -> None:
        self.rank, self.peer, self.calls = rank, peer, []

    def __call__(self, staged: torch.Tensor, op: str, group: str, out: torch.Tensor) -> torch.Tensor:
        self.calls.append((staged.data_ptr(), staged.numel(), op, group, out.data_ptr()))
        first, second = (staged, self.peer) if self.rank == 0 else (self.peer, staged)
        return torch.add(first, second, out=out)


def _peer(rank: int, peer: torch.Tensor, dtype=torch.bfloat16) -> tuple[PeerAllReduce, PeerOf]:
    one_shot = PeerOf(rank, peer)
    buffer = torch.zeros(MAX_BYTES // dtype.itemsize, dtype=dtype)
    return PeerAllReduce(buffer, "world", one_shot), one_shot


def test_a_sum_stages_the_input_in_the_buffer_and_writes_the_sum_in_place():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16)
    peer, one_shot = _peer(1, torch.tensor([10.0, 20.0, 30.0, 40.0], dtype=torch.bfloat16))
    out = peer.all_reduce_(x)
    assert out is x and x.tolist() == [[11.0, 22.0], [33.0, 44.0]]
    assert peer.buffer[:4].tolist() == [1.0, 2.0, 3.0, 4.0] and peer.buffer[4:].abs().sum() == 0
    ((staged_at, n, op, group, out_at),) = one_shot.calls
    assert (staged_at, n, op, group, out_at) == (peer.buffer.data_ptr(), 4, "sum", "world", x.data_ptr())


def test_only_contiguous_tensors_of_the_buffers_dtype_up_to_its_size_fit():
    peer, _ = _peer(0, torch.empty(0))
    most = MAX_BYTES // 2  # bf16 elements
    assert peer.fits(torch.empty(most, dtype=torch.bfloat16))
    assert not peer.fits(torch.empty(most + 1, dtype=torch.bfloat16))
    assert not peer.fits(torch.empty(8, dtype=torch.float32))
    assert not peer.fits(torch.empty(8, 4, dtype=torch.bfloat16).t())


def test_tensor_parallel_sums_small_tensors_by_peer_reads_and_the_rest_by_nccl(monkeypatch):
    ring: list[int] = []
    monkeypatch.setattr(parallel.dist, "all_reduce", lambda t: ring.append(t.numel()))
    peer, one_shot = _peer(0, torch.ones(4, dtype=torch.bfloat16))
    tp = TensorParallel(0, 2, peer)
    small = torch.ones(2, 2, dtype=torch.bfloat16)
    tp.all_reduce_(small)
    assert small.tolist() == [[2.0, 2.0], [2.0, 2.0]] and len(one_shot.calls) == 1
    tp.all_reduce_(torch.empty(MAX_BYTES // 2 + 1, dtype=torch.bfloat16))  # over the buffer
    tp.all_reduce_(torch.empty(4, dtype=torch.float32))  # another dtype
    assert ring == [MAX_BYTES // 2 + 1, 4] and len(one_shot.calls) == 1
    assert TensorParallel(0, 2) == TensorParallel(0, 2, peer)  # the sums' route is not the rank's identity


def test_peer_sums_refuse_a_group_that_is_not_nccl():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match="needs one rank per GPU over NCCL, got the 'gloo' backend"):
            PeerAllReduce.create(torch.device("cpu"), torch.bfloat16)
    finally:
        dist.destroy_process_group()
