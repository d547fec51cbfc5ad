"""EngineCore: owns the scheduler and every device tensor.

`EngineCore(config)` validates the flags, loads the model and sizes the caches (failing before serving,
with the numbers and the flag to change); `start(publish)` runs the scheduler loop on its own thread.
The offline LLM runs it in-process; the API server runs it in its own process (engine/process.py).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from deltaserve.cache.device import DeviceCaches
from deltaserve.cache.manager import CacheManager
from deltaserve.cachedir import use_kernel_cache
from deltaserve.config import ModelConfig
from deltaserve.engine import tp
from deltaserve.engine.backend import Backend
from deltaserve.engine.cuda_graphs import CudaGraphRunner
from deltaserve.engine.prefill_graphs import PrefillGraphRunner
from deltaserve.engine.protocol import ClientMessage, Shutdown, StepOutputs
from deltaserve.engine.rank import build_rank, verify_scratch_slots
from deltaserve.engine.scheduler import Scheduler, SchedulerConfig, start_scheduler
from deltaserve.engine.spec_graphs import SpeculativeGraphs
from deltaserve.engine.structured import GrammarBackend, grammar_vocabulary, warm_grammar_masks
from deltaserve.engine.tp import RankWorkers, TensorParallelError, TensorParallelWorker
from deltaserve.engine.worker import ModelWorker
from deltaserve.engine_config import EngineConfig
from deltaserve.errors import ConfigError, EngineStoppedError
from deltaserve.itl_debug import ITL_DEBUG
from deltaserve.model.layers.parallel import TensorParallel
from deltaserve.tiny import default_model_dir
from deltaserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What clients need to know about a started engine."""

    model_dir: str
    max_model_len: int
    vocab_size: int  # the tokenizer's id space
    eos_token_ids: tuple[int, ...]
    kv_pages: int
    page_size: int
    kv_capacity_tokens: int
    max_num_seqs: int
    device: str
    dtype: str


def resolve_model_dir(model: str | None) -> Path:
    if model is None:
        return default_model_dir()
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"--model {model}: not a checkpoint directory (no config.json); model weights are never downloaded"
        )
    return path


