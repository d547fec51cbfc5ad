"""A/B of the varlen causal_conv1d on CUDA: the tile kernel (impl="tiles") against the stream + heads
kernels (impl="rows"), at conv_dim 8192, K=4, bf16, x the qkv part of a wider in_proj output.

For each token count and batch composition: checks that both give bit-identical outputs and conv state
(from the same starting pool), then prints ms per call (triton.testing.do_bench, L2 flushed) and the
bandwidth of the 2 * T * C * 2 bytes of x read and out written; a plain strided copy x -> out is the
floor. Then sweeps block shapes (tokens, channels, rows per step, warps) of the stream kernel, each also
checked bit for bit, and checks that the default call captures and replays in a CUDA graph.

--seq instead sweeps the program shape of the per-row and per-sequence kernels (decode rows, the heads
kernel; `seq_blocks`) on decode-only batches and a unified step, each call captured in a CUDA graph and
timed by its replays (a decode step runs in one), checked bit for bit against the default shape.

python3 -m deltaserve.bench.conv1d_kernel [--quick | --seq]   (needs CUDA;
docs/benchmarks/2026-12-02-h200-conv1d-rows.md, 2026-12-04-h200-conv-seq-blocks.md)
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from collections.abc import Callable

import torch
import triton
import triton.testing

from deltaserve.ops.batch import BatchRow, ForwardBatch, build_forward_batch
from deltaserve.ops.triton import conv1d as triton_conv

DEV = torch.device("cuda")
DTYPE = torch.bfloat16
CHANNELS, K, EXTRA = 8192, 4, 2080  # x: columns [0, 8192) of [T, 8192 + 2 * EXTRA]
POOL_SLOTS = 320

SWEEP = [
    (32, 256, 8, 1),
    (64, 256, 8, 1),
    (128, 256, 8, 1),
    (256, 256, 8, 1),
    (64, 256, 4, 1),
    (64, 256, 16, 1),
    (64, 128, 8, 1),
    (64, 128, 16, 1),
    (128, 128, 16, 1),
    (64, 256, 8, 2),
    (64, 512, 8, 2),
    (128, 512, 8, 2),
    (64, 1024, 8, 4),
]


SEQ_SWEEP = [(256, 1), (256, 2), (256, 4), (256, 8), (512, 4), (512, 8), (1024, 4), (1024, 8)]


def make_batch(rows: list[tuple[int, int, int]]) -> ForwardBatch:
    """rows: (new tokens, context, state slot) per sequence, decode rows first."""
    return build_forward_batch(
        [BatchRow([0] * n, ctx, list(range((ctx + n + 15) // 16)), slot) for n, ctx, slot in rows],
        page_size=16,
        device=DEV,
    )


def compositions(tokens: int) -> dict[str, ForwardBatch]:
    decodes = [(1, 100 + i, 1 + i) for i in range(226)]
    half = (tokens - 226) // 2
    prompts = [(half, 0, 240), (tokens - 226 - half, 0, 241)]
    mixed = make_batch(decodes + prompts)
    eighth = tokens // 8
    return {
        "one sequence": make_batch([(tokens, 0, 7)]),
        f"226 decode + 2 x {half}": mixed,
        # The prefill graphs run every row as a varlen sequence (num_decodes = 0).
        f"226 decode + 2 x {half} (graphed)": dataclasses.replace(mixed, num_decodes=0),
        f"8 x {eighth} with context": make_batch([(eighth, 300 + 97 * i, 250 + i) for i in range(8)]),
    }


def seq_compositions() -> dict[str, tuple[int, ForwardBatch]]:
    """(tokens, batch): decode rows on distinct random slots, and a unified step as the prefill graphs
    run it (every row a sequence)."""
    slots = random.Random(0).sample(range(1, POOL_SLOTS), 228)
    decodes = [(1, 1100, slot) for slot in slots]
    unified = make_batch(decodes[:226] + [(911, 0, slots[226]), (911, 0, slots[227])])
    cases = {f"{n} decode rows": (n, make_batch(decodes[:n])) for n in (1, 64, 226)}
    cases["226 decode + 2 x 911 (graphed)"] = (2048, dataclasses.replace(unified, num_decodes=0))
    return cases


def graph_ms(fn: Callable[[], object]) -> float:
    """ms per replay of fn captured in a CUDA graph (compiled beforehand)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay)


def seq_sweep() -> None:
    print(
        "Per-sequence kernels' program shape (channels, warps): us per call in a CUDA graph, bits vs default"
    )
    cases = [
        (name, Case(tokens, batch, seed))
        for seed, (name, (tokens, batch)) in enumerate(seq_compositions().items())
    ]
    for i, (name, _) in enumerate(cases):
        print(f"  [{i}] {name}")
    print(f"{'seq_blocks':<12}" + "".join(f"{f'[{i}]':>9}" for i in range(len(cases))) + "  bits")
    wants = [case.result() for _, case in cases]
    for seq_blocks in SEQ_SWEEP:
        cells, verdicts = [], set()
        for (_, case), want in zip(cases, wants, strict=True):
            verdicts.add(check(case, want, seq_blocks=seq_blocks))
            pool = case.pool.clone()
            ms = graph_ms(lambda c=case, p=pool, s=seq_blocks: c.run(p, c.out, seq_blocks=s))
            cells.append(f"{1000 * ms:>9.1f}")
        print(f"{str(seq_blocks):<12}" + "".join(cells) + f"  {'ok' if verdicts == {'ok'} else 'MISMATCH'}")


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


