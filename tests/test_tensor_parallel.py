"""Tensor parallelism: the per-rank geometry, checkpoint shards, the start gate, exact-rank replies, and
two ranks (CPU processes over gloo) against one, end to end."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file
from scheduler_harness import LOGPROB_TOL
from server_fixture import MODEL, running_server
from tp_kill import kill_a_rank_mid_stream, rank_pids

from deltaserve.config import ModelConfig
from deltaserve.engine.llm import LLM
from deltaserve.engine.rank import rank_device
from deltaserve.engine.tp import (
    Cancel,
    CaptureGraphs,
    CapturePrefillGraphs,
    Execute,
    GraphsCaptured,
    RankGroup,
    RankReady,
    RankReply,
    RankStep,
    RankWorkers,
    Stop,
    TensorParallelError,
    TensorParallelWorker,
    _serve_steps,
)
from deltaserve.engine_config import EngineConfig
from deltaserve.errors import ConfigError
from deltaserve.model.layers.parallel import Shard, TensorParallel
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.model.weights import init_dummy_weights, load_weights
from deltaserve.ops.batch import BatchRow
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny import make_tiny, official_config

# ---- geometry and shards (pure) --------------------------------------------------------------------


def test_shard_divides_heads_and_widths_of_the_4b_shape() -> None:
    cfg = ModelConfig.from_dict(official_config("4b-shape"))
    local = cfg.shard(2)
    assert (local.num_attention_heads, local.num_key_value_heads) == (8, 2)
    assert (local.linear_num_key_heads, local.linear_num_value_heads) == (8, 16)
    assert local.intermediate_size == 4608
    assert (local.hidden_size, local.head_dim, local.vocab_size) == (2560, 256, cfg.vocab_size)
    assert local.kv_bytes_per_token(torch.bfloat16) * 2 == cfg.kv_bytes_per_token(torch.bfloat16)
    assert cfg.shard(1) is cfg


def test_shard_names_the_field_it_cannot_divide() -> None:
    cfg = ModelConfig.from_dict(official_config("4b-shape"))  # 4 kv heads
    with pytest.raises(
        ConfigError,
        match=r"--tensor-parallel-size 8 must divide the model's num_key_value_heads, got num_key_value_heads=4",
    ):
        cfg.shard(8)
    moe = dataclasses.replace(ModelConfig.from_dict(official_config("tiny-moe")), moe_intermediate_size=65)
    with pytest.raises(
        ConfigError, match="must divide the model's moe_intermediate_size, got moe_intermediate_size=65"
    ):
        moe.shard(2)


def test_a_shard_takes_its_chunk_of_each_segment() -> None:
    full = torch.arange(12).view(12, 1)  # segments of 4, 4 and 4 rows: q | k | v
    second = Shard(dim=0, rank=1, size=2, segments=(4, 4, 4))
    assert second.take(full).flatten().tolist() == [2, 3, 6, 7, 10, 11]
    assert second.full_shape((6, 1)) == (12, 1)
    columns = Shard(dim=1, rank=0, size=3)
    assert columns.take(torch.arange(6).view(1, 6)).tolist() == [[0, 1]]
    assert columns.full_shape((5, 2)) == (5, 6)
    unequal = Shard(dim=0, rank=1, size=2, segments=(2, 2, 6))  # GDN: key channels, key, value
    assert unequal.take(torch.arange(10)).tolist() == [1, 3, 7, 8, 9]


def test_single_rank_has_no_shards() -> None:
    assert TensorParallel().shard(0) is None
    assert TensorParallel(1, 2).shard(1) == Shard(1, 1, 2)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    return {preset: make_tiny(root / preset, preset) for preset in ("tiny", "tiny-moe")}


def fused_segments(name: str, full: torch.Tensor, cfg: ModelConfig) -> tuple[int, tuple[int, ...]]:
    """(dim, full segment sizes) of a sharded parameter: the pieces a fused parameter concatenates."""
    kd, vd, hv = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_num_value_heads
    if name.endswith("mixer.in_proj"):
        return 0, (kd, kd, vd, vd, hv, hv)  # q | k | v channels, z, b, a
    if name.endswith("mixer.conv1d"):
        return 0, (kd, kd, vd)
    if name.endswith("mixer.qkv_proj"):
        q, kv = 2 * cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        return 0, (q, kv, kv)
    if name.endswith("gate_up_proj"):
        return 0, (full.shape[0] // 2,) * 2
    if name.endswith("w13"):
        return 1, (full.shape[1] // 2,) * 2
    if name.endswith(("o_proj", "out_proj", "down_proj", "w2")):
        return full.dim() - 1, (full.shape[-1],)
    return 0, (full.shape[0],)


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_the_shards_of_every_rank_rebuild_every_parameter(checkpoints, preset) -> None:
    """Rank 0's and rank 1's parameters (of two), put back together segment by segment, are the
    single-rank parameters exactly; replicated parameters are equal on both ranks."""
    model_dir = checkpoints[preset]
    cfg = ModelConfig.from_dir(model_dir)
    cpu = torch.device("cpu")
    whole = Qwen35ForCausalLM(cfg, dtype=torch.float32, device=cpu)
    load_weights(whole, model_dir)
    ranks = []
    for rank in range(2):
        m = Qwen35ForCausalLM(cfg, dtype=torch.float32, device=cpu, tp=TensorParallel(rank, 2))
        load_weights(m, model_dir)
        ranks.append(dict(m.named_parameters()))
    sharded = 0
    for name, full in whole.named_parameters():
        a, b = ranks[0][name], ranks[1][name]
        if a.shape == full.shape:
            assert torch.equal(a, full) and torch.equal(b, full), name
            continue
        sharded += 1
        dim, segments = fused_segments(name, full, cfg)
        local = [n // 2 for n in segments]
        rebuilt = [
            torch.cat([x, y], dim) for x, y in zip(a.split(local, dim), b.split(local, dim), strict=True)
        ]
        assert torch.equal(torch.cat(rebuilt, dim), full), name
    assert sharded > 0


def test_tensor_parallel_flags_are_validated_up_front() -> None:
    with pytest.raises(ConfigError, match="--tensor-parallel-size must be an integer >= 1, got 0"):
        EngineConfig(tensor_parallel_size=0).validate()
    with pytest.raises(ConfigError, match="--prefill-overlap is not supported with --tensor-parallel-size 2"):
        EngineConfig(tensor_parallel_size=2, prefill_overlap=True).validate()
    with pytest.raises(ConfigError, match="rank r runs on cuda:r"):
        EngineConfig(tensor_parallel_size=2, device="cuda:1").validate()


def test_rank_r_runs_on_cuda_r_and_every_rank_on_the_one_gpu_with_tp_on_one_gpu(monkeypatch) -> None:
    cuda = torch.device("cuda")
    assert [rank_device(cuda, r, 2) for r in (0, 1)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert rank_device(cuda, 0, 1) == cuda
    assert rank_device(torch.device("cpu"), 1, 2) == torch.device("cpu")
    monkeypatch.setenv("DELTASERVE_TP_ONE_GPU", "1")
    assert [rank_device(cuda, r, 2) for r in (0, 1)] == [torch.device("cuda", 0)] * 2
    assert rank_device(torch.device("cpu"), 1, 2) == torch.device("cpu")


def test_graphs_with_every_rank_on_one_gpu_are_refused_before_any_rank_starts(monkeypatch) -> None:
    """gloo's collectives cannot be captured in CUDA graphs: DELTASERVE_TP_ONE_GPU=1 with
    DELTASERVE_TP_GRAPHS=1 is a start-up error naming both, raised before a rank process is spawned."""
    monkeypatch.setenv("DELTASERVE_TP_ONE_GPU", "1")
    monkeypatch.setattr("deltaserve.engine.tp.GRAPHS", True)
    monkeypatch.setattr(EngineConfig, "resolved_device", lambda self: torch.device("cuda"))
    spawned = []

    def spawn_reached(method: str) -> None:
        spawned.append(method)
        raise RuntimeError("past the checks, at the spawn")

    monkeypatch.setattr("deltaserve.engine.tp.mp.get_context", spawn_reached)
    config = EngineConfig(tensor_parallel_size=2)
    with pytest.raises(
        ConfigError, match="DELTASERVE_TP_ONE_GPU=1 joins the ranks over gloo.*DELTASERVE_TP_GRAPHS"
    ):
        RankWorkers.start(config, Path("unused"), None, 0)
    assert spawned == []
    monkeypatch.setattr("deltaserve.engine.tp.GRAPHS", False)  # eager: past the check, to the spawn
    with pytest.raises(RuntimeError, match="at the spawn"):
        RankWorkers.start(config, Path("unused"), None, 0)
    assert spawned == ["spawn"]


# ---- the start gate and the reply check (rank 0's side, over fake channels) ------------------------


class FakeChannel:
    """Records what rank 0 sends (into a log shared by all ranks); replies from a script."""

    def __init__(self, rank: int, log: list, *, broken: bool = False, replies: tuple = ()) -> None:
        self.rank, self.log, self.broken, self.replies = rank, log, broken, list(replies)

    def send(self, obj: object) -> None:
        if self.broken:
            raise BrokenPipeError(f"rank {self.rank} is gone")
        self.log.append((self.rank, obj))

    def poll(self, timeout: float) -> bool:
        return bool(self.replies)

    def recv(self) -> object:
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def close(self) -> None:
        pass


ROWS = [BatchRow([5, 6, 7], 0, [1], 1, True)]


def test_the_start_gate_releases_a_step_only_after_every_rank_has_it() -> None:
    log: list = []
    group = RankGroup([FakeChannel(r, log, replies=(RankReply(r, 0),)) for r in (1, 2, 3)], timeout_s=1)
    assert group.dispatch(ROWS) == 0
    kinds = [type(msg) for _, msg in log]
    assert kinds == [RankStep] * 3 + [Execute] * 3
    assert [rank for rank, _ in log] == [1, 2, 3, 1, 2, 3]
    assert all(msg.step_id == 0 for _, msg in log)
    group.collect(0)
    assert group.poisoned is None


def test_a_step_names_its_fed_rows_to_every_rank() -> None:
    log: list = []
    group = RankGroup([FakeChannel(r, log, replies=(RankReply(r, 0),)) for r in (1, 2)], timeout_s=1)
    group.dispatch(ROWS, fed_rows=1)
    assert [msg for _, msg in log[:2]] == [RankStep(0, ROWS, fed_rows=1)] * 2


def test_a_rank_that_cannot_take_a_step_cancels_it_everywhere_and_poisons_the_group() -> None:
    log: list = []
    channels = [FakeChannel(1, log), FakeChannel(2, log, broken=True), FakeChannel(3, log)]
    group = RankGroup(channels, timeout_s=1)
    with pytest.raises(TensorParallelError, match="rank 2 could not take step 0"):
        group.dispatch(ROWS)
    assert log == [(1, RankStep(0, ROWS)), (1, Cancel(0))]  # rank 3 never saw it; nobody was released
    channels[1].broken = False
    with pytest.raises(TensorParallelError, match="rank 2 could not take step 0"):  # fail-stop
        group.dispatch(ROWS)
    assert len(log) == 2


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        (RankReply(2, 0), "rank 1's channel replied as rank 2 for step 0, expected rank 1 for step 0"),
        (RankReply(1, 7), "rank 1's channel replied as rank 1 for step 7, expected rank 1 for step 0"),
        (RankReply(1, 0, "RuntimeError: boom"), "rank 1 failed step 0: RuntimeError: boom"),
        (Cancel(0), "rank 1 replied Cancel to step 0, expected RankReply"),
        (EOFError(), "rank 1 is gone"),
        (None, "rank 1 sent no reply to step 0 within"),
    ],
)
def test_every_rank_replies_exactly_once_for_the_step_or_the_group_is_poisoned(reply, reason) -> None:
    log: list = []
    first = FakeChannel(1, log, replies=() if reply is None else (reply,))
    second = FakeChannel(2, log, replies=(RankReply(2, 0),))
    group = RankGroup([first, second], timeout_s=0.01)
    step = group.dispatch(ROWS)
    with pytest.raises(TensorParallelError, match=reason):
        group.collect(step)
    assert group.poisoned is not None and reason in group.poisoned
    sent = len(log)
    with pytest.raises(TensorParallelError):
        group.dispatch(ROWS)
    assert len(log) == sent  # nothing more reaches any rank


def test_a_rank_that_fails_to_start_is_reported_with_its_own_reason() -> None:
    """Rank 0 meets such a failure as a transport error in a start-up collective; the rank's reason
    (sent before it exited) is what the user is told."""
    log: list = []
    workers = RankWorkers(
        [],
        [
            FakeChannel(1, log),
            FakeChannel(2, log, replies=(RankReady(2, "OutOfMemoryError: CUDA out of memory"),)),
        ],
    )
    assert workers.startup_failures(wait_s=0.01) == [
        "rank 2 failed to start: OutOfMemoryError: CUDA out of memory"
    ]
    workers.close()
    assert [type(msg).__name__ for _, msg in log] == ["Stop", "Stop"]


class ScriptedRank:
    """A rank's channel as the rank sees it: rank 0's messages from a script, the rank's replies kept."""

    def __init__(self, *messages: object) -> None:
        self.messages, self.sent = list(messages), []

    def recv(self) -> object:
        return self.messages.pop(0)

    def send(self, obj: object) -> None:
        self.sent.append(obj)


class RecordingWorker:
    def __init__(self) -> None:
        self.graphs, self.prefill_graphs, self.runs, self.device = None, None, [], torch.device("cpu")

    def run(self, rows, fed=None, *, logits, copies_before, copies_after, decode_graphs):
        self.runs.append((logits, decode_graphs))
        return None, None

    def capture_ahead(self) -> bool:
        self.runs.append("capture ahead")
        return True


def test_a_rank_captures_its_decode_graphs_when_told_and_then_takes_rank_0s_path() -> None:
    """Before the capture a rank never computes logits (eager, nothing to replay); with graphs it runs
    with rank 0's `logits`, so it replays exactly where rank 0 replays and their all-reduces meet."""
    captured = []

    def capture(worker, command):
        captured.append(command)
        return "graphs"

    channel = ScriptedRank(
        RankStep(0, ROWS, logits=True),
        Execute(0),
        CaptureGraphs(max_num_seqs=8, max_model_len=256),
        RankStep(1, ROWS, logits=True),
        Execute(1),
        RankStep(2, ROWS, logits=False, decode_graphs=False),
        Execute(2),
        Stop(),
    )
    worker = RecordingWorker()
    _serve_steps(1, worker, channel, capture)
    assert captured == [CaptureGraphs(8, 256)] and worker.graphs == "graphs"
    assert worker.runs == [(False, True), (True, True), (False, False)]
    assert channel.sent == [RankReply(1, 0), GraphsCaptured(1), RankReply(1, 1), RankReply(1, 2)]


