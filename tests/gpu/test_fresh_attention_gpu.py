"""Fresh prefill chunks through cuDNN (ops/fresh_attention.py) at the 4B attention on CUDA, against the
torch reference, through the op boundary with DELTASERVE_FRESH_SDPA's switch on; and `bench_plans()`, a
micro-benchmark (not a test) of a plan's first call against later ones:

    python tests/gpu/test_fresh_attention_gpu.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script: the case builders live in tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402
import torch  # noqa: E402
from test_kernels_attention import TOLERANCE, make_case  # noqa: E402

from deltaserve import ops  # noqa: E402
from deltaserve.ops import attention as ref  # noqa: E402
from deltaserve.ops import fresh_attention as fresh  # noqa: E402

SHAPE = {"num_heads": 16, "num_kv_heads": 4, "head_dim": 256, "page_size": 16, "device": torch.device("cuda")}


@pytest.mark.parametrize(
    "rows",
    [
        [(0, 8192)],
        [(1100, 1)] * 8 + [(3000, 2048), (0, 2500), (0, 4097)],
    ],
    ids=["one 8192-token prompt", "decode rows, a chunk after context, two fresh chunks"],
)
def test_fresh_chunks_through_cudnn_match_the_reference(rows, monkeypatch):
    monkeypatch.setattr(fresh, "ENABLED", True)
    case = make_case(rows, dtype=torch.bfloat16, **SHAPE)
    assert fresh.fresh_tail(case.batch) is not None
    got = ops.paged_attention(case.q, case.k_cache, case.v_cache, case.batch, case.scale)
    want = ref.paged_attention(case.q, case.k_cache, case.v_cache, case.batch, case.scale)
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[torch.bfloat16])


def bench_plans() -> None:
    """The first call at a new padded length (cuDNN builds its plan) against the next ones."""
    for length in (2048, 2560, 8192):
        q = torch.randn(length, 16, 256, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(length, 4, 256, device="cuda", dtype=torch.bfloat16)
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            started = time.perf_counter()
            with fresh._backend(q.device):
                fresh._dense(q, kv, kv, 256**-0.5)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        print(
            f"length {length}: first call {times[0] * 1e3:.1f} ms, then {times[1] * 1e3:.2f} / {times[2] * 1e3:.2f} ms"
        )


if __name__ == "__main__":
    bench_plans()
