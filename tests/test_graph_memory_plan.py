"""The graphs' shared logits buffers are in the KV plan: decode graphs hold one float32 buffer of
max_num_seqs rows (and verify graphs one of their largest bucket's positions), which the KV pages
leave room for, instead of an output per bucket outside any plan (5.4 GiB at 512 sequences)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deltaserve.config import ModelConfig
from deltaserve.engine import rank
from deltaserve.engine.cuda_graphs import graph_buckets, logits_buffer_bytes, next_ahead, startup_buckets
from deltaserve.engine.warmup import WarmupReport
from deltaserve.engine_config import EngineConfig, SpeculativeConfig
from deltaserve.tiny import official_config

VOCAB = 248077


def test_graph_logits_rows_are_the_sequences_and_the_verify_positions_of_the_largest_bucket():
    assert rank.graph_logits_rows(EngineConfig(max_num_seqs=512)) == 512
    spec = SpeculativeConfig(num_speculative_tokens=3, max_batch=32)
    assert rank.graph_logits_rows(EngineConfig(max_num_seqs=512, speculative_config=spec)) == 512 + 32 * 4
    # The verify graphs' largest bucket is min(max_batch, max_num_seqs).
    assert rank.graph_logits_rows(EngineConfig(max_num_seqs=16, speculative_config=spec)) == 16 + 16 * 4


def test_one_buffer_for_every_bucket_is_a_ninth_of_an_output_per_bucket_at_512_sequences():
    per_bucket = sum(logits_buffer_bytes(b, VOCAB) for b in graph_buckets(512))
    shared = logits_buffer_bytes(512, VOCAB)
    assert shared == 512 * VOCAB * 4
    assert per_bucket / 2**30 == pytest.approx(5.45, abs=0.01) and shared / 2**30 == pytest.approx(
        0.47, abs=0.01
    )


def test_kv_pages_leave_room_for_the_graph_buffer(monkeypatch):
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * gib, 120 * gib))
    local = ModelConfig.from_dict(official_config("tiny"))
    config = dataclasses.replace(EngineConfig(max_num_seqs=8, gpu_memory_utilization=0.9), device="cuda")
    warmup = WarmupReport(peak_activation_bytes=gib, seconds=0.0)
    cuda = torch.device("cuda")

    def pages(graph_bytes: int) -> int:
        fixed = {"decode graphs' logits": graph_bytes}
        return rank._plan_kv_pages(config, local, cuda, torch.bfloat16, warmup, fixed=fixed)

    page_bytes = local.kv_bytes_per_token(torch.bfloat16) * config.page_size
    without, with_graphs = pages(0), pages(logits_buffer_bytes(512, VOCAB))
    assert without - with_graphs == pytest.approx(logits_buffer_bytes(512, VOCAB) / page_bytes, abs=1)


def test_start_up_captures_the_buckets_of_at_most_64_rows_and_idle_time_the_rest_largest_first() -> None:
    buckets = graph_buckets(512)
    assert startup_buckets(buckets) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert startup_buckets(graph_buckets(48)) == [1, 2, 4, 8, 16, 24, 32, 40, 48]
    assert startup_buckets([128, 256], startup_rows=64) == [128]  # the smallest at least
    settled = set(startup_buckets(buckets))
    assert next_ahead(buckets, settled) == 512
    assert next_ahead(buckets, settled | {512, 480}) == 448
    assert next_ahead(buckets, settled | set(buckets[11:]) - {72}) == 72
    assert next_ahead(buckets, set(buckets)) is None
    assert len(buckets) - len(startup_buckets(buckets)) == 24  # left to idle time at 512 sequences
