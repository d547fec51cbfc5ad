"""The weights are refused up front, in one line, when they cannot fit in the GPU share they may use."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from deltaserve.config import ModelConfig
from deltaserve.engine.rank import check_weights_fit, weight_bytes
from deltaserve.errors import ConfigError
from deltaserve.model.layers.parallel import TensorParallel
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.quant_config import WeightQuantization
from deltaserve.tiny import official_config

GIB = 2**30
CONFIG = ModelConfig.from_dict(official_config("tiny-moe"))


@pytest.mark.parametrize(("dtype", "tp", "mtp"), [(torch.float32, 1, True), (torch.bfloat16, 2, False)])
def test_the_meta_model_counts_the_bytes_the_real_one_allocates(dtype, tp, mtp):
    def build(device: str) -> Qwen35ForCausalLM:
        return Qwen35ForCausalLM(
            CONFIG, dtype=dtype, device=torch.device(device), tp=TensorParallel(tp - 1, tp), mtp=mtp
        )

    real = build("cpu")
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage() for t in [*real.parameters(), *real.buffers()]
    }
    assert weight_bytes(build("meta")) == weight_bytes(real) == sum(s.nbytes() for s in storages.values())


def test_weights_within_the_share_pass_and_beyond_it_are_refused_with_the_numbers():
    # 80 GiB GPU, 1 GiB in use, 0.9 utilization: 72 - 1 = 71 GiB for the weights.
    check_weights_fit(71 * GIB, 79 * GIB, 80 * GIB, 0.9, CONFIG, TensorParallel())
    with pytest.raises(ConfigError) as err:
        check_weights_fit(72 * GIB, 79 * GIB, 80 * GIB, 0.9, CONFIG, TensorParallel())
    assert str(err.value) == (
        "the model's weights need 72.0 GiB, but 71.0 GiB of the GPU are available (80.0 GiB x 0.9 "
        "utilization, 1.0 GiB in use); raise --tensor-parallel-size or --gpu-memory-utilization, or use a "
        "larger GPU"
    )


def test_the_refusal_names_a_ranks_shard_and_dequantized_fp8_weights():
    fp8 = dataclasses.replace(
        CONFIG, weight_quantization=WeightQuantization("fp8", "_scale_inv", ((128, 128),), "dynamic")
    )
    with pytest.raises(
        ConfigError,
        match=r"^this rank's shard of the weights \(1 of 2\) needs 40.0 GiB \(FP8 weights are served dequantized: twice their size on disk\), but 0.0 GiB",
    ):
        check_weights_fit(40 * GIB, 10 * GIB, 80 * GIB, 0.5, fp8, TensorParallel(1, 2))


def test_the_meta_build_of_the_size_check_does_not_import_torchs_compiler():
    """The size check builds the model on the meta device. Arithmetic on a meta tensor runs torch's
    Python references, whose first use imports torch._dynamo and sympy (~1.5 s of the engine's start)."""
    code = (
        "import sys, torch\n"
        "from deltaserve.config import ModelConfig\n"
        "from deltaserve.model.qwen35 import Qwen35ForCausalLM\n"
        "from deltaserve.tiny import official_config\n"
        "config = ModelConfig.from_dict(official_config('4b-shape'))\n"
        "Qwen35ForCausalLM(config, dtype=torch.bfloat16, device=torch.device('meta'))\n"
        "print('torch._dynamo' in sys.modules, 'sympy' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr
