"""Floors and the last measured record for each cell of the standard matrix (one H200).

Floors: batch-1 decode reads every weight once per token (H200 copy bandwidth ~4.3 TB/s, read + write
counted); prefill runs the model's FLOPs at the bf16 GEMM rate (~790 TFLOP/s). The previous record is
the 2026-12-01 H200 run with `bench serve` over HTTP, 0 failed requests, unless a figure says otherwise.
A new run's record (bench/matrix.py) shows both beside its own numbers; update this table when a
measured run becomes the record.
"""

from __future__ import annotations

from dataclasses import dataclass

PREVIOUS_RECORD_DATE = "2026-12-01"


@dataclass(frozen=True, slots=True)
class Figure:
    """One number as a record states it, e.g. Figure("TPOT", 3.03, "ms").

    `metric` names the key of a stream summary (matrix_report.StreamSummary) the number compares
    with, when it compares with one directly; `text` overrides the printed form (ranges, thousands)."""

    label: str
    value: float
    unit: str
    metric: str | None = None
    text: str | None = None
    approx: bool = False

    def __str__(self) -> str:
        if self.text is not None:
            return f"{self.label} {self.text}"
        return f"{self.label} {'~' if self.approx else ''}{self.value:g} {self.unit}"


@dataclass(frozen=True, slots=True)
class CellReference:
    floor: tuple[Figure, ...] = ()
    previous: tuple[Figure, ...] = ()
    note: str = ""  # the previous record's conditions where they differ from the cell's, or a source


_DECODE_4B_FLOOR = (Figure("TPOT", 1.95, "ms", metric="tpot_ms.median", approx=True),)

# Keyed by "<preset>:<cell name>" (the cell names of matrix_plan.py).
REFERENCES: dict[str, CellReference] = {
    "4b-shape:1-256-c1": CellReference(
        _DECODE_4B_FLOOR,
        (Figure("TPOT", 2.78, "ms"),),
        note="the 2026-12-04 record (decode-4b-c1-wait-first; 2.89 ms in decode-4b-decode-apart); on an H100 "
        "on 2026-12-06: 3.34 ms with the three GEMV fusions (the default since), 3.52 ms without, twice each "
        "(h100-fusions-default)",
    ),
    "4b-shape:1-1-c1": CellReference(previous=(Figure("TTFT", 7.1, "ms"),)),
    "4b-shape:1024-256-c1": CellReference(_DECODE_4B_FLOOR),
    "4b-shape:1024-256-c16": CellReference(previous=(Figure("TPOT", 4.72, "ms"),)),
    "4b-shape:1024-256-c64": CellReference(
        previous=(
            Figure("output", 6.31e3, "tok/s", text="6.31k tok/s"),
            Figure("TPOT", 9.35, "ms"),
            Figure("ITL p99", 36.2, "ms"),
        ),
        note="the 2026-12-04 record (decode-4b-decode-apart; 6.1k on 2026-12-02, decode-4b-ahead)",
    ),
    "4b-shape:128-512-c256": CellReference(
        previous=(Figure("output", 14.7e3, "tok/s", text="14.7k tok/s"), Figure("ITL p99", 528, "ms"))
    ),
    "4b-shape:8192-1-c1": CellReference(
        floor=(Figure("TTFT", 87, "ms", metric="ttft_ms.median", approx=True),),
        previous=(Figure("TTFT", 135.6, "ms"),),
        note="floor: 69 TFLOP at 790 TFLOP/s; the 2026-12-04 record (prefill-4b-tiles-fixes: 128 x 64 attention tiles)",
    ),
    "4b-shape:32768-1-c1": CellReference(
        previous=(Figure("TTFT", 0.512, "s"),),
        note="the 2026-12-04 record (prefill-4b-tiles-fixes)",
    ),
    "4b-shape:131072-1-c1": CellReference(previous=(Figure("TTFT", 6.0, "s"),)),
    "4b-shape:first-start": CellReference(previous=(Figure("HTTP ready", 18.3, "s"),)),
    "4b-shape:restart": CellReference(
        previous=(Figure("HTTP ready", 7.5, "s"),),
        note="the 2026-12-03 record (startup-4b-pyc: byte-compiled modules, warm kernel cache)",
    ),
    "4b-shape:mixed": CellReference(
        previous=(Figure("decoder ITL p99", 5.94, "ms"), Figure("decoder ITL max", 38.2, "ms")),
        note="the 2026-12-03 record (mixed-4b-ab-sync)",
    ),
    "4b-shape:multi-turn-c32": CellReference(
        note="published elsewhere: SGLang, 4B on one H200, 128 multi-turn clients, prefix hit rate 0.83"
    ),
    "9b-shape:1024-128-c512": CellReference(
        previous=(
            Figure("total", 32.6e3, "tok/s", text="32.6k tok/s"),
            Figure("TPOT", 112.6, "ms"),
            Figure("ITL p99", 147.9, "ms"),
        ),
        note="the 2026-12-04 record (saturated-9b-auto-seqs: 512 sequences, saturated steps; the GPU "
        "power-capped at ~1,600 MHz); 32.1k with 256 sequences and 2,048-token steps (saturated-9b-decode-apart, "
        "TPOT 62.5 ms, ITL p99 69.1 ms); vLLM 0.17.1 on an H100: 29.8k default, 34.5k tuned",
    ),
    "35b-a3b-shape:1024-128-c512": CellReference(
        previous=(
            Figure("total", 39.4e3, "tok/s", text="39.4k tok/s"),
            Figure("TPOT", 85.8, "ms"),
            Figure("ITL p99", 141.7, "ms"),
        ),
        note="the 2026-12-04 record (saturated-35b-auto-seqs: 512 sequences, saturated steps); 34.4k with 256 "
        "sequences and 2,048-token steps (saturated-35b-seq-blocks, TPOT 55.5 ms, ITL p99 64.1 ms); "
        "25.9k on 2026-12-01 with 512 prompts at concurrency 256",
    ),
    "27b-shape:1024-256-c1": CellReference(
        floor=(Figure("TPOT", 11.9, "ms", metric="tpot_ms.median", approx=True),),
        previous=(Figure("TPOT", 13.98, "ms"),),
    ),
    "35b-a3b-shape:1-256-c1": CellReference(
        floor=(Figure("TPOT", 1.6, "ms", metric="tpot_ms.median", approx=True),),
        previous=(Figure("TPOT", 6.49, "ms"),),
        note="the 2026-12-01 H200 record; on an H100 on 2026-12-06: 3.50 ms with the per-slot expert GEMVs "
        "(the default since), 4.59 ms with the grouped kernels (h100-slot-gemv-default)",
    ),
    "35b-a3b-shape:1-256-c4": CellReference(
        note="no H200 record; on an H100 on 2026-12-06: TPOT 6.19 ms with the per-slot expert GEMVs (32 slots, "
        "the default since), 7.11 ms with the grouped kernels, twice each (h100-gate-rope-moe-tails-slots32)",
    ),
    "27b-shape:1024-256-c16": CellReference(
        previous=(Figure("TPOT", 23.2, "ms"), Figure("ITL p99", 188, "ms"))
    ),
}


def reference(preset: str, cell: str) -> CellReference:
    return REFERENCES.get(f"{preset}:{cell}", CellReference())
