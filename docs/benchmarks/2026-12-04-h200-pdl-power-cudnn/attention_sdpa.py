"""Fresh-prefill attention: our paged kernel against torch SDPA backends at the 4B/9B shape."""
import sys
sys.path[:0] = ["tests/gpu", "tests", "."]
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from triton.testing import do_bench
from test_kernels_attention_gpu import _case
from deltaserve.ops.triton import attention as tri

torch.manual_seed(0)
print("cudnn", torch.backends.cudnn.version())
for ctx, n in ((0, 8192), (0, 2048), (6144, 2048), (0, 32768)):
    case = _case([(ctx, n)], "4B", torch.bfloat16)
    total = ctx + n
    ours = tri.paged_attention(case.q, case.k_cache, case.v_cache, case.batch, case.scale)
    ms_ours = do_bench(lambda c=case: tri.paged_attention(c.q, c.k_cache, c.v_cache, c.batch, c.scale))
    pairs = n * ctx + n * (n + 1) // 2
    flops = 4 * 16 * 256 * pairs
    pages = case.batch.block_tables[0, : (total + 15) // 16].long()
    k = case.k_cache[pages].reshape(-1, 4, 256)[:total]
    v = case.v_cache[pages].reshape(-1, 4, 256)[:total]
    qh = case.q.transpose(0, 1).unsqueeze(0)
    kh = k.transpose(0, 1).unsqueeze(0)
    vh = v.transpose(0, 1).unsqueeze(0)
    gather = do_bench(lambda: (case.k_cache[pages].reshape(-1, 4, 256)[:total].transpose(0, 1).contiguous(),
                               case.v_cache[pages].reshape(-1, 4, 256)[:total].transpose(0, 1).contiguous()))
    line = f"ctx={ctx:<6} n={n:<6} ours {ms_ours*1e3:8.0f} us {flops/ms_ours/1e9:6.0f} TF | gather {gather*1e3:6.0f} us"
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION), ("eff", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel(be):
                if ctx == 0:
                    f = lambda: torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=case.scale, enable_gqa=True)
                else:
                    mask = causal_lower_right(n, total)
                    f = lambda: torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=case.scale, enable_gqa=True)
                out = f()
                err = (out[0].transpose(0, 1).float() - ours.float()).abs().max().item()
                ms = do_bench(f)
            line += f" | {name} {ms*1e3:7.0f} us {flops/ms/1e9:5.0f} TF err {err:.3g}"
        except Exception as e:  # noqa: BLE001
            line += f" | {name} n/a ({str(e).splitlines()[0][:60]})"
        # contiguous-head layout variant for cudnn/flash
    for name, be in (("flash-c", SDPBackend.FLASH_ATTENTION), ("cudnn-c", SDPBackend.CUDNN_ATTENTION)):
        try:
            kc, vc = kh.contiguous(), vh.contiguous()
            kr, vr = kc.repeat_interleave(4, dim=1), vc.repeat_interleave(4, dim=1)
            qc = qh.contiguous()
            with sdpa_kernel(be):
                f = (lambda: torch.nn.functional.scaled_dot_product_attention(qc, kr, vr, is_causal=True, scale=case.scale)) if ctx == 0 else (lambda: torch.nn.functional.scaled_dot_product_attention(qc, kr, vr, attn_mask=causal_lower_right(n, total), scale=case.scale))
                f()
                ms = do_bench(f)
            line += f" | {name} {ms*1e3:7.0f} us"
        except Exception as e:  # noqa: BLE001
            line += f" | {name} n/a ({str(e).splitlines()[0][:60]})"
    print(line, flush=True)
    del case