class _BackgroundGrammars:
    """`build()` on a daemon thread from construction; `result()` waits for it (re-raising its error).
    Daemonic, so a start-up that fails elsewhere exits without waiting for it."""

    def __init__(self, build: Callable[[], GrammarBackend]) -> None:
        self._value: GrammarBackend | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(build,), name="deltaserve-grammar-build", daemon=True
        )
        self._thread.start()

    def _run(self, build: Callable[[], GrammarBackend]) -> None:
        try:
            self._value = build()
        except BaseException as exc:
            self._error = exc

    def result(self) -> GrammarBackend:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        logger.info("kernel cache: %s", use_kernel_cache())
        self.model_dir = resolve_model_dir(config.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        if config.mamba_ssm_cache_dtype not in ("auto", self.model_config.ssm_state_dtype):
            logger.warning(
                "SSM state in %s instead of the checkpoint's %s (--mamba-ssm-cache-dtype): less state memory, "
                "lower accuracy",
                config.mamba_ssm_cache_dtype,
                self.model_config.ssm_state_dtype,
            )
            self.model_config = dataclasses.replace(
                self.model_config, ssm_state_dtype=config.mamba_ssm_cache_dtype
            )
        loading = time.monotonic()
        tokenizer = Tokenizer.from_dir(self.model_dir)
        self.tokenizer_vocab = tokenizer.vocab_size
        logger.info("tokenizer loaded in %.1f s (%d ids)", time.monotonic() - loading, self.tokenizer_vocab)
        # The grammar compiler (seconds of CPU) builds while the model loads, warms up and captures its
        # graphs, which mostly wait on the GPU; start() waits for it.
        self._grammars = _BackgroundGrammars(
            lambda: GrammarBackend(lambda: grammar_vocabulary(tokenizer), self.model_config.eos_token_ids)
        )
        self.workers: RankWorkers | None = None
        if config.tensor_parallel_size > 1:
            self.model_config.shard(config.tensor_parallel_size)  # divisibility, before any process starts
            self.workers = RankWorkers.start(config, self.model_dir, self.model_config, self.tokenizer_vocab)
        try:
            rank = build_rank(
                config,
                self.model_dir,
                self.model_config,
                self.tokenizer_vocab,
                TensorParallel(0, config.tensor_parallel_size),
                decode_graphs=tp.decode_graphs_wanted(config),
            )
            if self.workers is not None:
                self.workers.wait_ready()
        except BaseException as exc:
            self._fail_startup(exc)
            raise
        self.model, caches, device, dtype = rank.model, rank.caches, rank.device, rank.dtype
        config = self.config = rank.config  # max_num_seqs resolved
        self.cache = CacheManager.for_device(caches, scratch_slots=verify_scratch_slots(config))
        capacity_tokens = self.cache.kv.capacity * config.page_size
        max_model_len = self._resolve_max_model_len(capacity_tokens)
        graphs = None
        if device.type == "cuda" and tp.decode_graphs_wanted(config):
            graphs = self._capture_decode_graphs(caches, max_model_len)
        elif self.workers is not None:
            logger.info(
                "tensor parallel over %d ranks: eager (no decode graphs; DELTASERVE_TP_GRAPHS=1 on CUDA captures them)",
                config.tensor_parallel_size,
            )
        spec_graphs = None
        spec = config.speculative_config
        if graphs is not None and spec is not None:  # never with tensor parallelism (EngineConfig)
            spec_graphs = SpeculativeGraphs(
                self.model,
                caches,
                min(spec.max_batch, config.num_seqs),
                spec.num_speculative_tokens,
                max_model_len,
            )
            seconds = spec_graphs.capture()
            logger.info(
                "captured speculative graphs (verify, MTP and draft steps; batch buckets up to %d, 1..%d drafts) "
                "in %.1f s",
                spec_graphs.max_rows,
                spec.num_speculative_tokens,
                seconds,
            )
        prefill_graphs = None
        if graphs is not None and config.prefill_graph_tokens > 0:
            prefill_graphs = self._warm_prefill_graphs(caches, graphs, max_model_len)
        self.backend = (
            Backend(
                self.model,
                caches,
                worker=ModelWorker(self.model, caches, graphs, prefill_graphs),
                spec_graphs=spec_graphs,
                overlap=config.prefill_overlap,
                time_steps=ITL_DEBUG,
            )
            if self.workers is None
            else Backend(
                self.model,
                caches,
                worker=TensorParallelWorker(self.model, caches, self.workers, graphs, prefill_graphs),
                time_steps=ITL_DEBUG,
            )
        )
        self.scheduler_config = SchedulerConfig(
            max_model_len=max_model_len,
            max_num_seqs=config.num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_batched_tokens_saturated=config.saturated_step_tokens,
            vocab_size=self.tokenizer_vocab,
            eos_token_ids=self.model_config.eos_token_ids,
            policy=config.scheduler_policy,
            prefill_overlap=config.prefill_overlap,
            decode_latency_budget_ms=config.decode_latency_budget_ms,
            kv_reserve_tokens=config.kv_reserve_tokens,
            decode_ahead=config.decode_ahead,
            speculative=config.speculative_config,
        )
        self.info = EngineInfo(
            model_dir=str(self.model_dir),
            max_model_len=max_model_len,
            vocab_size=self.tokenizer_vocab,
            eos_token_ids=self.model_config.eos_token_ids,
            kv_pages=self.cache.kv.capacity,
            page_size=config.page_size,
            kv_capacity_tokens=capacity_tokens,
            max_num_seqs=config.num_seqs,
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
        )
        logger.info(
            "KV cache: %d pages x %d tokens = %d tokens (only the %d full-attention layers of %d hold KV); "
            "state slots for %d sequences; max_model_len %d; at most %d requests of max_model_len tokens at once",
            self.cache.kv.capacity,
            config.page_size,
            capacity_tokens,
            len(self.model_config.full_attention_layers),
            self.model_config.num_hidden_layers,
            config.num_seqs,
            max_model_len,
            min(config.num_seqs, capacity_tokens // max_model_len),
        )
        self.scheduler: Scheduler | None = None
        self.thread: threading.Thread | None = None
        self.stopped: str | None = None  # shutdown()'s reason, once it is called

    def _capture_decode_graphs(self, caches: DeviceCaches, max_model_len: int) -> CudaGraphRunner:
        """Rank 0's decode graphs. With tensor parallelism every rank captures its own meanwhile, in
        the same bucket order, so the warm-up forwards' all-reduces meet; a rank that fails names itself."""
        config = self.config
        workers = self.workers
        mode = "global" if workers is None else tp.CAPTURE_ERROR_MODE
        reserved = torch.cuda.memory_reserved(self.model.device)
        graphs = CudaGraphRunner(
            self.model,
            caches,
            config.num_seqs,
            max_model_len,
            capture_error_mode=mode,
            agree=None if workers is None else tp.all_ranks_agree(self.model.device),
        )
        seconds = self._capture_on_every_rank(
            graphs.capture, lambda ranks: ranks.start_graph_capture(config.num_seqs, max_model_len)
        )
        later = len(graphs.buckets) - len(graphs.graphs)
        logger.info(
            "captured %d decode graphs (batch buckets up to %d) in %.1f s, %.2f GiB of device memory%s%s",
            len(graphs.graphs),
            max(graphs.graphs, default=0),
            seconds,
            (torch.cuda.memory_reserved(self.model.device) - reserved) / 2**30,
            self._on_each_rank(),
            f"; the {later} larger buckets up to {config.num_seqs} are captured while idle or on first use"
            if later
            else "",
        )
        return graphs

    def _warm_prefill_graphs(
        self, caches: DeviceCaches, graphs: CudaGraphRunner, max_model_len: int
    ) -> PrefillGraphRunner:
        """Rank 0's prefill graphs, the smallest bucket captured. With tensor parallelism every rank builds
        its own and captures the same bucket meanwhile (engine/tp.py); a rank that fails names itself."""
        config, workers = self.config, self.workers
        runner = PrefillGraphRunner(
            self.model,
            caches,
            config.num_seqs,
            config.prefill_graph_tokens,
            max_model_len,
            # An overlapped prefill replays beside the decode graphs: it must not share their pool.
            pool=None if config.prefill_overlap else graphs.pool,
            every_token=config.speculative_config is not None,
            agree=None if workers is None else tp.all_ranks_agree(self.model.device),
        )
        seconds = self._capture_on_every_rank(
            runner.warm,
            lambda ranks: ranks.start_prefill_graph_capture(
                config.num_seqs, config.prefill_graph_tokens, max_model_len
            ),
        )
        logger.info(
            "prefill graphs: steps of up to %d tokens in up to %d rows, captured per bucket while idle "
            "(the likely ones) or on first use (the smallest at start-up: %.1f s)%s",
            config.prefill_graph_tokens,
            config.num_seqs,
            seconds,
            self._on_each_rank(),
        )
        return runner

    def _capture_on_every_rank(
        self, capture_here: Callable[[], float], tell_ranks: Callable[[RankWorkers], None]
    ) -> float:
        """A start-up capture here, with every rank told first to run its own meanwhile (their warm-up
        all-reduces meet); a failure anywhere stops the ranks and names the rank. The seconds it took."""
        workers = self.workers
        if workers is not None:
            tell_ranks(workers)
        try:
            seconds = capture_here()
            if workers is not None:
                workers.wait_graphs()
        except BaseException as exc:
            self._fail_startup(exc)
            raise
        return seconds

    def _on_each_rank(self) -> str:
        return "" if self.workers is None else f" on each of {self.config.tensor_parallel_size} ranks"

    def _fail_startup(self, exc: BaseException) -> None:
        """After a failed start-up step: the rank processes are stopped, and the reasons ranks reported
        (rank 0 often sees only a transport error in a collective) replace `exc` where there are any."""
        if self.workers is None:
            return
        reasons = self.workers.startup_failures()
        self.workers.close(join_timeout_s=5.0)  # ranks still in a start-up collective never stop
        if reasons:
            raise TensorParallelError("; ".join(reasons)) from exc

    def _resolve_max_model_len(self, capacity_tokens: int) -> int:
        limit = self.model_config.max_position_embeddings
        asked = self.config.max_model_len
        if asked is None:
            return min(limit, capacity_tokens)
        if asked > limit:
            raise ConfigError(
                f"--max-model-len {asked} exceeds the model's max_position_embeddings ({limit})"
            )
        if asked > capacity_tokens:
            raise ConfigError(
                f"--max-model-len {asked} exceeds the KV cache capacity of {capacity_tokens} tokens; "
                "lower --max-model-len or give the KV cache more memory"
            )
        return asked

    def wait_for_startup_work(self) -> None:
        """Blocks until the start-up's background work (the grammar compiler) is done, for a caller
        that runs the model itself and never starts the scheduler; start() waits for it too."""
        self._grammars.result()

    def start(self, publish: Callable[[StepOutputs], None]) -> None:
        grammars = self._grammars.result()
        warm_grammar_masks(grammars, self.model.logits_vocab_size, self.model.device)
        self.scheduler, self.thread = start_scheduler(
            self.scheduler_config, self.backend, publish, grammars, self.cache
        )

    def wait_for_captures_ahead(self, timeout_s: float) -> bool:
        """Blocks until the started scheduler's idle ticks have no graph capture left (at once
        without graphs to capture); False if `timeout_s` passed first."""
        assert self.scheduler is not None, "start() the engine first"
        return self.scheduler.captures_ahead_done.wait(timeout_s)

    def submit(self, msg: ClientMessage) -> None:
        assert self.scheduler is not None, "start() the engine first"
        if self.stopped is not None:
            raise EngineStoppedError(
                f"the engine has shut down ({self.stopped}); start a new one to submit work"
            )
        self.scheduler.submit(msg)

    def shutdown(self, reason: str = "engine shutdown", timeout: float = 30.0) -> None:
        """Stops the scheduler (the requests in flight end with `reason`) and the rank processes; submit()
        raises EngineStoppedError after it."""
        if self.stopped is None:
            self.stopped = reason
        if self.scheduler is not None and self.thread is not None:
            self.scheduler.submit(Shutdown(reason))
            self.thread.join(timeout)
        self.close()

    def close(self) -> None:
        """Stops the tensor-parallel rank processes (bounded waits); idempotent."""
        if self.workers is not None:
            self.workers.close()
