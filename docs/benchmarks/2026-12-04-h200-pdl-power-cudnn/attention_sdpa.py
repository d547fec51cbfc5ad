"""One prefill chunk of the 4B attention (16 query heads, 4 kv heads, head dim 256, bf16): our paged
kernel against torch SDPA's backends on the same queries and the same keys gathered contiguous.

    python3 docs/benchmarks/2026-12-04-h200-pdl-power-cudnn/attention_sdpa.py   # from the repository root

Prints, per (context, chunk): each kernel's time and TFLOP/s, the K/V gather's time, and each backend's
largest difference from our kernel's output.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

sys.path[:0] = ["tests/gpu", "tests", "."]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from test_kernels_attention_gpu import _case  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from deltaserve.ops.triton import attention as tri  # noqa: E402

BACKENDS = (
    ("flash", SDPBackend.FLASH_ATTENTION),
    ("cudnn", SDPBackend.CUDNN_ATTENTION),
    ("efficient", SDPBackend.EFFICIENT_ATTENTION),
)


def sdpa_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int, scale: float) -> Callable:
    """q: [1, heads, n, d]; k, v: [1, kv heads, context + n, d]. A chunk after context needs the
    bottom-right causal mask; a chunk from position 0 is plain causal."""
    n, total = q.shape[2], k.shape[2]
    if context == 0:
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    mask = causal_lower_right(n, total)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def compare(context: int, chunk: int) -> str:
    case = _case([(context, chunk)], "4B", torch.bfloat16)
    total = context + chunk
    ours = tri.paged_attention(case.q, case.k_cache, case.v_cache, case.batch, case.scale)
    ms_ours = do_bench(
        lambda: tri.paged_attention(case.q, case.k_cache, case.v_cache, case.batch, case.scale)
    )
    flops = 4 * 16 * 256 * (chunk * context + chunk * (chunk + 1) // 2)
    pages = case.batch.block_tables[0, : (total + 15) // 16].long()

    def gather(cache: torch.Tensor) -> torch.Tensor:
        return cache[pages].reshape(-1, 4, 256)[:total].transpose(0, 1).unsqueeze(0)

    ms_gather = do_bench(lambda: (gather(case.k_cache).contiguous(), gather(case.v_cache).contiguous()))
    q = case.q.transpose(0, 1).unsqueeze(0)
    k, v = gather(case.k_cache), gather(case.v_cache)
    line = (
        f"ctx={context:<6} n={chunk:<6} ours {ms_ours * 1e3:8.0f} us {flops / ms_ours / 1e9:6.0f} TF "
        f"| gather {ms_gather * 1e3:6.0f} us"
    )
    for name, backend in BACKENDS:
        try:
            with sdpa_kernel(backend):
                call = sdpa_call(q, k, v, context, case.scale)
                err = (call()[0].transpose(0, 1).float() - ours.float()).abs().max().item()
                ms = do_bench(call)
            line += f" | {name} {ms * 1e3:7.0f} us {flops / ms / 1e9:5.0f} TF err {err:.3g}"
        except RuntimeError as exc:
            line += f" | {name} n/a ({str(exc).splitlines()[0][:60]})"
    return line


def main() -> None:
    print("cudnn", torch.backends.cudnn.version())
    for context, chunk in ((0, 8192), (0, 2048), (6144, 2048), (0, 32768)):
        print(compare(context, chunk), flush=True)


if __name__ == "__main__":
    main()