class Case:
    def __init__(self, tokens: int, batch: ForwardBatch, seed: int) -> None:
        gen = torch.Generator(device=DEV).manual_seed(seed)
        wide = torch.randn(tokens, CHANNELS + 2 * EXTRA, generator=gen, device=DEV).to(DTYPE)
        self.x = wide[:, :CHANNELS]  # strided rows, as the qkv part of the in_proj output
        self.weight = (torch.randn(CHANNELS, K, generator=gen, device=DEV) * 0.5).to(DTYPE)
        self.pool = torch.randn(POOL_SLOTS, CHANNELS, K - 1, generator=gen, device=DEV).to(DTYPE)
        self.batch = batch
        self.out = torch.empty(tokens, CHANNELS, dtype=DTYPE, device=DEV)

    def run(self, pool: torch.Tensor, out: torch.Tensor, **options: object) -> None:
        triton_conv.causal_conv1d(self.x, self.weight, pool, self.batch, out=out, **options)

    def result(self, **options: object) -> tuple[torch.Tensor, torch.Tensor]:
        pool, out = self.pool.clone(), torch.full_like(self.out, float("nan"))
        self.run(pool, out, **options)
        torch.cuda.synchronize()
        return out, pool

    def ms(self, **options: object) -> float:
        pool = self.pool.clone()
        return triton.testing.do_bench(lambda: self.run(pool, self.out, **options))


def check(case: Case, want: tuple[torch.Tensor, torch.Tensor], **options: object) -> str:
    out, pool = case.result(**options)
    live = int(case.batch.query_start_loc[-1])
    ok = bits_equal(out[:live], want[0][:live]) and bits_equal(pool, want[1])
    return "ok" if ok else "MISMATCH"


def graph_check(case: Case) -> str:
    """The default call captured once and replayed equals an eager call."""
    want_out, want_pool = case.result()
    pool, out = case.pool.clone(), torch.empty_like(case.out)
    case.run(pool.clone(), out)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.run(pool, out)
    pool.copy_(case.pool)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ok = bits_equal(out, want_out) and bits_equal(pool, want_pool)
    return "ok" if ok else "MISMATCH"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="only the default block shapes, no sweep")
    parser.add_argument("--seq", action="store_true", help="only the per-sequence kernels' shape sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"conv_dim {CHANNELS}, K {K}, {DTYPE}, x rows strided by {CHANNELS + 2 * EXTRA}")
    if args.seq:
        print(f"default seq_blocks {triton_conv._SEQ_BLOCKS}\n")
        seq_sweep()
        return
    print(f"defaults: rows {triton_conv._ROW_BLOCKS}, tiles {triton_conv._TILE_BLOCKS}\n")
    print(
        f"{'T':>5}  {'batch':<32} {'copy ms':>8} {'tiles ms':>9} {'rows ms':>8} {'speedup':>7} "
        f"{'rows GB/s':>9}  bits"
    )
    cases: list[tuple[int, str, Case, tuple[torch.Tensor, torch.Tensor]]] = []
    for tokens in (2048, 8192):
        for seed, (name, batch) in enumerate(compositions(tokens).items()):
            case = Case(tokens, batch, seed)
            want = case.result(impl="tiles")
            verdict = check(case, want)
            copy_ms = triton.testing.do_bench(lambda c=case: c.out.copy_(c.x))
            tiles_ms, rows_ms = case.ms(impl="tiles"), case.ms()
            gbs = 2 * tokens * CHANNELS * DTYPE.itemsize / rows_ms / 1e6
            print(
                f"{tokens:>5}  {name:<32} {copy_ms:>8.4f} {tiles_ms:>9.4f} {rows_ms:>8.4f} "
                f"{tiles_ms / rows_ms:>6.2f}x {gbs:>9.0f}  {verdict}"
            )
            cases.append((tokens, name, case, want))
    print(f"\nCUDA graph capture and replay of the default call: {graph_check(cases[2][2])}")
    if args.quick:
        return
    print("\nStream kernel block shapes (tokens, channels, rows per step, warps): ms per call, bits vs tiles")
    for i, (tokens, name, _, _) in enumerate(cases):
        print(f"  [{i}] T={tokens} {name}")
    print(f"{'blocks':<20}" + "".join(f"{f'[{i}]':>10}" for i in range(len(cases))) + "  bits")
    for blocks in SWEEP:
        cells, verdicts = [], set()
        for _, _, case, want in cases:
            verdicts.add(check(case, want, blocks=blocks))
            cells.append(f"{case.ms(blocks=blocks):>10.4f}")
        print(f"{str(blocks):<20}" + "".join(cells) + f"  {'ok' if verdicts == {'ok'} else 'MISMATCH'}")


if __name__ == "__main__":
    main()
