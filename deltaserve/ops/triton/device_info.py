"""What the launch rules of the Triton kernels ask of the device: its SM count, its opt-in shared memory
per block and its compute capability, read once per device. Off CUDA (Triton's CPU interpreter) nominal
values keep the rules exercised."""

from __future__ import annotations

import functools

import torch

INTERPRETER_SMS = 8  # off CUDA: a nominal SM count, small enough that the tests reach every branch


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _cuda_properties(_cuda_index(device)).multi_processor_count


def smem_per_block(device: torch.device) -> int | None:
    """The opt-in shared memory per block; None off CUDA (the interpreter has no limit)."""
    if device.type != "cuda":
        return None
    return _cuda_properties(_cuda_index(device)).shared_memory_per_block_optin


def hopper_or_later(device: torch.device) -> bool:
    """Whether `device` is a CUDA GPU of compute capability 9.0 or later (PDL, bulk copies)."""
    return device.type == "cuda" and _cuda_properties(_cuda_index(device)).major >= 9


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _cuda_properties(device_index: int):  # noqa: ANN202 (torch's _CudaDeviceProperties)
    return torch.cuda.get_device_properties(device_index)
