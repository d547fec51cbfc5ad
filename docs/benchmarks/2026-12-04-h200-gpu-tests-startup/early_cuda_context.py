"""Fresh processes, in turn without and with the CUDA driver and device 0's primary context started on a
background thread (ctypes: the GIL is released for each driver call) beside the engine's imports; each
times its imports and its first CUDA call (torch.cuda.mem_get_info, as the weights' size check makes).

    python3 docs/benchmarks/2026-12-04-h200-gpu-tests-startup/early_cuda_context.py --runs 6
"""

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import threading
import time


def early_start(result: dict) -> None:
    began = time.monotonic()
    lib = ctypes.CDLL("libcuda.so.1")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    ok = lib.cuInit(0) == 0 and lib.cuDeviceGet(ctypes.byref(dev), 0) == 0
    ok = ok and lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    result["early_start_s"] = time.monotonic() - began if ok else None


def child(early: bool) -> dict:
    began = time.monotonic()
    result: dict = {"early": early, "early_start_s": None}
    thread = threading.Thread(target=early_start, args=(result,), daemon=True) if early else None
    if thread is not None:
        thread.start()
    import deltaserve.engine.core  # noqa: F401  (the engine process's imports)

    result["imports_s"] = time.monotonic() - began
    import torch

    torch.cuda.mem_get_info(0)
    result["context_ready_s"] = time.monotonic() - began
    if thread is not None:
        thread.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--child", choices=("on", "off"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child == "on")))
        return
    rows = []
    for i in range(args.runs):
        mode = "on" if i % 2 else "off"
        out = subprocess.run(
            [sys.executable, __file__, "--child", mode], capture_output=True, text=True, check=True
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print("run  early  imports  context ready  early start (s)")
    for i, r in enumerate(rows):
        early = f"{r['early_start_s']:.2f}" if r["early_start_s"] is not None else "-"
        print(
            f"{i:>3}  {'on' if r['early'] else 'off':>5}  {r['imports_s']:7.2f}  {r['context_ready_s']:13.2f}  {early}"
        )
    for mode in (False, True):
        ready = [r["context_ready_s"] for r in rows if r["early"] == mode]
        print(f"median context ready, early {'on' if mode else 'off'}: {statistics.median(ready):.2f} s")


if __name__ == "__main__":
    main()