def test_a_rank_whose_capture_fails_reports_why_and_rank_0_names_it() -> None:
    def capture(worker, command):
        raise RuntimeError("CUDA error: out of memory")

    channel = ScriptedRank(CaptureGraphs(8, 256), RankStep(0, ROWS), Execute(0))
    _serve_steps(2, RecordingWorker(), channel, capture)
    assert channel.sent == [GraphsCaptured(2, "RuntimeError: CUDA error: out of memory")]  # and it exited
    log: list = []
    workers = RankWorkers(
        [], [FakeChannel(1, log, replies=(GraphsCaptured(1),)), FakeChannel(2, log, replies=channel.sent)]
    )
    workers.start_graph_capture(8, 256)
    assert log == [(1, CaptureGraphs(8, 256)), (2, CaptureGraphs(8, 256))]
    with pytest.raises(TensorParallelError, match="rank 2 failed to capture its decode graphs: RuntimeError"):
        workers.wait_graphs()
    failed = RankWorkers([], [FakeChannel(1, log, replies=(GraphsCaptured(1, "RuntimeError: boom"),))])
    assert failed.startup_failures(wait_s=0.01) == [
        "rank 1 failed to capture its decode graphs: RuntimeError: boom"
    ]


def test_a_rank_builds_its_prefill_graphs_after_its_decode_graphs_and_captures_ahead_when_rank_0_does() -> (
    None
):
    """The prefill graphs' captures meet rank 0's: the smallest at start-up when told, later ones in a
    capture-ahead step (its own reply, no forward); a step then runs with rank 0's `logits`."""
    told = []

    def capture_prefill(worker, command):
        assert worker.graphs == "graphs"  # their memory pool is the decode graphs'
        told.append(command)
        return "prefill graphs"

    channel = ScriptedRank(
        CaptureGraphs(8, 256),
        CapturePrefillGraphs(max_rows=8, max_tokens=64, max_model_len=256),
        RankStep(0, [], capture_ahead=True),
        Execute(0),
        RankStep(1, ROWS, logits=True),
        Execute(1),
        Stop(),
    )
    worker = RecordingWorker()
    _serve_steps(1, worker, channel, lambda worker, command: "graphs", capture_prefill)
    assert told == [CapturePrefillGraphs(8, 64, 256)] and worker.prefill_graphs == "prefill graphs"
    assert worker.runs == ["capture ahead", (True, True)]
    assert channel.sent == [
        GraphsCaptured(1),
        GraphsCaptured(1, None, "prefill"),
        RankReply(1, 0),
        RankReply(1, 1),
    ]


