"""Engine configuration (the flags, with vLLM's names) and `--speculative-config`, validated up front:
every error names the flag, the expected and the found value, before anything is loaded."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deltaserve.config import DTYPE_ALIASES, DTYPES, parse_dtype, torch_dtype
from deltaserve.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where a dtype or device is resolved: the server's CLI starts fast
    import torch


def parse_json_object(flag: str, value: str | dict[str, Any]) -> dict[str, Any]:
    """A flag's JSON object (an offline caller's dict passes as it is); ConfigError names the flag."""
    if isinstance(value, dict):
        return value
    try:
        data = json.loads(value)
    except json.JSONDecodeError as exc:
        hint = ""
        if value.lstrip().startswith("{") and '"' not in value and ":" in value:
            # `{"a":1}` unquoted by a shell (or by a second shlex pass) arrives as `{a:1}`
            hint = "; its keys lost their double quotes: single-quote the whole object for the shell"
        raise ConfigError(f"{flag} must be a JSON object, got {value!r} ({exc.msg}{hint})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{flag} must be a JSON object, got {value!r}")
    return data


LOAD_FORMATS = ("auto", "safetensors", "dummy")


SCHEDULER_POLICIES = ("fcfs", "auto")


def policy_error(policy: str, prefill_overlap: bool) -> str | None:
    """Why a scheduling policy / flag combination is refused at start, or None when it is valid."""
    if policy not in SCHEDULER_POLICIES:
        return f"--scheduler-policy must be one of {list(SCHEDULER_POLICIES)}, got {policy!r}"
    if policy == "auto" and prefill_overlap:
        return (
            "--scheduler-policy auto cannot be combined with --prefill-overlap: the overlap path already keeps "
            "decode running while a prefill is in flight; choose one"
        )
    return None


SPECULATIVE_METHODS = ("mtp",)
# Benchmark-only draft sources (engine/scheduler/benchmark_drafts.py): "record" a greedy speculative
# run; then the MTP head still runs (its cost is measured) but its proposals are replaced by the
# recording's next tokens ("replay": every proposal right) or by tokens that differ from them ("wrong":
# every proposal rejected). "accept" needs no recording: every proposal is accepted as if it were
# right (the output is the proposals', not the model's). Never for serving.
BENCHMARK_DRAFTS = ("record", "replay", "wrong", "accept")
FORCED_BENCHMARK_DRAFTS = ("accept",)  # draft sources without a recording
MAX_SPECULATIVE_TOKENS = 4


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """`--speculative-config` (vLLM's JSON): draft with the checkpoint's MTP head, verify
    num_speculative_tokens + 1 positions per decode row in one target forward.

    adaptive: the guard may lower the draft length (to 0) when the batch is large or the measured
    acceptance is low; False pins it at num_speculative_tokens. max_batch: the most decode rows a step
    speculates for (the verify scratch states are sized for it); larger batches decode plainly.
    draft_vocab_size: the MTP head proposes only among the first N token ids (a BPE vocabulary lists
    its most frequent merges first), reading N rows of the LM head per draft instead of all of them;
    verification still takes the full vocabulary, so outputs are unchanged, only acceptance may drop."""

    method: str = "mtp"
    num_speculative_tokens: int = 1
    adaptive: bool = True
    max_batch: int = 32
    benchmark_draft: str | None = None
    benchmark_draft_file: str | None = None
    draft_vocab_size: int | None = None

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> SpeculativeConfig:
        where = "--speculative-config"
        data = parse_json_object(where, text)
        known = {"method", "num_speculative_tokens", "adaptive", "max_batch"}
        known |= {"benchmark_draft", "benchmark_draft_file", "model", "draft_vocab_size"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")
        method = data.get("method", "mtp")
        if method not in SPECULATIVE_METHODS:
            raise ConfigError(f"{where}: 'method' must be one of {list(SPECULATIVE_METHODS)}, got {method!r}")
        if data.get("model") is not None:
            raise ConfigError(
                f"{where}: 'model' must be absent or null (method 'mtp' drafts with the checkpoint's own "
                f"MTP head), got {data['model']!r}"
            )
        k = data.get("num_speculative_tokens", 1)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"{where}: 'num_speculative_tokens' must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}"
            )
        adaptive = data.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ConfigError(f"{where}: 'adaptive' must be true or false, got {adaptive!r}")
        max_batch = data.get("max_batch", 32)
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ConfigError(f"{where}: 'max_batch' must be an integer >= 1, got {max_batch!r}")
        draft, draft_file = data.get("benchmark_draft"), data.get("benchmark_draft_file")
        if draft is not None and draft not in BENCHMARK_DRAFTS:
            raise ConfigError(
                f"{where}: 'benchmark_draft' must be absent or one of {list(BENCHMARK_DRAFTS)}, got {draft!r}"
            )
        needs_file = draft is not None and draft not in FORCED_BENCHMARK_DRAFTS
        if needs_file != (draft_file is not None):
            raise ConfigError(
                f"{where}: 'benchmark_draft_file' (a recorded greedy run) goes with 'benchmark_draft' "
                f"{[d for d in BENCHMARK_DRAFTS if d not in FORCED_BENCHMARK_DRAFTS]} and only with them, "
                f"got {draft!r} and {draft_file!r}"
            )
        vocab = data.get("draft_vocab_size")
        if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1):
            raise ConfigError(f"{where}: 'draft_vocab_size' must be absent or an integer >= 1, got {vocab!r}")
        return cls(method, k, adaptive, max_batch, draft, draft_file, vocab)


# Steps of up to this many tokens replay prefill graphs by default. It covers the default saturated step
# (below): eager launching costs a 2,048-token 4B forward 50 ms against 34 ms of GPU time, and the 35B-A3B's
# MoE layers launch slower still (an eager 8,192-token step: 131 ms of launching), so the steps that
# carry a saturated server must replay.
DEFAULT_PREFILL_GRAPH_TOKENS = 4608

# --max-num-seqs by default: the first of AUTO_MAX_NUM_SEQS whose state slots take at most
# AUTO_SEQS_STATE_SHARE of the memory left for caches after the weights and the prefix cache's snapshot
# pool (on an H200: 512 for the 4B, 9B and 35B-A3B shapes, 256 for the 27B shape), the last when none
# does: a smaller GPU starts with fewer slots instead of failing for want of KV pages. The CPU takes
# CPU_MAX_NUM_SEQS. A saturated server decodes as many sequences as it has slots, and each step then
# carries as many prompt tokens as the finished sequences free: more slots make larger steps, which the
# MoE's expert weights need (the 35B-A3B saturated cell on an H200: 39.4k total tok/s with these defaults
# against 34.7k with 256 sequences and 2,048-token steps; the dense 9B: 32.6k against 31.6k;
# docs/benchmarks/2026-12-04-h200-saturated-defaults.md).
AUTO_MAX_NUM_SEQS = (512, 256, 128, 64, 32, 16)
AUTO_SEQS_STATE_SHARE = 2 / 3
CPU_MAX_NUM_SEQS = 256
# The default saturated step: a decode row for every sequence beside this many prompt tokens, or twice
# --max-num-batched-tokens where that is less (a budget lowered for latency stays near its scale).
SATURATED_PREFILL_TOKENS = 4096

# Admission keeps the KV pages of every admitted request's next this many tokens (capped at its max_tokens),
# so that under KV pressure requests finish within the reserve instead of being preempted and recomputed
# (a preempted request's stream pauses for its wait and its prefill again: seconds at saturation).
DEFAULT_KV_RESERVE_TOKENS = 256


@dataclass(slots=True)
class EngineConfig:
    """Engine flags, with vLLM's names. `validate()` runs before the model loads."""

    model: str | None = None
    dtype: str = "auto"  # auto = bfloat16 on GPU, float32 on CPU
    device: str = "auto"  # auto = cuda when available
    load_format: str = "auto"
    seed: int = 0
    max_model_len: int | None = None  # None = the checkpoint's max_position_embeddings
    max_num_seqs: int | None = None  # None: from memory (AUTO_MAX_NUM_SEQS), resolved by build_rank
    max_num_batched_tokens: int = 2048
    # The step budget while the server is saturated (plan.is_saturated: requests wait for admission, or
    # more than an eighth of max_num_seqs, and more than 8, wait for their prefill, then until 8 or fewer
    # do; every queued request's first token depends on prefill throughput, and larger steps carry more
    # prompt tokens per pass over the weights); None: a decode row per sequence beside
    # min(SATURATED_PREFILL_TOKENS, 2 x max_num_batched_tokens) prompt tokens; 0: max_num_batched_tokens
    # always.
    max_num_batched_tokens_saturated: int | None = None
    page_size: int = 16
    num_kv_pages: int | None = None  # None = sized from memory
    kv_cache_memory_gb: float | None = None  # CPU: KV budget; GPU: see gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    scheduler_policy: str = "fcfs"
    prefill_overlap: bool = False
    # While requests decode, a step's prefill is sized from measured step times so the step takes about
    # this long (at least a quarter of max_num_batched_tokens still prefills); 0: off.
    decode_latency_budget_ms: float = 0.0
    kv_reserve_tokens: int = DEFAULT_KV_RESERVE_TOKENS  # 1: optimistic admission (growth met by preemption)
    decode_ahead: bool = (
        True  # launch step N+1 (decode rows and chunks) before step N's tokens reach the host
    )
    # SSM state dtype: auto = the checkpoint's mamba_ssm_dtype (float32 for Qwen3.5). A 16-bit state halves
    # the state memory but costs accuracy (docs/benchmarks/2026-11-30-ssm-state-bf16-accuracy.md): opt-in.
    mamba_ssm_cache_dtype: str = "auto"
    enforce_eager: bool = False
    # Steps with prompt chunks of up to this many tokens replay CUDA graphs captured while idle or on first use
    # (engine/prefill_graphs.py); None: min(max_num_batched_tokens, 2048); 0: off.
    prefill_graph_max_tokens: int | None = None
    # Ranks 1..N-1 run in their own processes (engine/tp.py); eager, without prefill overlap.
    tensor_parallel_size: int = 1
    # Prefix cache (on by default, as in vLLM): shared KV pages + GDN state snapshots in a pool of this
    # many GiB (None: 8% of the GPU's memory, at most a quarter of what the weights leave; 0.25 GiB
    # on CPU).
    enable_prefix_caching: bool = True
    prefix_cache_state_memory_gb: float | None = None
    # Speculative decoding with the checkpoint's MTP head (None: off).
    speculative_config: SpeculativeConfig | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, (str, dict)):  # LLM(speculative_config={...})
            self.speculative_config = SpeculativeConfig.from_json(self.speculative_config)
        if isinstance(self.dtype, str):
            self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if isinstance(self.mamba_ssm_cache_dtype, str):
            self.mamba_ssm_cache_dtype = DTYPE_ALIASES.get(
                self.mamba_ssm_cache_dtype, self.mamba_ssm_cache_dtype
            )

    @property
    def num_seqs(self) -> int:
        """max_num_seqs once resolved (build_rank resolves the default from memory)."""
        if self.max_num_seqs is None:
            raise RuntimeError("max_num_seqs is resolved from memory by build_rank before it is read")
        return self.max_num_seqs

    @property
    def saturated_step_tokens(self) -> int:
        """The step budget while saturated; 0: off (never above max_num_batched_tokens)."""
        tokens = self.max_num_batched_tokens_saturated
        if tokens is None:
            tokens = self.num_seqs + min(SATURATED_PREFILL_TOKENS, 2 * self.max_num_batched_tokens)
        return tokens if tokens > self.max_num_batched_tokens else 0

    @property
    def largest_step_tokens(self) -> int:
        """The most tokens one step may hold: what warm-up measures activations at."""
        return max(self.max_num_batched_tokens, self.saturated_step_tokens)

    @property
    def prefill_graph_tokens(self) -> int:
        """The largest step (in tokens) a prefill graph is captured for; 0: none."""
        if self.prefill_graph_max_tokens is not None:
            return min(self.prefill_graph_max_tokens, self.largest_step_tokens)
        return min(self.largest_step_tokens, DEFAULT_PREFILL_GRAPH_TOKENS)

    def validate(self) -> None:
        def fail(flag: str, expected: str, found: Any) -> ConfigError:
            return ConfigError(f"--{flag.replace('_', '-')} must be {expected}, got {found!r}")

        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise fail("dtype", f"one of {['auto', *sorted(DTYPES), *sorted(DTYPE_ALIASES)]}", self.dtype)
        if self.mamba_ssm_cache_dtype != "auto":
            parse_dtype(self.mamba_ssm_cache_dtype, what="--mamba-ssm-cache-dtype")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise fail("device", "'auto', 'cpu', 'cuda' or 'cuda:N'", self.device)
        if self.load_format not in LOAD_FORMATS:
            raise fail("load_format", f"one of {list(LOAD_FORMATS)}", self.load_format)
        policy = policy_error(self.scheduler_policy, self.prefill_overlap)
        if policy is not None:
            raise ConfigError(policy)
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "page_size",
            "tensor_parallel_size",
            "kv_reserve_tokens",
        ):
            value = getattr(self, name)
            if name == "max_num_seqs" and value is None:
                continue  # resolved from memory
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise fail(name, "an integer >= 1", value)
        saturated = self.max_num_batched_tokens_saturated
        if saturated is not None and (
            isinstance(saturated, bool) or not isinstance(saturated, int) or saturated < 0
        ):
            raise fail("max_num_batched_tokens_saturated", "an integer >= 0 (0: off)", saturated)
        if saturated is not None and 0 < saturated < self.max_num_batched_tokens:
            raise fail(
                "max_num_batched_tokens_saturated",
                f"0 (off) or at least --max-num-batched-tokens ({self.max_num_batched_tokens})",
                saturated,
            )
        graph_tokens = self.prefill_graph_max_tokens
        if graph_tokens is not None and (
            isinstance(graph_tokens, bool) or not isinstance(graph_tokens, int) or graph_tokens < 0
        ):
            raise fail("prefill_graph_max_tokens", "an integer >= 0 (0: off)", graph_tokens)
        if self.page_size & (self.page_size - 1):
            raise fail("page_size", "a power of two", self.page_size)
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 1
        ):
            raise fail("max_model_len", "an integer >= 1", self.max_model_len)
        budget = self.decode_latency_budget_ms
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget >= 0:
            raise fail("decode_latency_budget_ms", "a number of milliseconds >= 0 (0: off)", budget)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise fail("gpu_memory_utilization", "in (0, 1]", self.gpu_memory_utilization)
        if self.tensor_parallel_size > 1:
            if self.prefill_overlap:
                raise ConfigError(
                    f"--prefill-overlap is not supported with --tensor-parallel-size {self.tensor_parallel_size}"
                )
            if self.device.startswith("cuda:"):
                raise ConfigError(
                    f"--device {self.device}: with --tensor-parallel-size {self.tensor_parallel_size}, "
                    "rank r runs on cuda:r; give --device cuda or auto"
                )
        if self.prefix_cache_state_memory_gb is not None and not self.prefix_cache_state_memory_gb > 0:
            raise fail(
                "prefix_cache_state_memory_gb", "a number of GiB > 0", self.prefix_cache_state_memory_gb
            )
        if self.speculative_config is not None and self.tensor_parallel_size > 1:
            raise ConfigError(
                f"--speculative-config is not supported with --tensor-parallel-size {self.tensor_parallel_size} "
                "yet; serve speculative decoding on one GPU"
            )
        if self.speculative_config is not None and self.prefill_overlap:
            raise ConfigError(
                "--speculative-config cannot be combined with --prefill-overlap: an async prefill runs no "
                "MTP pass, so a request prefilled beside decoders could never draft; drop one of the two"
            )
        if self.num_kv_pages is not None and self.num_kv_pages < 2:
            raise fail("num_kv_pages", "an integer >= 2 (one page is reserved)", self.num_kv_pages)

    def resolved_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"--device {self.device} was asked for, but CUDA is not available here")
        return device

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch_dtype("bfloat16" if device.type == "cuda" else "float32")
        return torch_dtype(self.dtype)
