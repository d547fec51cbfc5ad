"""The prefix cache's snapshot pool by default: 8% of the GPU, at most a quarter of what the weights
leave under --gpu-memory-utilization, so a model that nearly fills the GPU still gets KV pages."""

from __future__ import annotations

import pytest
import torch

from deltaserve.config import ModelConfig
from deltaserve.engine import rank
from deltaserve.engine.rank import default_snapshot_bytes, plan_state_snapshots
from deltaserve.engine_config import EngineConfig
from deltaserve.tiny import default_model_dir, official_config

GIB = 2**30


def test_a_large_gpu_with_room_left_keeps_8_percent():
    # An H200 (140 GiB) with the 4B shape's ~9 GiB loaded: 0.9 x 140 - 9 = 117 GiB left, a quarter 29.25.
    assert default_snapshot_bytes(140 * GIB, 117 * GIB) == pytest.approx(11.2 * GIB)


def test_a_nearly_full_gpu_gives_a_quarter_of_what_is_left():
    # The 35B-A3B shape on an 80 GB H100 (measured: 79.2 GiB, 66.2 GiB in use after loading): 0.9 x 79.2
    # - 66.2 = 5.08 GiB left; 8% of the GPU (6.34 GiB) would take more than all of it.
    left = 0.9 * 79.2 * GIB - 66.2 * GIB
    assert default_snapshot_bytes(79.2 * GIB, left) == pytest.approx(1.27 * GIB)


def test_nothing_left_gives_no_snapshots():
    assert default_snapshot_bytes(80 * GIB, -1.5 * GIB) == 0.0


def test_the_plan_reads_the_gpu_and_counts_whole_snapshots(monkeypatch):
    local = ModelConfig.from_dict(official_config("35b-a3b-shape"))
    per_snapshot = local.state_bytes_per_sequence(torch.bfloat16)  # 61.4 MiB
    total, used = int(79.2 * GIB), int(66.2 * GIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (total - used, total))
    cfg = EngineConfig(model=str(default_model_dir()), gpu_memory_utilization=0.9)
    count = plan_state_snapshots(cfg, local, torch.device("cuda", 0), torch.bfloat16)
    left = 0.9 * total - used
    assert count == int(rank.SNAPSHOT_SHARE_OF_LEFT * left // per_snapshot) == 21
    # a size given on the command line is taken as it is
    cfg = EngineConfig(model=str(default_model_dir()), prefix_cache_state_memory_gb=6.0)
    assert plan_state_snapshots(cfg, local, torch.device("cuda", 0), torch.bfloat16) == int(
        6 * GIB // per_snapshot
    )


def test_no_room_for_kv_names_the_snapshot_pool_and_its_flag(monkeypatch):
    """The start-up error of a model that leaves no room for KV pages splits the state slots from the
    snapshots and names the snapshot pool's flag among the remedies."""
    from deltaserve.engine.warmup import WarmupReport
    from deltaserve.errors import ConfigError

    local = ModelConfig.from_dict(official_config("35b-a3b-shape"))
    total, used = int(79.2 * GIB), int(66.2 * GIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - used, total))
    cfg = EngineConfig(model=str(default_model_dir()), max_num_seqs=16, gpu_memory_utilization=0.9)
    warmup = WarmupReport(peak_activation_bytes=int(0.63 * GIB), seconds=0.0)
    with pytest.raises(ConfigError) as err:  # the old default's 6.3 GiB of snapshots
        rank._plan_kv_pages(cfg, local, torch.device("cuda", 0), torch.bfloat16, warmup, num_snapshots=105)
    message = str(err.value)
    assert "prefix-cache snapshots 6.30 GiB" in message and "state slots 1.02 GiB" in message
    assert message.endswith("or --prefix-cache-state-memory-gb")
    # the default pool leaves room
    pages = rank._plan_kv_pages(cfg, local, torch.device("cuda", 0), torch.bfloat16, warmup, num_snapshots=21)
    assert pages > 2