def test_a_rank_whose_prefill_capture_fails_names_it_and_exits() -> None:
    def capture_prefill(worker, command):
        raise RuntimeError("CUDA error: out of memory")

    channel = ScriptedRank(CaptureGraphs(8, 256), CapturePrefillGraphs(8, 64, 256), RankStep(0, ROWS))
    _serve_steps(2, RecordingWorker(), channel, lambda worker, command: "graphs", capture_prefill)
    assert channel.sent == [
        GraphsCaptured(2),
        GraphsCaptured(2, "RuntimeError: CUDA error: out of memory", "prefill"),
    ]
    log: list = []
    workers = RankWorkers(
        [],
        [
            FakeChannel(1, log, replies=(GraphsCaptured(1, None, "prefill"),)),
            FakeChannel(2, log, replies=channel.sent[1:]),
        ],
    )
    workers.start_prefill_graph_capture(8, 64, 256)
    assert log == [(1, CapturePrefillGraphs(8, 64, 256)), (2, CapturePrefillGraphs(8, 64, 256))]
    with pytest.raises(
        TensorParallelError, match="rank 2 failed to capture its prefill graphs: RuntimeError"
    ):
        workers.wait_graphs()


class FakePrefillGraphs:
    """capture_ahead as the runner's: True per bucket captured, then False once, setting ahead_done."""

    def __init__(self, buckets: int) -> None:
        self.left, self.ahead_done = buckets, False

    def capture_ahead(self) -> bool:
        if self.left == 0:
            self.ahead_done = True
            return False
        self.left -= 1
        return True


