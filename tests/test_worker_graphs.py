"""Which graph runs which rows of a step (engine/worker.py), with recording stand-ins for the runners:
a pure decode step in the decode graphs, a step with prompt chunks whole in a prefill graph, the logits
in row order."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deltaserve.engine.cuda_graphs import padded_logits_rows
from deltaserve.engine.worker import ModelWorker
from deltaserve.ops.batch import BatchRow, leading_decode_rows


class Runner:
    """Takes rows when `fits(rows)`; returns one logits row per row (its first token id), or None."""

    def __init__(self, fits, fails: bool = False) -> None:
        self.fits, self.fails, self.calls = fits, fails, []

    def can_run(self, rows) -> bool:
        return self.fits(rows)

    def run(self, rows, fed=None):
        self.calls.append(([r.token_ids[0] for r in rows], fed))
        if self.fails:
            return None
        return torch.tensor([[float(r.token_ids[0])] for r in rows if r.need_logits])


class EagerModel:
    device = torch.device("cpu")

    def __call__(self, *args, **kwargs):
        raise AssertionError("eager forward")


def worker(decode: Runner, prefill: Runner) -> ModelWorker:
    return ModelWorker(
        EagerModel(),
        SimpleNamespace(page_size=16, copy=lambda copies: None, kv=None, states=None),
        decode,
        prefill,
    )


def one_token(rows) -> bool:
    return all(len(r.token_ids) == 1 for r in rows)


DECODE = [BatchRow([1], 5, [1], 1), BatchRow([2], 9, [2], 2)]
CHUNK = BatchRow([3, 4, 5], 0, [3], 3)


def test_a_unified_step_replays_whole_in_a_prefill_graph_with_the_fed_tokens():
    # One forward for decode rows and chunks (the weights read once), not a decode-graph replay beside
    # a prefill-graph replay: the prefill graph's GDN layers take the decode rows' decode kernel.
    decode, prefill = Runner(one_token), Runner(lambda rows: True)
    fed = torch.tensor([7])
    logits, _ = worker(decode, prefill).run([*DECODE, CHUNK], fed)
    assert logits.flatten().tolist() == [1.0, 2.0, 3.0]  # row order: decode rows, then the chunk
    assert decode.calls == [] and prefill.calls == [([1, 2, 3], fed)]


def test_a_pure_decode_step_replays_in_the_decode_graphs():
    decode, prefill = Runner(one_token), Runner(lambda rows: True)
    logits, _ = worker(decode, prefill).run(DECODE)
    assert logits.flatten().tolist() == [1.0, 2.0]
    assert decode.calls == [([1, 2], None)] and prefill.calls == []


def test_an_overlapped_step_of_one_token_rows_never_replays_a_decode_graph():
    # An async prefill whose chunks are one token after a context is decode-shaped; it runs beside the
    # decode steps, which own the decode graphs' inputs and memory pool, so it takes a prefill graph.
    decode, prefill = Runner(one_token), Runner(lambda rows: True)
    logits, _ = worker(decode, prefill).run(DECODE, decode_graphs=False)
    assert logits.flatten().tolist() == [1.0, 2.0]
    assert decode.calls == [] and prefill.calls == [([1, 2], None)]


def test_a_failed_capture_runs_nothing_and_leaves_the_step_eager():
    decode, prefill = Runner(one_token), Runner(lambda rows: True, fails=True)
    with pytest.raises(AssertionError, match="eager forward"):
        worker(decode, prefill).run([*DECODE, CHUNK])
    assert decode.calls == [] and [rows for rows, _ in prefill.calls] == [[1, 2, 3]]


def test_a_decode_bucket_whose_capture_fails_on_first_use_runs_in_a_prefill_graph():
    decode, prefill = Runner(one_token, fails=True), Runner(lambda rows: True)
    logits, _ = worker(decode, prefill).run(DECODE)
    assert logits.flatten().tolist() == [1.0, 2.0]
    assert decode.calls == [([1, 2], None)] and prefill.calls == [([1, 2], None)]


class AheadList:
    """capture_ahead as the runners': True per bucket left, then False, setting ahead_done."""

    def __init__(self, name: str, left: int, log: list) -> None:
        self.name, self.left, self.log, self.ahead_done = name, left, log, False

    def capture_ahead(self) -> bool:
        if self.left == 0:
            self.ahead_done = True
            return False
        self.left -= 1
        self.log.append(self.name)
        return True


def test_idle_captures_take_the_decode_buckets_first_then_the_prefill_graphs():
    log: list = []
    w = worker(AheadList("decode", 2, log), AheadList("prefill", 1, log))
    calls = []
    while not w.captures_ahead_done:
        calls.append(w.capture_ahead())
    assert log == ["decode", "decode", "prefill"] and calls == [True, True, True, False]
    assert w.capture_ahead() is False
    assert worker(None, None).captures_ahead_done and worker(None, None).capture_ahead() is False


def test_leading_decode_rows():
    prompt = BatchRow([9], 0, [4], 4)  # a one-token prompt is not a decode row
    verify = BatchRow([1, 2], 5, [1], 1, state_after=(6,))
    assert leading_decode_rows([*DECODE, CHUNK]) == 2
    assert leading_decode_rows([prompt, *DECODE]) == 0
    assert leading_decode_rows([DECODE[0], verify, DECODE[1]]) == 1
    assert leading_decode_rows([]) == 0


def test_rows_no_prefill_graph_fits_run_eager():
    decode, prefill = Runner(one_token), Runner(lambda rows: False)
    with pytest.raises(AssertionError, match="eager forward"):
        worker(decode, prefill).run([*DECODE, CHUNK])
    assert decode.calls == [] and prefill.calls == []


def test_logits_rows_are_padded_to_the_decode_graph_bucket():
    buckets = [1, 2, 4, 8, 16, 24]
    assert [padded_logits_rows(n, buckets) for n in (1, 3, 4, 5, 9, 17, 24)] == [1, 4, 4, 8, 16, 24, 24]
    assert padded_logits_rows(25, buckets) == 25  # beyond the largest bucket: as it is
    assert padded_logits_rows(0, buckets) == 0  # no row needs logits: no GEMM over the LM head


class HiddenModel:
    """An eager forward whose hidden row i is [i]; records the row counts of its LM-head GEMMs."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.gemm_rows: list[int] = []

    def __call__(self, batch, kv, states):
        return torch.arange(batch.logits_indices.shape[0], dtype=torch.float32)[:, None]

    def compute_logits(self, hidden, rows=None):
        self.gemm_rows.append(hidden.shape[0])
        return hidden[:rows] * 10


def test_an_eager_steps_lm_head_runs_at_its_decode_graph_bucket():
    # A step no graph fits (here: three prompt chunks) still pads its LM head to a decode-graph bucket:
    # a GEMM at a row count cuBLAS has not run yet can stall the host ~130 ms on an H200.
    model = HiddenModel()
    decode, prefill = Runner(lambda rows: False), Runner(lambda rows: False)
    decode.buckets = [1, 2, 4, 8]
    eager = ModelWorker(
        model, SimpleNamespace(page_size=16, copy=lambda copies: None, kv=None, states=None), decode, prefill
    )
    chunks = [BatchRow([3, 4], 0, [3], 3), BatchRow([5], 0, [4], 4), BatchRow([6, 7], 0, [5], 5)]
    logits, _ = eager.run(chunks)
    assert model.gemm_rows == [4]
    assert logits.flatten().tolist() == [0.0, 10.0, 20.0]  # the live rows only, in row order
