"""Tensor parallelism with both ranks on one GPU (DELTASERVE_TP_ONE_GPU=1, joined over gloo): two ranks
generate what one generates with the CUDA kernels, on a machine with a single GPU. NCCL, rank r on
cuda:r and graphs are left to tests/gpu/test_tensor_parallel_gpu.py, which needs two GPUs."""

from __future__ import annotations

import gc

import pytest
import torch
from test_tensor_parallel_gpu import _generate, assert_same_generation

from deltaserve.tiny import make_tiny


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe", "0.8b-shape"])
def test_two_ranks_on_one_gpu_generate_what_one_generates(tmp_path, preset, monkeypatch) -> None:
    dummy = preset == "0.8b-shape"
    model_dir = str(make_tiny(tmp_path / preset, preset, weights=not dummy))
    load_format = "dummy" if dummy else "auto"
    one = _generate(model_dir, 1, load_format)
    gc.collect()
    torch.cuda.empty_cache()  # the second rank sizes its share from the driver's free memory
    monkeypatch.setenv("DELTASERVE_TP_ONE_GPU", "1")  # read by this process and inherited by rank 1's
    two = _generate(model_dir, 2, load_format, gpu_memory_utilization=0.4)
    assert_same_generation(one, two)
