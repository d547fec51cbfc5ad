"""--max-num-seqs by default: the first of 512, 256, ... 16 whose state slots take at most two thirds of
the memory left for caches after the weights and the snapshot pool (256 on the CPU)."""

from __future__ import annotations

import torch

from deltaserve.config import ModelConfig
from deltaserve.engine.core import EngineCore
from deltaserve.engine.rank import choose_max_num_seqs
from deltaserve.engine_config import EngineConfig
from deltaserve.tiny import default_model_dir, official_config

MIB = 2**20
GIB = 2**30


def test_512_when_its_slots_take_at_most_two_thirds_of_the_cache_memory():
    # 513 slots (slot 0 is reserved) of 1 MiB: 2/3 of 769.5 MiB is exactly 513 MiB.
    assert choose_max_num_seqs(769.5 * MIB, MIB) == 512
    assert choose_max_num_seqs(769.0 * MIB, MIB) == 256
    # a smaller GPU: 2/3 of 100 MiB holds 65 slots of 1 MiB but not 129
    assert choose_max_num_seqs(100 * MIB, MIB) == 64
    assert choose_max_num_seqs(0, MIB) == 16  # no room at all: the smallest, and the KV plan says why


def test_the_shapes_on_an_h200():
    def per_sequence(preset: str) -> int:
        return ModelConfig.from_dict(official_config(preset)).state_bytes_per_sequence(torch.bfloat16)

    # Measured: the 35B-A3B shape leaves 48.4 GiB for caches (125.9 GiB at 0.9 utilization, less 66.3 GiB
    # of weights and context and 11.2 GiB of snapshots); 513 x 61.4 MiB = 30.8 GiB <= 32.3 GiB.
    assert per_sequence("35b-a3b-shape") == 64_389_120
    assert choose_max_num_seqs(48.4 * GIB, per_sequence("35b-a3b-shape")) == 512
    # The 27B shape: ~64 GiB left, 513 x 146.8 MiB = 73.5 GiB: 256 (257 slots: 36.8 GiB).
    assert choose_max_num_seqs(64 * GIB, per_sequence("27b-shape")) == 256
    # The 9B shape: ~97 GiB left, 513 x 49.1 MiB = 24.6 GiB.
    assert choose_max_num_seqs(97 * GIB, per_sequence("9b-shape")) == 512


def test_the_cpu_engine_resolves_256_and_reports_it():
    engine = EngineCore(
        EngineConfig(model=str(default_model_dir()), dtype="float32", device="cpu", max_model_len=256)
    )
    try:
        assert engine.config.max_num_seqs == 256
        assert engine.info.max_num_seqs == 256
        assert engine.scheduler_config.max_num_seqs == 256
        assert engine.scheduler_config.max_num_batched_tokens_saturated == 256 + 4096
        assert engine.cache.states.capacity == 256  # slots 1..256 (0 is reserved)
    finally:
        engine.shutdown("test done")
