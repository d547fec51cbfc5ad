"""Program-shape sweep of the memory-bound elementwise kernels on CUDA: the residual RMSNorm, the GDN
output's gated RMSNorm, the SwiGLU (silu_and_mul) and the attention output's sigmoid gate, at the 4B and
9B shapes, from one decode row to an 8,192-token prefill.

For each kernel and token count: the default program shape, then every swept shape, each checked bit for
bit against the default's output and timed inside a CUDA graph that cycles through enough input copies
that no call finds its inputs in L2. The bandwidth column counts the bytes the kernel must move (inputs
read once, outputs written once); the H200's HBM moves ~4.8 TB/s.

python3 -m deltaserve.bench.norm_kernel [--tokens 1,256,2048,8192] [--quick]   (needs CUDA)
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import torch

from deltaserve.bench.linear_kernel import graph_ms
from deltaserve.ops.triton import activation as triton_act
from deltaserve.ops.triton import norm as triton_norm

DEV = torch.device("cuda")
DTYPE = torch.bfloat16
EPS = 1e-6
L2_BYTES = 64 << 20  # more than the H200's 50 MiB L2: inputs cycled past it are read from HBM
REPS = 100

MAX_TILE = 16384  # values per program past which a norm's fp32 tile spills registers


def norm_shapes(width: int) -> list[tuple[int, int]]:
    """(rows per program, warps) for rows `width` wide, at most MAX_TILE values per program."""
    block = 1 << (width - 1).bit_length()
    return [(r, w) for r in (1, 2, 4, 8, 16, 32, 64) if r * block <= MAX_TILE for w in (1, 2, 4, 8)]


SWIGLU_SHAPES = [(cols, warps) for cols in (256, 512, 1024, 2048, 4096) for warps in (1, 2, 4, 8)]


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    gdn_heads: int  # value heads of a GDN layer, 128 wide
    intermediate: int
    in_proj_width: int  # the fused GDN in_proj output that z is a view of
    attention_heads: int  # query heads, 256 wide


MODELS = (Model("4B", 2560, 32, 9216, 12352, 16), Model("9B", 4096, 32, 12288, 12352, 16))


@dataclasses.dataclass
class Kernel:
    """One kernel at one shape: `run(tensors, launch)` over one of several copies of its tensors, each
    its inputs followed by its `num_outputs` output buffers."""

    name: str
    num_outputs: int
    inputs: list[tuple[torch.Tensor, ...]]
    run: Callable[[tuple[torch.Tensor, ...], tuple[int, int] | None], object]
    moved_bytes: int
    shapes: list[tuple[int, int]]


def copies_for(one_copy_bytes: int) -> int:
    return max(1, min(16, -(-L2_BYTES // max(one_copy_bytes, 1))))


def residual_norm(model: Model, tokens: int, gen: torch.Generator) -> Kernel:
    weight = torch.randn(model.hidden, generator=gen, device=DEV).to(DTYPE) * 0.1
    nbytes = tokens * model.hidden * 2
    inputs = [
        (
            torch.randn(tokens, model.hidden, generator=gen, device=DEV).to(DTYPE),
            torch.randn(tokens, model.hidden, generator=gen, device=DEV).to(DTYPE),
            torch.empty(tokens, model.hidden, dtype=DTYPE, device=DEV),
            torch.empty(tokens, model.hidden, dtype=DTYPE, device=DEV),
        )
        for _ in range(copies_for(4 * nbytes))
    ]

    def run(t: tuple[torch.Tensor, ...], launch: tuple[int, int] | None) -> object:
        return triton_norm.rms_norm(t[0], weight, EPS, t[1], out=t[2], residual_out=t[3], launch=launch)

    return Kernel(f"{model.name} rms_norm + residual", 2, inputs, run, 4 * nbytes, norm_shapes(model.hidden))


def gated_norm(model: Model, tokens: int, gen: torch.Generator) -> Kernel:
    heads, dim = model.gdn_heads, 128
    weight = torch.randn(dim, generator=gen, device=DEV).to(DTYPE) * 0.5 + 1.0
    nbytes = tokens * heads * dim * 2
    inputs = []
    for _ in range(copies_for(3 * nbytes)):
        in_proj = torch.randn(tokens, model.in_proj_width, generator=gen, device=DEV).to(DTYPE)
        z = in_proj[:, -heads * dim :].view(tokens, heads, dim)  # a strided view, as the layer passes it
        x = torch.randn(tokens, heads, dim, generator=gen, device=DEV).to(DTYPE)
        inputs.append((x, z, torch.empty(tokens, heads, dim, dtype=DTYPE, device=DEV)))

    def run(t: tuple[torch.Tensor, ...], launch: tuple[int, int] | None) -> object:
        return triton_norm.gated_rms_norm(t[0], t[1], weight, EPS, out=t[2], launch=launch)

    return Kernel(f"{model.name} gated_rms_norm", 1, inputs, run, 3 * nbytes, norm_shapes(dim))


def swiglu(model: Model, tokens: int, gen: torch.Generator) -> Kernel:
    inter = model.intermediate
    nbytes = tokens * inter * 2
    inputs = [
        (
            torch.randn(tokens, 2 * inter, generator=gen, device=DEV).to(DTYPE),
            torch.empty(tokens, inter, dtype=DTYPE, device=DEV),
        )
        for _ in range(copies_for(3 * nbytes))
    ]

    def run(t: tuple[torch.Tensor, ...], launch: tuple[int, int] | None) -> object:
        return triton_act.silu_and_mul(t[0], out=t[1], launch=launch)

    return Kernel(f"{model.name} silu_and_mul", 1, inputs, run, 3 * nbytes, SWIGLU_SHAPES)


def attention_gate(model: Model, tokens: int, gen: torch.Generator) -> Kernel:
    heads, dim = model.attention_heads, 256
    nbytes = tokens * heads * dim * 2
    inputs = []
    for _ in range(copies_for(3 * nbytes)):
        q_gate = torch.randn(tokens, heads, 2 * dim, generator=gen, device=DEV).to(DTYPE)
        x = torch.randn(tokens, heads * dim, generator=gen, device=DEV).to(DTYPE)
        inputs.append((x, q_gate[..., dim:], torch.empty(tokens, heads, dim, dtype=DTYPE, device=DEV)))

    def run(t: tuple[torch.Tensor, ...], launch: tuple[int, int] | None) -> object:
        return triton_act.sigmoid_gate(t[0], t[1], out=t[2], launch=launch)

    return Kernel(f"{model.name} sigmoid_gate", 1, inputs, run, 3 * nbytes, SWIGLU_SHAPES)


def outputs(kernel: Kernel, launch: tuple[int, int] | None) -> list[torch.Tensor]:
    """The outputs of one call on the first input copy, poisoned first so an unwritten value shows."""
    first = kernel.inputs[0]
    for buffer in first[-kernel.num_outputs :]:
        buffer.fill_(float("nan"))
    kernel.run(first, launch)
    torch.cuda.synchronize()
    return [buffer.clone() for buffer in first[-kernel.num_outputs :]]


def graph_us(kernel: Kernel, launch: tuple[int, int] | None) -> float:
    """Median us of one call, replayed in a CUDA graph that calls it once per input copy."""
    return graph_ms(lambda tensors: kernel.run(tensors, launch), kernel.inputs, REPS) * 1000


def bits_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b, strict=True))


def sweep(kernel: Kernel, tokens: int, quick: bool) -> None:
    want = outputs(kernel, None)
    base = graph_us(kernel, None)
    gbps = kernel.moved_bytes / base / 1e3
    print(f"\n{kernel.name}, {tokens} tokens: default {base:.2f} us ({gbps:.0f} GB/s)")
    if quick:
        return
    rows = []
    for launch in kernel.shapes:
        try:
            got = outputs(kernel, launch)
            us = graph_us(kernel, launch)
        except Exception as exc:  # a shape past the registers or shared memory: report, keep sweeping
            print(f"  {launch}: failed ({type(exc).__name__})")
            continue
        rows.append((us, launch, "ok" if bits_equal(got, want) else "MISMATCH"))
    for us, launch, bits in sorted(rows)[:6]:
        print(
            f"  {str(launch):10s} {us:9.2f} us  {base / us:5.2f}x  {kernel.moved_bytes / us / 1e3:6.0f} GB/s  {bits}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", default="1,256,2048,8192", help="comma-separated token counts")
    parser.add_argument("--quick", action="store_true", help="only the default program shapes, no sweep")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; the six fastest shapes of each sweep")
    gen = torch.Generator(device=DEV).manual_seed(0)
    for model in MODELS:
        for tokens in (int(t) for t in args.tokens.split(",")):
            for build in (residual_norm, gated_norm, swiglu, attention_gate):
                kernel = build(model, tokens, gen)
                sweep(kernel, tokens, args.quick)
                del kernel
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
