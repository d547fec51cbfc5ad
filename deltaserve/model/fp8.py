"""Quantized checkpoint weights (deltaserve.quant_config), dequantized at load into the model's dtype.

A quantized tensor W ([..., N, K], float8_e4m3fn) ships beside its scale S (`W` + the format's scale
suffix): one value per (block_n x block_k) block, shape [..., ceil(N / block_n), ceil(K / block_k)]
(the last blocks of a row or column may be partial), where a block dimension may be the whole matrix
dimension (one scale per matrix, per row). Element (i, j) of a matrix is W[i, j] * S[i // block_n,
j // block_k], computed in fp32 (an e4m3 value is exact in fp32, so the product is rounded once) and
then rounded to the model's dtype: what HF transformers computes when it loads such a checkpoint
dequantized. Scales may be stored in any float dtype (fp32, bf16, or ue8m0 as float8_e8m0fnu).
"""

from __future__ import annotations

import math

import torch

from deltaserve.quant_config import ScaleBlock, WeightQuantization

FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
# Quantization sidecars the engine never uses (activations are not quantized, the KV cache is kept in
# the model dtype): accepted, and skipped, in an FP8 checkpoint.
UNUSED_SUFFIXES = (
    ".input_scale",
    ".input_zero_point",
    ".activation_scale",
    ".k_scale",
    ".v_scale",
    ".kv_scale",
)
CHUNK_ELEMENTS = 1 << 24  # fp32 temporaries of the dequantization: 64 MiB each


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1


def resolved_block(weight_shape: tuple[int, ...], block: ScaleBlock) -> tuple[int, int]:
    """(rows, columns) one scale value covers in a weight of `weight_shape` ([..., N, K])."""
    n, k = weight_shape[-2:]
    return block[0] or n, block[1] or k


def scale_shape(weight_shape: tuple[int, ...], block: ScaleBlock) -> tuple[int, ...]:
    """The scale shape a weight of `weight_shape` ([..., N, K]) has in `block` layout."""
    *lead, n, k = weight_shape
    block_n, block_k = resolved_block(weight_shape, block)
    return (*lead, math.ceil(n / block_n), math.ceil(k / block_k))


def describe(block: ScaleBlock) -> str:
    if block == (None, None):
        return "whole-matrix"
    if block == (1, None):
        return "row"
    return "x".join("all" if b is None else str(b) for b in block)


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, quant: WeightQuantization, dtype: torch.dtype
) -> torch.Tensor:
    """W * S per block (module docstring), in `dtype`, on W's device (the loader moves W and S to the
    parameter's device first: half the bytes of a 16-bit copy, and the arithmetic on the GPU). The
    block is the first of the format's layouts whose scale shape is S's. Raises ValueError naming the
    expected and the found dtype or shape."""
    if weight.dtype != FP8_WEIGHT_DTYPE:
        raise ValueError(f"has dtype {weight.dtype}, an FP8 (e4m3) checkpoint stores {FP8_WEIGHT_DTYPE}")
    if weight.dim() < 2:
        raise ValueError(f"has shape {list(weight.shape)}, FP8 weights are matrices ([..., N, K])")
    shape = tuple(weight.shape)
    for block in quant.scale_blocks:
        expected = scale_shape(shape, block)
        if tuple(scale.shape) == expected or (scale.numel() == math.prod(expected) == math.prod(shape[:-2])):
            scale = scale.reshape(expected)  # one value per matrix may be stored as [] / [1] / [E]
            break
    else:
        layouts = ", ".join(
            f"{list(scale_shape(shape, b))} ({describe(b)} blocks)" for b in quant.scale_blocks
        )
        raise ValueError(
            f"has a scale of shape {list(scale.shape)}, expected {layouts} (weight {list(shape)})"
        )
    n, k = shape[-2:]
    block_n, block_k = resolved_block(shape, block)
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    # Whole block rows at a time, at most ~CHUNK_ELEMENTS fp32 values of weight and of scale each.
    chunk = max(1, CHUNK_ELEMENTS // (block_n * k)) * block_n
    matrices = zip(
        weight.reshape(-1, n, k), scale.reshape(-1, *expected[-2:]), out.view(-1, n, k), strict=True
    )
    whole = k // block_k * block_k  # columns in whole blocks; the rest share the last block's scale
    for w, s, o in matrices:
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            count = rows.stop - start
            per_row = (
                s[start // block_n : -(-rows.stop // block_n)].float().repeat_interleave(block_n, 0)[:count]
            )
            x = w[rows].float()
            if whole:
                blocks = x[:, :whole].view(count, -1, block_k) * per_row[:, : whole // block_k, None]
                o[rows, :whole] = blocks.view(count, whole)
            if whole < k:
                o[rows, whole:] = x[:, whole:] * per_row[:, -1:]
    return out