def test_rank_0s_idle_capture_is_a_step_of_every_rank_until_its_list_is_done() -> None:
    """Rank 0 alone would wait in the capture's first all-reduce: each idle capture goes to every rank as
    a capture-ahead step, and once rank 0 has nothing left no step is sent."""
    log: list = []
    replies = {r: tuple(RankReply(r, step) for step in (0, 1)) for r in (1, 2)}
    workers = RankWorkers([], [FakeChannel(r, log, replies=replies[r]) for r in (1, 2)])
    model = type("Model", (), {"device": torch.device("cpu")})()
    eager = TensorParallelWorker(model, None, workers)
    assert eager.capture_ahead() is False and log == []  # no prefill graphs: nothing to capture
    worker = TensorParallelWorker(model, None, workers, graphs=None, prefill_graphs=FakePrefillGraphs(1))
    assert [worker.capture_ahead(), worker.capture_ahead(), worker.capture_ahead()] == [True, False, False]
    steps = [msg for _, msg in log if isinstance(msg, RankStep)]
    assert steps == [RankStep(0, [], capture_ahead=True)] * 2 + [RankStep(1, [], capture_ahead=True)] * 2
    assert workers.group.poisoned is None


def test_decode_buckets_left_to_idle_time_are_captured_as_steps_of_every_rank() -> None:
    """Decode graphs above the start-up buckets, like prefill graphs, are captured by every rank at once."""
    log: list = []
    replies = {r: tuple(RankReply(r, step) for step in (0, 1, 2)) for r in (1, 2)}
    workers = RankWorkers([], [FakeChannel(r, log, replies=replies[r]) for r in (1, 2)])
    model = type("Model", (), {"device": torch.device("cpu")})()
    worker = TensorParallelWorker(
        model, None, workers, graphs=FakePrefillGraphs(1), prefill_graphs=FakePrefillGraphs(1)
    )
    assert [worker.capture_ahead() for _ in range(4)] == [True, True, False, False]
    steps = [msg for _, msg in log if isinstance(msg, RankStep)]
    assert [s.step_id for s in steps] == [0, 0, 1, 1, 2, 2] and all(s.capture_ahead for s in steps)


