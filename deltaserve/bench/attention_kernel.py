"""Tile shapes of the paged attention kernel's launches with prefill rows on CUDA, at the 4B and 9B
attention (16 query heads, 4 kv heads, head dim 256, bf16, page size 16; `--kv-heads 2`: the 35B-A3B's).

The kernel's 16-bit prefill tiles are fixed (`ops/triton/attention.py`: `_TILES_16BIT_MIXED`, 128 query rows
x 64 keys, 8 warps, 2 stages, since this sweep's first run). For each candidate (query rows, keys per block,
warps, stages, decode rows' keys per block; in one launch with the decode rows, or with the decode rows
launched apart on the decode tiles) this times chunks from position 0, one after context, and the
compositions of serving steps (decode rows beside chunks), against the current choice, and checks each
output against the current choice's (a tile shape changes the order of the softmax's sums: within bf16
rounding). A candidate that does not compile (shared memory, registers) is reported as such. Each call is
timed as a CUDA graph's replay (an eager call of a short launch times the host). `--decode` sweeps the
decode tiles instead (keys per block, warps, stages), then the decode rows' split count (key ranges per
row, merged after) with the current tiles, and reports the decode rows' KV bytes per second.

python3 -m deltaserve.bench.attention_kernel [--quick] [--kv-heads N] [--decode]   (needs CUDA)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import triton.testing

from deltaserve.ops.batch import BatchRow, ForwardBatch, build_forward_batch
from deltaserve.ops.triton import attention as tri

DEV = torch.device("cuda")
HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 4, 256, 16
# (query rows, keys per block, warps, stages, decode rows' keys per block); the first is the kernel's
# current choice. Each runs in one launch with the decode rows; those of APART also with them apart.
CANDIDATES = [
    (128, 64, 8, 2, 32),
    (128, 32, 8, 2, 32),
    (128, 32, 8, 3, 32),
    (128, 64, 8, 1, 32),
    (128, 16, 8, 3, 32),
    (128, 16, 8, 4, 32),
    (64, 32, 4, 2, 32),
    (64, 32, 4, 3, 32),
    (64, 64, 4, 2, 32),
    (64, 64, 8, 2, 32),
    (256, 32, 8, 1, 32),
    (128, 64, 8, 2, 64),
    (128, 64, 8, 2, 16),
    (64, 32, 4, 3, 64),
    (64, 32, 4, 4, 32),
]
# (name, rows: (context, new tokens) per sequence, decode rows first)
SHAPES = [
    ("8192 from 0", [(0, 8192)]),
    ("2048 after 6144", [(6144, 2048)]),
    ("2048 from 0", [(0, 2048)]),
    ("56 decode + 2 x 996", [(1100, 1)] * 56 + [(0, 996), (0, 996)]),
    ("226 decode + 2 x 911", [(1100, 1)] * 226 + [(0, 911), (0, 911)]),
    ("4 decode + 8192 from 0", [(4000, 1)] * 4 + [(0, 8192)]),
    ("64 decode + 8128 after 2048", [(1200, 1)] * 64 + [(2048, 8128)]),
]
APART = [(128, 64, 8, 2, 32), (128, 32, 8, 2, 32), (64, 32, 4, 2, 32), (64, 64, 4, 2, 32)]
# --decode: (keys per block, warps, stages) of the decode tiles, at pure-decode steps (one long row: split
# into many ranges; many rows: one range each) and at a step whose decode rows are launched apart.
DECODE_CANDIDATES = [
    (32, 4, 3),
    (32, 4, 4),
    (32, 8, 4),
    (16, 4, 6),
    (64, 4, 2),
    (64, 4, 3),
    (64, 4, 4),
    (64, 8, 3),
]
DECODE_SPLITS = [1, 2, 3, 4, 8]  # fixed split counts, against decode_num_splits' choice
DECODE_SHAPES = [
    ("1 decode row at 8192", [(8191, 1)]),
    ("32 decode rows at 1100", [(1100, 1)] * 32),
    ("64 decode rows at 1100", [(1100, 1)] * 64),
    ("128 decode rows at 1100", [(1100, 1)] * 128),
    ("256 decode rows at 1100", [(1100, 1)] * 256),
    ("226 decode + 2 x 911 (apart)", [(1100, 1)] * 226 + [(0, 911), (0, 911)]),
]


def make_case(
    rows: list[tuple[int, int]], kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ForwardBatch]:
    """q, k_cache, v_cache and the batch; pages handed out in order from page 1."""
    batch_rows, next_page = [], 1
    for context, n in rows:
        count = -(-(context + n) // PAGE)
        batch_rows.append(BatchRow([0] * n, context, list(range(next_page, next_page + count)), 0))
        next_page += count
    batch = build_forward_batch(batch_rows, PAGE, DEV)
    gen = torch.Generator(device=DEV).manual_seed(0)
    shape = (next_page, PAGE, kv_heads, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device=DEV, dtype=torch.bfloat16)
    v_cache = torch.randn(shape, generator=gen, device=DEV, dtype=torch.bfloat16)
    q = torch.randn(batch.num_tokens, HEADS, HEAD_DIM, generator=gen, device=DEV, dtype=torch.bfloat16)
    return q, k_cache, v_cache, batch


def flops(rows: list[tuple[int, int]]) -> int:
    """QK^T and PV: 4 * head_dim flops per (query head, visible key) pair."""
    pairs = sum(n * context + n * (n + 1) // 2 for context, n in rows)
    return 4 * HEADS * HEAD_DIM * pairs


def time_with(case: tuple, **settings: object) -> tuple[float, torch.Tensor]:
    """(ms per call, output) with the kernel module's `settings` (tiles, the apart threshold) in place;
    timed as the replay of a CUDA graph of one call."""
    q, k_cache, v_cache, batch = case
    saved = {name: getattr(tri, name) for name in settings}
    for name, value in settings.items():
        setattr(tri, name, value)
    try:
        out = tri.paged_attention(q, k_cache, v_cache, batch, HEAD_DIM**-0.5)  # compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            tri.paged_attention(q, k_cache, v_cache, batch, HEAD_DIM**-0.5, out=out)
        ms = triton.testing.do_bench(graph.replay)
    finally:
        for name, value in saved.items():
            setattr(tri, name, value)
    return ms, out


def report_candidate(
    label: str,
    case: tuple,
    current: tuple[float, torch.Tensor],
    rate: Callable[[float], str],
    **settings: object,
) -> None:
    """Times one candidate (`settings`, as for `time_with`) and prints it beside the current choice's
    (ms, output): `rate(ms)` is the figure shown with the time, then the speed-up and max |diff|."""
    current_ms, current_out = current
    try:
        ms, out = time_with(case, **settings)
    except Exception as exc:  # noqa: BLE001 (a candidate that does not compile is a result)
        print(f"{label}: n/a ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})")
        return
    diff = float((out.float() - current_out.float()).abs().max())
    print(f"{label}: {ms * 1e3:8.1f} us {rate(ms)} {current_ms / ms:5.2f}x  max |diff| {diff:.3g}")


def kv_bytes(rows: list[tuple[int, int]], kv_heads: int) -> int:
    """K and V bytes the decode rows read (bf16): every visible key of every kv head, once."""
    return sum(context + n for context, n in rows if n == 1) * kv_heads * HEAD_DIM * 2 * 2


def decode_sweep(kv_heads: int) -> None:
    """The decode tiles (keys per block, warps, stages): pure-decode steps and the decode launch of a step
    with prefill rows (decode rows apart)."""
    base = tri._TILES_16BIT_DECODE
    print(f"current decode tiles: {base}; {HEADS} query heads, {kv_heads} kv heads; ms per CUDA-graph replay")
    for name, rows in DECODE_SHAPES:
        case = make_case(rows, kv_heads)
        current = time_with(case)
        gbytes = kv_bytes(rows, kv_heads) / 1e9
        batch = case[3]
        chosen = tri.decode_num_splits(
            sum(n == 1 for _, n in rows), kv_heads, batch.block_tables.shape[1] * PAGE, DEV
        )
        print(
            f"{name}: current {current[0] * 1e3:8.1f} us {gbytes / current[0]:5.2f} TB/s of decode KV "
            f"({chosen} splits)"
        )
        for decode_n, warps, stages in DECODE_CANDIDATES:
            tiles = base._replace(decode_n=decode_n, num_warps=warps, num_stages=stages)
            label = f"  decode N={decode_n:<3} warps={warps} stages={stages}"
            report_candidate(
                label, case, current, lambda ms, g=gbytes: f"{g / ms:5.2f} TB/s", _TILES_16BIT_DECODE=tiles
            )
        for splits in DECODE_SPLITS:
            report_candidate(
                f"  splits={splits} (current tiles)",
                case,
                current,
                lambda ms, g=gbytes: f"{g / ms:5.2f} TB/s",
                decode_num_splits=lambda *shape, k=splits: k,
            )
        del case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first four candidates only")
    parser.add_argument("--kv-heads", type=int, default=KV_HEADS, help="kv heads (of 16 query heads)")
    parser.add_argument("--decode", action="store_true", help="sweep the decode tiles instead")
    args = parser.parse_args()
    if args.decode:
        decode_sweep(args.kv_heads)
        return
    candidates = [(c, False) for c in (CANDIDATES[:4] if args.quick else CANDIDATES)]
    candidates += [(c, True) for c in APART]
    base = tri._TILES_16BIT_MIXED
    print(
        f"current: {base}, decode rows apart up to {tri.DECODE_APART_MAX_TOKENS} tokens; {HEADS} query "
        f"heads, {args.kv_heads} kv heads, head dim {HEAD_DIM}; ms per CUDA-graph replay"
    )
    for name, rows in SHAPES:
        case = make_case(rows, args.kv_heads)
        current = time_with(case)
        work = flops(rows)
        print(f"{name}: current {current[0] * 1e3:8.1f} us {work / current[0] / 1e9:6.0f} TFLOP/s")
        has_decode = rows[0][1] == 1
        for (m, n, warps, stages, decode_n), apart in candidates:
            if apart and not has_decode:
                continue
            label = (
                f"  M={m:<3} N={n:<3} warps={warps} stages={stages} decode N={decode_n:<3} apart={apart:d}"
            )
            report_candidate(
                label,
                case,
                current,
                lambda ms, w=work: f"{w / ms / 1e9:6.0f} TFLOP/s",
                _TILES_16BIT_MIXED=tri._Tiles(decode_n, m, n, warps, stages),
                DECODE_APART_MAX_TOKENS=1 << 30 if apart else 0,
            )
        del case


if __name__ == "__main__":
    main()
