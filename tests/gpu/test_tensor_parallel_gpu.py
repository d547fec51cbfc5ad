"""Tensor parallelism on two GPUs (NCCL): two ranks generate what one generates, in float32 (bf16 rounding
of sharded partial sums would make near-ties flip): the tiny checkpoints, and the 0.8B shape with dummy
weights (a rank's dummy weights are its shard of the single-rank dummy model)."""

from __future__ import annotations

import pytest
import torch
from server_fixture import running_server
from tp_kill import kill_a_rank_mid_stream, rank_pids

from deltaserve.engine import tp as tp_module
from deltaserve.engine.llm import LLM
from deltaserve.model.layers.peer_all_reduce import MODE_ENV
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny import make_tiny

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def _generate(
    model_dir: str,
    tp: int,
    load_format: str = "auto",
    graphs_on_rank_0: list | None = None,
    gpu_memory_utilization: float = 0.9,
    peer_on_rank_0: list | None = None,
) -> list:
    prompts = [
        {"prompt_token_ids": list(range(1000 + 7 * i, 1000 + 7 * i + n))} for i, n in enumerate((3, 40, 90))
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)  # top-2: the margin
    with LLM(
        model_dir,
        tensor_parallel_size=tp,
        dtype="float32",
        load_format=load_format,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        max_model_len=4096,
        gpu_memory_utilization=gpu_memory_utilization,
    ) as llm:
        outs = llm.generate(prompts, params)
        if graphs_on_rank_0 is not None:
            worker = llm.engine.backend.worker
            graphs_on_rank_0.extend([worker.graphs, worker.prefill_graphs])
        if peer_on_rank_0 is not None:
            peer_on_rank_0.append(llm.engine.backend.worker.model.tp.peer)
    del llm
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.outputs[0] for o in outs]


# fla's chunked kernels round their fp32 dots through tf32 (a 10-bit mantissa), so the last-bit
# differences of sharded partial sums can move a prefilled state by a tf32 rounding, which a random model
# carries through later steps: the embedded `tiny` checkpoint differed by 1.48e-3 at a decode position
# with identical tokens (TP2 on one H100 against TP1), the 0.8B shape and tiny MoE stayed within 1e-3.
# A wrong shard or a missed all-reduce moves log-probs by O(1).
LOGPROB_TOLERANCE = 1e-2


def assert_same_generation(one: list, two: list) -> None:
    """TP2's tokens equal TP1's and their log-probs agree within LOGPROB_TOLERANCE. A failure names the
    prompt, the first position that differs and each run's margin between its top two tokens there: a
    margin near 0 is a near-tie that sharded partial sums flipped, a large one a real divergence."""
    for p, (a, b) in enumerate(zip(one, two, strict=True)):
        if a.token_ids != b.token_ids:
            i = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y)
            margins = [lp[i].top[0][1] - lp[i].top[1][1] for lp in (a.logprobs, b.logprobs)]
            raise AssertionError(
                f"prompt {p}: position {i} of {len(a.token_ids)}: TP1 token {a.token_ids[i]}, TP2 token "
                f"{b.token_ids[i]}; top-2 margins TP1 {margins[0]:.3g}, TP2 {margins[1]:.3g} nat; "
                f"TP1 {a.token_ids}, TP2 {b.token_ids}"
            )
        diffs = [abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs, strict=True)]
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        assert diffs[worst] < LOGPROB_TOLERANCE, (
            f"prompt {p}: position {worst}: log-probs differ by {diffs[worst]:.3g}"
        )


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe", "0.8b-shape"])
def test_two_gpus_generate_what_one_generates(tmp_path, preset) -> None:
    dummy = preset == "0.8b-shape"
    model_dir = str(make_tiny(tmp_path / preset, preset, weights=not dummy))
    load_format = "dummy" if dummy else "auto"
    one, two = _generate(model_dir, 1, load_format), _generate(model_dir, 2, load_format)
    assert_same_generation(one, two)


@pytest.mark.parametrize("sums", ["nccl", "peer"])
@pytest.mark.parametrize("preset", ["tiny", "0.8b-shape"])
def test_two_gpus_with_decode_graphs_generate_what_one_generates(tmp_path, preset, sums, monkeypatch) -> None:
    """DELTASERVE_TP_GRAPHS=1: every rank captures decode and prefill graphs that hold its all-reduces,
    and the steps replay them on both GPUs in step (the 40- and 90-token prompts are prefilled in 32-token
    steps: prefill graphs captured at first use). The sums go through NCCL, or with
    DELTASERVE_TP_ALLREDUCE=peer the small ones are one-shot reads of the peer's symmetric buffer."""
    monkeypatch.setattr(tp_module, "GRAPHS", True)
    monkeypatch.setenv(MODE_ENV, sums)  # read by every rank as it builds its model
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    dummy = preset == "0.8b-shape"
    model_dir = str(make_tiny(tmp_path / preset, preset, weights=not dummy))
    load_format = "dummy" if dummy else "auto"
    graphs: list = []
    peer: list = []
    one = _generate(model_dir, 1, load_format)
    two = _generate(model_dir, 2, load_format, graphs_on_rank_0=graphs, peer_on_rank_0=peer)
    decode, prefill = graphs
    assert decode is not None and decode.graphs  # rank 0 replayed from captured graphs
    assert prefill is not None and len(prefill.graphs) >= 2 and not prefill.failed  # start-up's + first use
    assert (peer[0] is not None) == (sums == "peer")  # rank 0's route for the small sums
    assert_same_generation(one, two)


@pytest.mark.parametrize("graphs", ["0", "1"])
def test_a_rank_killed_mid_stream_on_gpus_fails_the_request_and_the_server_exits_nonzero(
    monkeypatch, graphs
) -> None:
    """NCCL does not report a dead peer: rank 0 waits in its all-reduce until the collectives' timeout
    (DELTASERVE_TP_TIMEOUT_S, lowered here), then the request ends with an error and the server exits
    non-zero. Eager and with decode graphs on both ranks."""
    monkeypatch.setenv("DELTASERVE_TP_TIMEOUT_S", "20")
    monkeypatch.setenv("DELTASERVE_TP_GRAPHS", graphs)
    with running_server("--device", "cuda", "--tensor-parallel-size", "2") as server:
        assert set(rank_pids(server)) == {"dserve-rank1"}
        outcome = kill_a_rank_mid_stream(server)
        assert outcome.tokens_before == 3 and outcome.done, outcome
        assert outcome.error is not None and outcome.error["code"] in (500, 503), outcome
        assert outcome.seconds < 120, outcome
        assert server.proc.wait(120) != 0