# ---- two ranks end to end (CPU processes over gloo) -------------------------------------------------


def _generate(model_dir: Path, tp: int) -> list:
    prompts = [
        {"prompt_token_ids": list(range(1000 + 7 * i, 1000 + 7 * i + n))}
        for i, n in enumerate((3, 40, 17, 90))
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2) for _ in prompts]
    params[2] = SamplingParams(
        temperature=0.9, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True, logprobs=2
    )
    params[3] = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    # 32-token steps: chunked prefill, and steps that mix prefill chunks with decode rows.
    with LLM(str(model_dir), tensor_parallel_size=tp, max_num_batched_tokens=32, max_num_seqs=4) as llm:
        outs = llm.generate(prompts, params)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return outs


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_two_ranks_generate_what_one_rank_generates(checkpoints, preset, monkeypatch) -> None:
    fed_rows: list[int] = []
    logits: list[bool] = []
    dispatch = RankGroup.dispatch

    def recording(self, rows, copies_before=(), copies_after=(), fed=0, **flags):
        fed_rows.append(fed)
        logits.append(flags["logits"])
        return dispatch(self, rows, copies_before, copies_after, fed, **flags)

    monkeypatch.setattr(RankGroup, "dispatch", recording)
    one, two = _generate(checkpoints[preset], 1), _generate(checkpoints[preset], 2)
    # Decode-ahead ran: steps fed the previous step's tokens, which rank 1 got from rank 0's broadcast.
    assert any(n > 0 for n in fed_rows), fed_rows
    assert any(logits), "every step reaches the ranks with rank 0's logits flag"
    scored = list(zip(one[3].prompt_logprobs[1:], two[3].prompt_logprobs[1:], strict=True))
    assert len(scored) == 89 and all(abs(x.logprob - y.logprob) < LOGPROB_TOL for x, y in scored)
    for a, b in zip([o.outputs[0] for o in one], [o.outputs[0] for o in two], strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(x.logprob - y.logprob) < LOGPROB_TOL  # partial sums added in another order


def test_two_ranks_agree_on_the_default_max_num_seqs(checkpoints) -> None:
    """Without --max-num-seqs every rank resolves it (one more all-reduce in build_rank, on every rank in
    the same place) and rank 0 serves with the agreed value: 256 on the CPU."""
    with LLM(str(checkpoints["tiny"]), tensor_parallel_size=2, max_model_len=256) as llm:
        assert llm.engine.info.max_num_seqs == 256
        assert llm.engine.config.max_num_seqs == 256
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)
    assert out[0].error is None and len(out[0].outputs[0].token_ids) == 4


