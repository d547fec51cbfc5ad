"""The GPU's clocks and power over a measured run, sampled by `nvidia-smi` beside it.

A saturated cell can run the GPU at its power limit for its whole duration, and the driver then lowers
the SM clock; a short `bench forward` burst runs at the full clock. So a record states the clock its
cell ran at: the SM clock of the busy samples against the GPU's maximum, the power drawn against its
limit, and how many busy samples the driver had throttled for power (the software power cap, bit 0x4 of
the active clock event reasons) or for heat (0x20 software, 0x40 hardware thermal slowdown).

Without `nvidia-smi` (a CPU machine) the sampler records nothing and a record says so by omission.
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

QUERY = (
    "index",
    "utilization.gpu",
    "clocks.sm",
    "clocks.max.sm",
    "power.draw",
    "power.limit",
    "clocks_throttle_reasons.active",
)
SAMPLE_MS = 500
BUSY_UTILIZATION = 50  # percent: a sample counts as busy from here
POWER_CAP = 0x4
THERMAL = 0x20 | 0x40


@dataclass(frozen=True, slots=True)
class GpuClocks:
    """Summary of the busy samples (all GPUs' rows together) of one run."""

    samples: int
    busy_samples: int
    sm_mhz_median: float
    sm_mhz_max: float | None  # the GPU's maximum SM clock
    power_w_median: float | None
    power_limit_w: float | None
    power_capped_share: float  # of busy samples
    thermal_share: float


def _number(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def summarize(csv_text: str) -> GpuClocks | None:
    """Rows of `nvidia-smi --query-gpu=<QUERY> --format=csv,noheader,nounits`; None without a busy row.
    Rows that do not parse (a partial last line, a driver message) are skipped."""
    rows = []
    for line in csv_text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != len(QUERY):
            continue
        util, sm = _number(fields[1]), _number(fields[2])
        if util is None or sm is None:
            continue
        try:
            reasons = int(fields[6], 16)
        except ValueError:
            reasons = 0
        rows.append((util, sm, _number(fields[3]), _number(fields[4]), _number(fields[5]), reasons))
    busy = [r for r in rows if r[0] >= BUSY_UTILIZATION]
    if not busy:
        return None
    powers = [r[3] for r in busy if r[3] is not None]
    limits = [r[4] for r in busy if r[4] is not None]
    maxima = [r[2] for r in busy if r[2] is not None]
    return GpuClocks(
        samples=len(rows),
        busy_samples=len(busy),
        sm_mhz_median=statistics.median(r[1] for r in busy),
        sm_mhz_max=max(maxima) if maxima else None,
        power_w_median=statistics.median(powers) if powers else None,
        power_limit_w=max(limits) if limits else None,
        power_capped_share=sum(1 for r in busy if r[5] & POWER_CAP) / len(busy),
        thermal_share=sum(1 for r in busy if r[5] & THERMAL) / len(busy),
    )


@contextlib.contextmanager
def sampled(csv_path: Path) -> Iterator[None]:
    """Samples every GPU every SAMPLE_MS into `csv_path` while the block runs (nothing without
    nvidia-smi)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        yield
        return
    argv = [exe, f"--query-gpu={','.join(QUERY)}", "--format=csv,noheader,nounits", f"--loop-ms={SAMPLE_MS}"]
    with csv_path.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def read_summary(csv_path: Path) -> GpuClocks | None:
    with contextlib.suppress(OSError):
        return summarize(csv_path.read_text())
    return None
