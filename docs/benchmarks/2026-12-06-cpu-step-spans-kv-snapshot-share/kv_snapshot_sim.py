"""The 9B saturated cell on an H100's KV pool with and without the prefix cache's GDN state snapshots:
scheduler only (the fake backend of tests/test_scheduler_fake_backend.py), under the linear step-time
model fitted to the H100 step log (8 ms + 28 us per token fed), through admission_ttft_sim.run of
docs/benchmarks/2026-12-05-h100-saturated-9b-reserve-ab/.

29,159 pages: the pool beside 6.33 GiB of snapshots (the default 8% of the GPU); 41,860 pages: the same
memory as KV pages (6.2 GiB / 512 KiB per 16-token page of the 9B's 8 full-attention layers).

    python3 docs/benchmarks/2026-12-06-cpu-step-spans-kv-snapshot-share/kv_snapshot_sim.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-12-05-h100-saturated-9b-reserve-ab"))

import admission_ttft_sim as sim  # noqa: E402

cell = sim.saturated_cell()
for pages in (29159, 41860):
    print(pages, "pages, default budgets:", sim.run(cell, 256, pages=pages), flush=True)
    print(
        pages,
        "pages, 8,192-token steps:",
        sim.run(cell, 256, pages=pages, budget=8192, saturated=0),
        flush=True,
    )
