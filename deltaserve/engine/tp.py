"""Tensor-parallel backend: rank processes, the start gate, exact-rank replies.

Rank 0 is the EngineCore: it owns the scheduler, the logical page and slot allocation, the LM head and
the sampler. Ranks 1..N-1 are processes that hold a model shard and caches of the same page and slot
counts, and run every forward rank 0 runs, on the same rows (deltaserve.model.layers.parallel says what
is sharded). The forwards meet in their all-reduces, so every rank must run every step, in order:

- start gate: a step is sent to every rank first; only when all have it are they released. A rank that
  cannot take it (its process gone) cancels the step on the ranks that got it, and no rank starts it.
- exact-rank replies: after the step each rank replies once, for that step, naming itself and whether
  it failed; a reply that is missing (bounded wait), late, for another step, from another rank or
  reporting an error poisons the group.
- poison is fail-stop: the first reason is kept, every later step raises it at once, the scheduler's
  fatal path gives every request its one terminal and the rank processes are stopped. Never a hang:
  collectives time out (`DELTASERVE_TP_TIMEOUT_S`, also the reply deadline).

Tensor parallelism runs without prefill overlap. Graphs: with DELTASERVE_TP_GRAPHS=1 on CUDA every rank
captures the decode graphs rank 0 captures, at the same time and in the same bucket order, so the warm-up
forwards' all-reduces meet and each graph holds its NCCL all-reduces; then the prefill graphs
(engine/prefill_graphs.py) the same way: the smallest at start-up, a bucket's first use inside the step
that needs it (on every rank), and rank 0's idle-time captures as steps of their own (`capture_ahead`),
with a bucket that failed on any rank failed on all. A step's rows and rank 0's `logits` flag reach every
rank, so every rank takes the same path (decode graph, prefill graph or eager) and the replays meet in
their all-reduces. Off by default (eager) until shown on two GPUs (tests/gpu/test_tensor_parallel_gpu.py).
With DELTASERVE_TP_ALLREDUCE=peer the sums of up to 4 MiB (decode steps) are one-shot reads of the peers'
symmetric buffers instead of NCCL's ring (model/layers/peer_all_reduce.py); not yet measured on two GPUs.

Decode-ahead runs: a step whose first rows are fed the previous step's tokens on rank 0's device says how
many (`fed_rows`), and rank 0 broadcasts those tokens to every rank before the forward, device to device,
so no rank waits for them on the host; the broadcast is the step's first collective on every rank.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing as mp
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist

from deltaserve.cache.copies import CacheCopy
from deltaserve.cache.device import DeviceCaches
from deltaserve.config import ModelConfig
from deltaserve.engine.cuda_graphs import CudaGraphRunner
from deltaserve.engine.prefill_graphs import PrefillGraphRunner
from deltaserve.engine.rank import agree_on_minimum, build_rank, rank_device, tp_on_one_gpu
from deltaserve.engine.worker import ModelWorker
from deltaserve.engine_config import EngineConfig
from deltaserve.errors import ConfigError
from deltaserve.model.layers.parallel import TensorParallel
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.ops.batch import BatchRow
from deltaserve.process_name import set_process_name
from deltaserve.stack_dumps import dump_stacks_on_sigusr1
from deltaserve.startup_profile import profiled_startup

logger = logging.getLogger(__name__)

TIMEOUT_S = float(os.environ.get("DELTASERVE_TP_TIMEOUT_S", "300"))
GRAPHS = os.environ.get("DELTASERVE_TP_GRAPHS", "0") == "1"  # decode graphs on every rank (module docstring)
# A rank's NCCL watchdog thread queries the events of earlier collectives while the rank captures; in
# the default ("global") mode such a call from another thread invalidates the capture.
CAPTURE_ERROR_MODE = "thread_local"
JOIN_TIMEOUT_S = 30.0
CHANNEL_ERRORS = (OSError, EOFError, ValueError)  # a closed or broken pipe, or a dead peer


class TensorParallelError(RuntimeError):
    """The rank group is poisoned: a rank failed, vanished or replied out of turn."""


def decode_graphs_wanted(config: EngineConfig) -> bool:
    """Whether every rank captures decode graphs (on CUDA): unless --enforce-eager, and over several
    ranks only with DELTASERVE_TP_GRAPHS=1."""
    return not config.enforce_eager and (config.tensor_parallel_size == 1 or GRAPHS)


# ---- messages (rank 0 -> rank r, then rank r -> rank 0) -----------------------------------------


@dataclass(frozen=True, slots=True)
class RankStep:
    step_id: int
    rows: list[BatchRow]
    copies_before: tuple[CacheCopy, ...] = ()  # the prefix cache's device copies, run on every rank
    copies_after: tuple[CacheCopy, ...] = ()
    fed_rows: int = 0  # the first rows' input tokens come from rank 0's broadcast, not from `rows`
    logits: bool = False  # rank 0's: with decode graphs a rank takes rank 0's path (ModelWorker._forward)
    decode_graphs: bool = True  # rank 0's ModelWorker.run argument
    capture_ahead: bool = False  # instead of a forward: the next graph ahead of need (idle time)


@dataclass(frozen=True, slots=True)
class Execute:
    step_id: int


@dataclass(frozen=True, slots=True)
class Cancel:
    step_id: int


@dataclass(frozen=True, slots=True)
class Stop:
    pass


@dataclass(frozen=True, slots=True)
class RankStarted:
    rank: int


@dataclass(frozen=True, slots=True)
class RankReady:
    rank: int
    error: str | None = None  # set: the rank failed to start


@dataclass(frozen=True, slots=True)
class CaptureGraphs:
    """Capture the decode graphs now, as rank 0 does (after every rank reported ready)."""

    max_num_seqs: int
    max_model_len: int


@dataclass(frozen=True, slots=True)
class CapturePrefillGraphs:
    """Build the prefill graph runner and capture its smallest bucket now, as rank 0 does (after the
    decode graphs); the other buckets follow in steps."""

    max_rows: int
    max_tokens: int
    max_model_len: int


@dataclass(frozen=True, slots=True)
class GraphsCaptured:
    rank: int
    error: str | None = None  # set: the capture failed and the rank exits
    kind: str = "decode"  # which graphs: "decode" or "prefill"


@dataclass(frozen=True, slots=True)
class RankReply:
    rank: int
    step_id: int
    error: str | None = None


_Startup = TypeVar("_Startup", RankStarted, RankReady, GraphsCaptured)
_Result = TypeVar("_Result")


class Channel(Protocol):
    """The part of multiprocessing.connection.Connection the gate uses (tests substitute fakes)."""

    def send(self, obj: object) -> None: ...
    def recv(self) -> object: ...
    def poll(self, timeout: float) -> bool: ...


# ---- rank 0's side --------------------------------------------------------------------------------


class RankGroup:
    """Rank 0's command channels to ranks 1..N-1: the start gate and the exact-rank reply check."""

    def __init__(self, channels: Sequence[Channel], timeout_s: float = TIMEOUT_S) -> None:
        self.channels = list(channels)  # channels[i] talks to rank i + 1
        self.timeout_s = timeout_s
        self.poisoned: str | None = None
        self._next_step = 0

    def poison(self, reason: str) -> TensorParallelError:
        if self.poisoned is None:
            self.poisoned = reason
            logger.error("tensor-parallel group poisoned: %s", reason)
        return TensorParallelError(self.poisoned)

    def dispatch(
        self,
        rows: list[BatchRow],
        copies_before: Sequence[CacheCopy] = (),
        copies_after: Sequence[CacheCopy] = (),
        fed_rows: int = 0,
        *,
        logits: bool = False,
        decode_graphs: bool = True,
        capture_ahead: bool = False,
    ) -> int:
        """Start gate: the step reaches every rank before any rank is released into it. Returns its id."""
        if self.poisoned is not None:
            raise TensorParallelError(self.poisoned)
        step_id = self._next_step
        self._next_step += 1
        command = RankStep(
            step_id,
            rows,
            tuple(copies_before),
            tuple(copies_after),
            fed_rows,
            logits,
            decode_graphs,
            capture_ahead,
        )
        for i, channel in enumerate(self.channels):
            try:
                channel.send(command)
            except CHANNEL_ERRORS as exc:
                for got in self.channels[:i]:
                    # a second dead rank changes nothing: the poison below stops the group either way
                    with contextlib.suppress(*CHANNEL_ERRORS):
                        got.send(Cancel(step_id))
                raise self.poison(f"rank {i + 1} could not take step {step_id} ({exc!r}); cancelled") from exc
        for i, channel in enumerate(self.channels):
            try:
                channel.send(Execute(step_id))
            except CHANNEL_ERRORS as exc:
                raise self.poison(
                    f"rank {i + 1} could not be released into step {step_id} ({exc!r})"
                ) from exc
        return step_id

    def collect(self, step_id: int) -> None:
        """Exactly one reply per rank, for `step_id`, from that rank, without error, before the deadline."""
        deadline = time.monotonic() + self.timeout_s
        for i, channel in enumerate(self.channels):
            rank = i + 1
            try:
                if not channel.poll(max(0.0, deadline - time.monotonic())):
                    raise self.poison(
                        f"rank {rank} sent no reply to step {step_id} within {self.timeout_s:.0f} s"
                    )
                reply = channel.recv()
            except CHANNEL_ERRORS as exc:
                raise self.poison(f"rank {rank} is gone ({exc!r}) during step {step_id}") from exc
            if not isinstance(reply, RankReply):
                raise self.poison(
                    f"rank {rank} replied {type(reply).__name__} to step {step_id}, expected RankReply"
                )
            if reply.rank != rank or reply.step_id != step_id:
                raise self.poison(
                    f"rank {rank}'s channel replied as rank {reply.rank} for step {reply.step_id}, "
                    f"expected rank {rank} for step {step_id}"
                )
            if reply.error is not None:
                raise self.poison(f"rank {rank} failed step {step_id}: {reply.error}")


