"""Share of q/k values bit-identical to the reference (rotated dims, pass-through dims), bf16, on CUDA."""
import sys, torch
sys.path.insert(0, "tests")
import test_kernels_attention as t
from deltaserve.ops.triton import attention as tri
dev = torch.device("cuda")
for heads, kv, hd, rot in ((16, 4, 256, 64), (6, 1, 256, 64)):
    for positions in ([0, 1, 17, 4095], list(range(0, 200_000, 997)), [200_003] * 8):
        case = t.make_projection_case(positions, num_heads=heads, num_kv_heads=kv, head_dim=hd, rotary_dim=rot, dtype=torch.bfloat16, device=dev)
        caches = [torch.full(case.cache_shape, float("nan"), dtype=torch.bfloat16, device=dev) for _ in range(4)]
        got = tri.qk_norm_rope_write_kv(*case.args(caches[0], caches[1]))
        want = t.reference_qk_norm_rope_write_kv(*case.args(caches[2], caches[3]))
        k_got, k_want = (c.flatten(0, 1)[case.slot_mapping] for c in (caches[0], caches[2]))
        r = case.inv_freq.shape[0] * 2
        for name, g, w in (("q", got, want), ("k", k_got, k_want)):
            rot_same = float((g[..., :r] == w[..., :r]).float().mean())
            rest_same = float((g[..., r:] == w[..., r:]).float().mean())
            print(f"heads {heads}/{kv} positions {positions[0]}..{positions[-1]} ({len(positions)}) {name}: rotated {rot_same:.4f} pass-through {rest_same:.4f}")
