"""Registers and spills of the GEMV kernel compiled for sm_90 without a GPU (Triton's compiler, then the
ptxas Triton uses for that target with -v). Usage: python gemv_registers.py MODE K_POW2 BLOCK_N BLOCK_K WARPS
(MODE 0 plain, 5 the input RMSNorm with the residual add; K_POW2 1 for the plain GEMV)."""

import os
import subprocess
import sys
import tempfile

from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource, compile

from deltaserve.ops.triton import linear

mode, k_pow2, block_n, block_k, warps = (int(a) for a in sys.argv[1:6])
signature = {name: "*bf16" for name in ("x_ptr", "w_ptr", "out_ptr", "g_ptr", "nw_ptr", "res_out_ptr")}
signature |= {"conv_w_ptr": "*bf16", "conv_state_ptr": "*bf16", "conv_slots_ptr": "*i32"}
signature |= {"eps": "fp32", "N": "i32", "K": "i32"}
signature |= {name: "i32" for name in ("stride_xm", "stride_wn", "stride_om", "stride_gm", "stride_gh")}
signature |= {name: "i32" for name in ("conv_channels", "stride_cw_ch", "stride_cw_k")}
signature |= {name: "i32" for name in ("stride_cs_slot", "stride_cs_ch", "stride_cs_k")}
signature |= {"pf_base": "i64", "pf_bytes": "i32"}
constexprs = {"ROWS": 1, "MODE": mode, "HEAD_DIM": 1, "K_POW2": k_pow2, "SWIGLU_OUT": False, "CONV_KW": 0}
constexprs |= {"BLOCK_N": block_n, "BLOCK_K": block_k, "PREFETCH": True, "PRELOAD": 1, "USE_GDC": True}
signature |= {name: "constexpr" for name in constexprs}
source = ASTSource(fn=linear._gemv_kernel, signature=signature, constexprs=constexprs)
kernel = compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
folder = tempfile.mkdtemp()
ptx = os.path.join(folder, "gemv.ptx")
with open(ptx, "w") as f:
    f.write(kernel.asm["ptx"])
done = subprocess.run(
    [get_ptxas(90).path, "-arch=sm_90a", "-v", ptx, "-o", os.path.join(folder, "gemv.o")],
    capture_output=True,
    text=True,
)
print(
    *sys.argv[1:6],
    *(
        line.split(":", 1)[-1].strip()
        for line in done.stderr.splitlines()
        if "Used" in line or "spill" in line
    ),
)