class TensorParallelWorker(ModelWorker):
    """Rank 0's forward path: every forward is first dispatched to the other ranks, run here in step
    with them, then their replies are checked."""

    def __init__(
        self,
        model: Qwen35ForCausalLM,
        caches: DeviceCaches,
        workers: RankWorkers,
        graphs: CudaGraphRunner | None = None,
        prefill_graphs: PrefillGraphRunner | None = None,
    ) -> None:
        super().__init__(model, caches, graphs, prefill_graphs)
        self.workers = workers

    def capture_ahead(self) -> bool:
        """Idle time: every rank captures the same next graph, as a step of the group (the
        captures' warm-up all-reduces meet); nothing is sent once rank 0's list is done."""
        if self.captures_ahead_done:
            return False
        step_id = self.workers.group.dispatch([], capture_ahead=True)
        return self._rank_0s_part(step_id, super().capture_ahead)

    def run(
        self,
        rows: list[BatchRow],
        fed: torch.Tensor | None = None,
        *,
        logits: bool = True,
        copies_before: Sequence[CacheCopy] = (),
        copies_after: Sequence[CacheCopy] = (),
        decode_graphs: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        fed_rows = 0 if fed is None else fed.shape[0]
        step_id = self.workers.group.dispatch(
            rows, copies_before, copies_after, fed_rows, logits=logits, decode_graphs=decode_graphs
        )

        def forward() -> tuple[torch.Tensor | None, torch.Tensor | None]:
            fed_tokens = None if fed is None else fed.to(torch.int64).contiguous()
            if fed_tokens is not None:
                dist.broadcast(fed_tokens, src=0)
            return ModelWorker.run(
                self,
                rows,
                fed_tokens,
                logits=logits,
                copies_before=copies_before,
                copies_after=copies_after,
                decode_graphs=decode_graphs,
            )

        return self._rank_0s_part(step_id, forward)

    def _rank_0s_part(self, step_id: int, work: Callable[[], _Result]) -> _Result:
        """Rank 0's share of a dispatched step: a failure poisons the group; then every rank's reply is
        checked."""
        group = self.workers.group
        try:
            out = work()
        except Exception as exc:
            raise group.poison(f"rank 0 failed step {step_id}: {type(exc).__name__}: {exc}") from exc
        group.collect(step_id)
        return out


# ---- the rank processes ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankSpec:
    config: EngineConfig
    model_dir: str
    model_config: ModelConfig
    tokenizer_vocab: int
    rank: int
    size: int
    init_method: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _capture_failure(done: GraphsCaptured) -> str:
    return f"rank {done.rank} failed to capture its {done.kind} graphs: {done.error}"


def init_process_group(device: torch.device, init_method: str, rank: int, size: int) -> None:
    """Joins the group; on CUDA rank r binds cuda:r first, so NCCL's communicator is built there
    (not on whatever device happens to be current at the first collective). With `tp_on_one_gpu` every
    rank binds the configured GPU and the group runs over gloo."""
    bound = rank_device(device, rank, size)
    if bound.type == "cuda":
        torch.cuda.set_device(bound)
    nccl = bound.type == "cuda" and not tp_on_one_gpu()
    dist.init_process_group(
        "nccl" if nccl else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
        device_id=bound if nccl else None,
    )


class RankWorkers:
    """The processes of ranks 1..N-1 and rank 0's group over them."""

    def __init__(self, processes: list[mp.process.BaseProcess], channels: list[Connection]) -> None:
        self.processes = processes
        self.channels = channels
        self.group = RankGroup(channels)
        self._closed = False

    @classmethod
    def start(
        cls, config: EngineConfig, model_dir: Path, model_config: ModelConfig, tokenizer_vocab: int
    ) -> RankWorkers:
        """Spawns ranks 1..N-1 and joins rank 0 (this process) to their process group."""
        size = config.tensor_parallel_size
        device = config.resolved_device()
        one_gpu = tp_on_one_gpu()
        if device.type == "cuda" and one_gpu and decode_graphs_wanted(config):
            raise ConfigError(
                "DELTASERVE_TP_ONE_GPU=1 joins the ranks over gloo, whose collectives CUDA graphs cannot hold: "
                "add --enforce-eager or unset DELTASERVE_TP_GRAPHS"
            )
        if device.type == "cuda" and not one_gpu and torch.cuda.device_count() < size:
            raise ConfigError(
                f"--tensor-parallel-size {size} needs {size} GPUs, this machine has {torch.cuda.device_count()}"
            )
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        processes, channels = [], []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            spec = RankSpec(config, str(model_dir), model_config, tokenizer_vocab, rank, size, init_method)
            proc = ctx.Process(
                target=run_rank, args=(spec, theirs), name=f"deltaserve-rank{rank}", daemon=True
            )
            proc.start()
            theirs.close()
            processes.append(proc)
            channels.append(ours)
        workers = cls(processes, channels)
        try:
            # A rank that dies before joining (a bad interpreter, an import error) is seen here, not
            # as a rendezvous timeout.
            workers._expect(RankStarted)
            init_process_group(device, init_method, 0, size)
        except BaseException:
            workers.close()
            raise
        return workers

    def wait_ready(self) -> None:
        """Every rank built its shard and caches (their start-up errors surface here, by rank)."""
        for ready in self._expect(RankReady):
            if ready.error is not None:
                raise TensorParallelError(f"rank {ready.rank} failed to start: {ready.error}")

    def start_graph_capture(self, max_num_seqs: int, max_model_len: int) -> None:
        """Every rank starts capturing its decode graphs; rank 0 captures its own meanwhile."""
        self._send_capture(CaptureGraphs(max_num_seqs, max_model_len))

    def start_prefill_graph_capture(self, max_rows: int, max_tokens: int, max_model_len: int) -> None:
        """Every rank builds its prefill graphs and captures the smallest; rank 0 does the same meanwhile."""
        self._send_capture(CapturePrefillGraphs(max_rows, max_tokens, max_model_len))

    def _send_capture(self, command: CaptureGraphs | CapturePrefillGraphs) -> None:
        for i, channel in enumerate(self.channels):
            try:
                channel.send(command)
            except CHANNEL_ERRORS as exc:
                raise TensorParallelError(f"rank {i + 1} could not take the graph capture ({exc!r})") from exc

    def wait_graphs(self) -> None:
        """Every rank captured the graphs it was told to (a failure names its rank)."""
        for done in self._expect(GraphsCaptured):
            if done.error is not None:
                raise TensorParallelError(_capture_failure(done))

    def _expect(self, kind: type[_Startup]) -> list[_Startup]:
        """One `kind` message from every rank, in rank order, before a shared deadline."""
        deadline = time.monotonic() + TIMEOUT_S
        got = []
        for i, channel in enumerate(self.channels):
            rank = i + 1
            try:
                if not channel.poll(max(0.0, deadline - time.monotonic())):
                    raise TensorParallelError(f"rank {rank} sent no {kind.__name__} within {TIMEOUT_S:.0f} s")
                msg = channel.recv()
            except CHANNEL_ERRORS as exc:
                code = self.processes[i].exitcode
                raise TensorParallelError(f"rank {rank} exited during start-up (exit code {code})") from exc
            if not isinstance(msg, kind) or msg.rank != rank:
                raise TensorParallelError(f"rank {rank} sent {msg!r} at start-up, expected {kind.__name__}")
            got.append(msg)
        return got

    def startup_failures(self, wait_s: float = 2.0) -> list[str]:
        """After a failed start (or graph capture): the reasons ranks reported (a rank that fails exits, so
        rank 0 often sees only a transport error in a start-up collective; the rank's own reason is in
        its pipe)."""
        deadline = time.monotonic() + wait_s
        reasons = []
        for i, channel in enumerate(self.channels):
            with contextlib.suppress(*CHANNEL_ERRORS):
                while channel.poll(max(0.0, deadline - time.monotonic())):
                    msg = channel.recv()
                    if isinstance(msg, RankReady) and msg.error is not None:
                        reasons.append(f"rank {i + 1} failed to start: {msg.error}")
                        break
                    if isinstance(msg, GraphsCaptured) and msg.error is not None:
                        reasons.append(_capture_failure(msg))
                        break
        return reasons

    def close(self, join_timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Stop, then bounded joins; a rank that does not exit in time is killed. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for channel in self.channels:
            with contextlib.suppress(*CHANNEL_ERRORS):
                channel.send(Stop())
        deadline = time.monotonic() + join_timeout_s
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                logger.error("rank process %s did not stop in %.0f s; killing it", proc.name, join_timeout_s)
                proc.kill()
                proc.join(5)
        for channel in self.channels:
            channel.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_rank(spec: RankSpec, channel: Connection) -> None:
    """Entry point of rank `spec.rank`: build the shard (collectives in rank 0's order), report ready,
    then run steps until Stop or until rank 0 is gone."""
    logging.basicConfig(
        level=os.environ.get("DELTASERVE_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s rank{spec.rank} %(levelname)s %(message)s",
    )
    set_process_name(f"dserve-rank{spec.rank}")
    dump_stacks_on_sigusr1()
    channel.send(RankStarted(spec.rank))
    try:
        with profiled_startup(f"rank{spec.rank}"):
            init_process_group(spec.config.resolved_device(), spec.init_method, spec.rank, spec.size)
            state = build_rank(
                spec.config,
                Path(spec.model_dir),
                spec.model_config,
                spec.tokenizer_vocab,
                TensorParallel(spec.rank, spec.size),
                decode_graphs=decode_graphs_wanted(spec.config),
            )
    except Exception as exc:
        logger.exception("rank %d failed to start", spec.rank)
        channel.send(RankReady(spec.rank, f"{type(exc).__name__}: {exc}"))
        return
    channel.send(RankReady(spec.rank))
    try:
        _serve_steps(spec.rank, ModelWorker(state.model, state.caches), channel)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def all_ranks_agree(device: torch.device) -> Callable[[bool], bool]:
    """Whether `ok` holds on every rank (one all-reduce; every rank must call it at the same point)."""
    return lambda ok: agree_on_minimum(int(ok), device) == 1


def capture_prefill_graphs(worker: ModelWorker, command: CapturePrefillGraphs) -> PrefillGraphRunner:
    assert worker.graphs is not None, "prefill graphs come after the decode graphs (their memory pool)"
    runner = PrefillGraphRunner(
        worker.model,
        worker.caches,
        command.max_rows,
        command.max_tokens,
        command.max_model_len,
        pool=worker.graphs.pool,
        agree=all_ranks_agree(worker.device),
    )
    seconds = runner.warm()
    logger.info("prefill graphs: the smallest bucket captured in %.1f s", seconds)
    return runner


def capture_decode_graphs(worker: ModelWorker, command: CaptureGraphs) -> CudaGraphRunner:
    graphs = CudaGraphRunner(
        worker.model,
        worker.caches,
        command.max_num_seqs,
        command.max_model_len,
        capture_error_mode=CAPTURE_ERROR_MODE,
        agree=all_ranks_agree(worker.device),
    )
    seconds = graphs.capture()
    logger.info("captured %d decode graphs in %.1f s", len(graphs.graphs), seconds)
    return graphs


@torch.inference_mode()
def _serve_steps(
    rank: int,
    worker: ModelWorker,
    channel: Connection,
    capture: Callable[[ModelWorker, CaptureGraphs], CudaGraphRunner] = capture_decode_graphs,
    capture_prefill: Callable[
        [ModelWorker, CapturePrefillGraphs], PrefillGraphRunner
    ] = capture_prefill_graphs,
) -> None:
    pending: RankStep | None = None
    while True:
        try:
            msg = channel.recv()
        except (EOFError, OSError):
            logger.error("rank 0 is gone; rank %d exits", rank)
            return
        if isinstance(msg, Stop):
            return
        if isinstance(msg, RankStep):
            pending = msg
        elif isinstance(msg, Cancel):
            pending = None
        elif isinstance(msg, (CaptureGraphs, CapturePrefillGraphs)):
            kind = "decode" if isinstance(msg, CaptureGraphs) else "prefill"
            error = None
            try:
                if isinstance(msg, CaptureGraphs):
                    worker.graphs = capture(worker, msg)
                else:
                    worker.prefill_graphs = capture_prefill(worker, msg)
            except Exception as exc:
                logger.exception("rank %d failed to capture its %s graphs", rank, kind)
                error = f"{type(exc).__name__}: {exc}"
            channel.send(GraphsCaptured(rank, error, kind))
            if error is not None:
                return
        elif isinstance(msg, Execute):
            if pending is None or pending.step_id != msg.step_id:
                channel.send(RankReply(rank, msg.step_id, f"released into step {msg.step_id} it never got"))
                return
            error = None
            try:
                _run_step(worker, pending)
            except Exception as exc:
                logger.exception("rank %d failed step %d", rank, msg.step_id)
                error = f"{type(exc).__name__}: {exc}"
            channel.send(RankReply(rank, msg.step_id, error))
            pending = None
            if error is not None:
                return


def _run_step(worker: ModelWorker, step: RankStep) -> None:
    if step.capture_ahead:
        worker.capture_ahead()
        return
    fed = None
    if step.fed_rows:
        fed = torch.empty(step.fed_rows, dtype=torch.int64, device=worker.device)
        dist.broadcast(fed, src=0)
    # Rank 0 alone samples. A rank with graphs takes rank 0's `logits` so that it replays where rank 0
    # replays (decode graphs hold the LM head, a prefill graph's replay is followed by it; its logits
    # are dropped).
    worker.run(
        step.rows,
        fed,
        logits=step.logits and worker.graphs is not None,
        copies_before=step.copies_before,
        copies_after=step.copies_after,
        decode_graphs=step.decode_graphs,
    )
