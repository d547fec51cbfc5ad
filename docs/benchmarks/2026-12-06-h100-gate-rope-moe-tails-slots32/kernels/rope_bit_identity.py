"""Share of q/k values bit-identical to the reference (rotated dims, pass-through dims) after the fused
q/k RMSNorm + RoPE kernel, bf16, on CUDA. Run from the repository root (it uses the unit test's cases)."""

import sys

import torch

sys.path.insert(0, "tests")
import test_kernels_attention as cases  # noqa: E402

from deltaserve.ops.triton import attention as tri  # noqa: E402


def main() -> None:
    dev = torch.device("cuda")
    for heads, kv_heads, head_dim, rotary in ((16, 4, 256, 64), (6, 1, 256, 64)):
        for positions in ([0, 1, 17, 4095], list(range(0, 200_000, 997)), [200_003] * 8):
            case = cases.make_projection_case(
                positions,
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rotary_dim=rotary,
                dtype=torch.bfloat16,
                device=dev,
            )
            caches = [
                torch.full(case.cache_shape, float("nan"), dtype=torch.bfloat16, device=dev) for _ in range(4)
            ]
            got = tri.qk_norm_rope_write_kv(*case.args(caches[0], caches[1]))
            want = cases.reference_qk_norm_rope_write_kv(*case.args(caches[2], caches[3]))
            k_got, k_want = (c.flatten(0, 1)[case.slot_mapping] for c in (caches[0], caches[2]))
            rotated = case.inv_freq.shape[0] * 2
            for name, g, w in (("q", got, want), ("k", k_got, k_want)):
                rot_same = float((g[..., :rotated] == w[..., :rotated]).float().mean())
                rest_same = float((g[..., rotated:] == w[..., rotated:]).float().mean())
                print(
                    f"heads {heads}/{kv_heads} positions {positions[0]}..{positions[-1]} ({len(positions)}) {name}: "
                    f"rotated {rot_same:.4f} pass-through {rest_same:.4f}"
                )


if __name__ == "__main__":
    main()
