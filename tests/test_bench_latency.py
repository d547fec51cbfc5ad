"""`deltaserve bench latency`: the cell syntax, and one engine start measuring a matrix of cells."""

from __future__ import annotations

import json

import pytest

from deltaserve.bench.latency import parse_cell
from deltaserve.cli import main
from deltaserve.tiny import default_model_dir


def test_cells_parse_as_input_output_batch():
    assert parse_cell("8192:1:1") == (8192, 1, 1)
    assert parse_cell("1024:256:16") == (1024, 256, 16)


@pytest.mark.parametrize("bad", ["8192:1", "1:0:1", "a:1:1", "1:2:3:4", "-1:2:3"])
def test_malformed_cells_are_rejected_naming_the_flag(bad):
    with pytest.raises(ValueError, match="--cell expects IN:OUT:BATCH"):
        parse_cell(bad)


def test_one_invocation_measures_every_cell_in_order(tmp_path):
    out = tmp_path / "cells.json"
    argv = ["bench", "latency", "--model", str(default_model_dir()), "--max-model-len", "256"]
    argv += ["--cell", "17:3:1", "--cell", "5:1:2", "--num-iters", "1", "--num-iters-warmup", "0"]
    assert main([*argv, "--output-json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    cells = [(r["input_len"], r["output_len"], r["batch_size"]) for r in results]
    assert cells == [(17, 3, 1), (5, 1, 2)]
    assert results[0]["tpot_ms"] > 0 and results[1]["tpot_ms"] == 0 and results[1]["ttft_ms"] > 0
