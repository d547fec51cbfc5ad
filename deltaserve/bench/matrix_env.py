"""What a matrix record states about the machine: GPU, driver, library versions, commit.

The GPU and library versions are read in a child Python process, so the matrix runner itself never
initialises CUDA (the server it starts owns the GPU).
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_PROBE = """
import importlib.metadata as md, importlib.util, json, pathlib, sys
out = {}
for name, dist in [("torch", "torch"), ("triton", "triton"), ("fla", "fla-core")]:
    try:
        out[name] = md.version(dist)
    except md.PackageNotFoundError:
        out[name] = None
out["writes_bytecode"] = not sys.flags.dont_write_bytecode
try:  # before this probe imports torch (an import may write bytecode)
    sources = list(pathlib.Path(importlib.util.find_spec("torch").origin).parent.rglob("*.py"))
    out["torch_modules"] = len(sources)
    out["torch_modules_compiled"] = sum(
        pathlib.Path(importlib.util.cache_from_source(str(f))).exists() for f in sources
    )
except Exception as exc:
    out["bytecode_error"] = repr(exc)
try:
    import torch
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpu_count"] = torch.cuda.device_count()
        out["gpu_memory_mib"] = torch.cuda.get_device_properties(0).total_memory // (1 << 20)
        out["cuda"] = torch.version.cuda
except Exception as exc:
    out["gpu_error"] = repr(exc)
print(json.dumps(out))
"""
_REPO = Path(__file__).resolve().parents[2]


def probe_environment(python: str = sys.executable) -> dict[str, Any]:
    """GPU name (torch.cuda.get_device_name), count and memory, CUDA, torch/triton/fla-core versions,
    how many of torch's modules have bytecode Python will use and whether it writes more, driver
    (nvidia-smi), Python, platform and the checkout's commit. Missing pieces are None."""
    env: dict[str, Any] = {"gpu": None, "torch": None, "triton": None, "fla": None}
    try:
        proc = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120)
        if proc.returncode == 0:
            env |= json.loads(proc.stdout.strip().splitlines()[-1])
        else:
            env["probe_error"] = proc.stderr.strip()[-2000:]
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        env["probe_error"] = repr(exc)
    env["driver"] = nvidia_smi_field("driver_version")
    env["python"] = platform.python_version()
    env["platform"] = platform.platform()
    env |= git_commit()
    env["variables"] = engine_variables(os.environ)
    return env


# The cache directory is where a machine keeps its kernels, not a setting of the run.
_NOT_SETTINGS = ("DELTASERVE_CACHE_DIR",)


def engine_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """The DELTASERVE_* variables the server inherits (switches such as DELTASERVE_FUSED_GEMV or
    DELTASERVE_ITL_DEBUG): an A/B run through one of them is told apart by its record."""
    return {k: environ[k] for k in sorted(environ) if k.startswith("DELTASERVE_") and k not in _NOT_SETTINGS}


def nvidia_smi_field(field: str) -> str | None:
    """The first GPU's `field` (e.g. name, driver_version), or None without nvidia-smi."""
    try:
        proc = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = proc.stdout.strip().splitlines()
    return lines[0].strip() if proc.returncode == 0 and lines else None


def git_commit() -> dict[str, Any]:
    """`commit` (HEAD) and `commit_dirty` (tracked files changed since it) of the checkout."""

    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", *args], cwd=_REPO, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "commit_dirty": bool(status) if status is not None else None}


def gpu_slug(gpu_name: str | None) -> str:
    """A file-name word for the GPU: "NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100-80gb-hbm3";
    "cpu" without a GPU."""
    if not gpu_name:
        return "cpu"
    words = re.sub(r"\bnvidia\b", " ", gpu_name.lower())
    return re.sub(r"[^a-z0-9]+", "-", words).strip("-") or "gpu"
