"""The GPU clock and power sampler beside a measured run (bench/gpu_clocks.py) and its record section."""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import asdict

import pytest

from deltaserve.bench import gpu_clocks
from deltaserve.bench.gpu_clocks import GpuClocks, read_summary, sampled, summarize
from deltaserve.bench.matrix_report import render_markdown

# index, utilization %, SM MHz, max SM MHz, power W, power limit W, active clock event reasons
ROWS = """\
0, 0, 345, 1980, 82.56, 700.00, 0x0000000000000001
0, 100, 1665, 1980, 692.47, 700.00, 0x0000000000000004
0, 100, 1680, 1980, 699.00, 700.00, 0x0000000000000004
0, 95, 1980, 1980, 440.55, 700.00, 0x0000000000000000
0, 100, 1500, 1980, 600.00, [N/A], 0x0000000000000020
0, 10
"""


def test_the_busy_samples_give_the_clock_power_and_throttle_shares():
    assert summarize(ROWS) == GpuClocks(
        samples=5,  # the partial last line is skipped
        busy_samples=4,  # utilisation >= 50%
        sm_mhz_median=(1665 + 1680) / 2,
        sm_mhz_max=1980,
        power_w_median=(600.00 + 692.47) / 2,
        power_limit_w=700,
        power_capped_share=2 / 4,  # 0x4
        thermal_share=1 / 4,  # 0x20
    )


def test_an_idle_run_has_no_summary():
    assert summarize("0, 0, 345, 1980, 82.56, 700.00, 0x1\n0, 3, 345, 1980, 82.5, 700.00, 0x1\n") is None
    assert summarize("") is None


def test_without_nvidia_smi_the_block_runs_and_nothing_is_recorded(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: None)
    ran = []
    with sampled(tmp_path / "cell.gpu.csv"):
        ran.append(True)
    assert ran == [True] and not (tmp_path / "cell.gpu.csv").exists()
    assert read_summary(tmp_path / "cell.gpu.csv") is None


@pytest.mark.skipif(os.name != "posix", reason="a shell script stands in for nvidia-smi")
def test_nvidia_smi_samples_while_the_block_runs_and_stops_after_it(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    args = tmp_path / "args"
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$@" > {args}\n'
        "while true; do echo '0, 100, 1665, 1980, 692.47, 700.00, 0x0000000000000004'; sleep 0.02; done\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: str(fake))
    csv = tmp_path / "cell.gpu.csv"
    with sampled(csv):
        time.sleep(0.3)
    size = csv.stat().st_size
    time.sleep(0.1)
    assert csv.stat().st_size == size, "nvidia-smi still writing after the block"
    assert args.read_text().split() == [
        "--query-gpu=index,utilization.gpu,clocks.sm,clocks.max.sm,power.draw,power.limit,"
        "clocks_throttle_reasons.active",
        "--format=csv,noheader,nounits",
        "--loop-ms=500",
    ]
    summary = read_summary(csv)
    assert summary is not None and summary.sm_mhz_median == 1665 and summary.power_capped_share == 1.0


def test_the_record_states_each_cells_clock_and_power(tmp_path):
    import test_bench_matrix as m  # the record builders

    _, record = m._record(tmp_path, "decode-4b", "1-256-c1,1024-256-c64")
    record["cells"][0]["gpu_clocks"] = asdict(summarize(ROWS))
    md = render_markdown(json.loads(json.dumps(record)))
    assert "## GPU clocks over each measured run" in md
    assert (
        "| 4B, 1 in / 256 out, concurrency 1 | 4 of 5 | 1672 of 1980 MHz | 646 W of 700 W | 50% | 25% |" in md
    )
    assert "1024 in / 256 out, concurrency 64 | 4 of" not in md  # no samples, no row
    record["cells"][0]["gpu_clocks"] = None
    assert "GPU clocks" not in render_markdown(record)