def test_dummy_weights_of_a_rank_are_its_shard_of_the_single_rank_dummy_model(tmp_path) -> None:
    """--load-format dummy under TP runs the same model as one rank: the single-rank dummy weights,
    saved under their checkpoint names and loaded as rank r of 2, equal rank r's own dummy weights."""
    cfg = ModelConfig.from_dict(official_config("tiny-moe"))
    cpu = torch.device("cpu")
    whole = Qwen35ForCausalLM(cfg, dtype=torch.float32, device=cpu)
    init_dummy_weights(whole, seed=3)
    tensors = {
        spec.name: spec.target.contiguous()
        for req in whole.weight_requirements()
        for spec in req.alternatives[0]
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for rank in range(2):
        loaded = Qwen35ForCausalLM(cfg, dtype=torch.float32, device=cpu, tp=TensorParallel(rank, 2))
        load_weights(loaded, tmp_path)
        dummy = Qwen35ForCausalLM(cfg, dtype=torch.float32, device=cpu, tp=TensorParallel(rank, 2))
        init_dummy_weights(dummy, seed=3)
        for (name, a), (_, b) in zip(loaded.named_parameters(), dummy.named_parameters(), strict=True):
            assert torch.equal(a, b), (rank, name)


@pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnhandledThreadExceptionWarning"
)  # the fatal path re-raises
def test_a_dead_rank_fails_the_requests_instead_of_hanging(checkpoints) -> None:
    with LLM(str(checkpoints["tiny"]), tensor_parallel_size=2, max_num_seqs=2) as llm:
        rank1 = llm.engine.workers.processes[0]
        rank1.kill()
        rank1.join(10)
        started = time.monotonic()
        outs = llm.generate(
            [{"prompt_token_ids": [1, 2, 3]}], [SamplingParams(max_tokens=4, ignore_eos=True)]
        )
        assert time.monotonic() - started < 30
    assert outs[0].error is not None and "rank 1" in outs[0].error


@pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnhandledThreadExceptionWarning"
)  # the fatal path re-raises
def test_a_rank_dying_mid_generation_fails_the_request_within_seconds(checkpoints) -> None:
    """Rank 0 is then inside a collective with the dead rank: the transport error, not a hang, ends it."""
    with LLM(str(checkpoints["tiny"]), tensor_parallel_size=2, max_num_seqs=2) as llm:
        rank1 = llm.engine.workers.processes[0]
        killer = threading.Timer(1.0, rank1.kill)
        killer.start()
        started = time.monotonic()
        outs = llm.generate(
            [{"prompt_token_ids": [1, 2, 3]}], [SamplingParams(max_tokens=20_000, ignore_eos=True)]
        )
        killer.join()
        assert time.monotonic() - started < 60
    assert outs[0].error is not None and "engine failed" in outs[0].error
    assert 0 < len(outs[0].outputs[0].token_ids) < 20_000


def test_serve_with_two_ranks_answers_and_exits_cleanly() -> None:
    """`deltaserve serve -tp 2`: the engine process starts its rank process (so it is not daemonic),
    answers over HTTP, and SIGTERM stops every process."""
    with running_server("--tensor-parallel-size", "2") as server:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 6
        engine = server.engine_pid()
        ranks = Path(f"/proc/{engine}/task/{engine}/children").read_text().split()
        assert len(ranks) >= 1  # rank 1 (the resource tracker may be a child too)
        assert server.terminate(60) == 0
    for pid in [engine, *map(int, ranks)]:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_a_rank_killed_mid_stream_fails_the_request_and_the_server_exits_nonzero() -> None:
    """Fail-stop as a client sees it: the stream ends with an error event naming the engine failure
    within seconds (gloo reports the dead peer at once), and the server exits non-zero."""
    with running_server("--tensor-parallel-size", "2") as server:
        assert set(rank_pids(server)) == {"dserve-rank1"}  # ps names the rank
        outcome = kill_a_rank_mid_stream(server)
        assert outcome.tokens_before == 3 and outcome.done, outcome
        assert outcome.error is not None and outcome.error["code"] in (500, 503), outcome
        assert outcome.seconds < 30, outcome
        assert server.proc.wait(60) != 0
