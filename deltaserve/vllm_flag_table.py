"""The `vllm serve` flags that need no code of their own here, as three tables: flags that configure
nothing in deltaserve (accepted, and logged once with what deltaserve does instead), flags accepted
only with the values deltaserve already behaves as, and flags for features deltaserve does not have
(refused whenever given). Each refusal is one line naming the flag, what is supported and the value."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from typing import Any

from deltaserve.errors import ConfigError

logger = logging.getLogger("deltaserve.server")


@dataclass(frozen=True, slots=True)
class Flag:
    names: tuple[str, ...]  # spellings; the first is the one messages use
    why: str  # what deltaserve does instead (accepted flags) or lacks (refused ones)
    kwargs: dict[str, Any] = field(default_factory=dict)  # argparse: type, nargs, action
    allowed: tuple[str, ...] = ()  # ONE_OF: the values accepted

    @property
    def dest(self) -> str:
        return self.names[0].lstrip("-").replace("-", "_")


_TRUE = {"action": "store_true"}
_INT = {"type": int}
_GRAPHS = "decode steps replay CUDA graphs captured for every batch size up to --max-num-seqs (--enforce-eager: none)"
_SCHEDULING = "prompt chunks are scheduled by the step budget (--max-num-batched-tokens, --scheduler-policy)"
_LOCAL = "the model is a local directory: nothing is downloaded"

# Accepted with any value; they configure nothing here.
IGNORED = (
    Flag(
        ("--swap-space",), "preempted requests are recomputed, never swapped to host memory", {"type": float}
    ),
    Flag(("--cpu-offload-gb",), "weights stay on the GPU", {"type": float}),
    Flag(("--max-parallel-loading-workers",), "checkpoint tensors load one at a time", _INT),
    Flag(("--revision",), _LOCAL),
    Flag(("--code-revision",), _LOCAL),
    Flag(("--tokenizer-revision",), _LOCAL),
    Flag(("--download-dir",), _LOCAL),
    Flag(("--max-log-len",), "request logs carry no prompt text", _INT),
    Flag(("--enable-log-outputs",), "request logs carry no output text", _TRUE),
    Flag(("--attention-backend",), "deltaserve runs its own attention kernels"),
    Flag(("--compilation-config", "-O"), "no torch.compile: " + _GRAPHS),
    Flag(("--max-cudagraph-capture-size",), _GRAPHS, _INT),
    Flag(("--cuda-graph-sizes",), _GRAPHS, {"nargs": "+", "type": int}),
    Flag(("--max-seq-len-to-capture",), _GRAPHS, _INT),
    Flag(("--max-num-partial-prefills",), _SCHEDULING, _INT),
    Flag(("--max-long-partial-prefills",), _SCHEDULING, _INT),
    Flag(("--long-prefill-token-threshold",), _SCHEDULING, _INT),
    Flag(
        ("--enable-expert-parallel",),
        "experts are sharded by their columns under --tensor-parallel-size",
        _TRUE,
    ),
    Flag(("--disable-custom-all-reduce",), "all-reduces run through torch.distributed", _TRUE),
    Flag(("--calculate-kv-scales",), "the KV cache is kept in the model dtype", _TRUE),
    Flag(
        ("--enable-prompt-tokens-details",), "usage always carries prompt_tokens_details.cached_tokens", _TRUE
    ),
)

# Accepted only with the values deltaserve behaves as.
ONE_OF = (
    Flag(("--data-parallel-size", "-dp"), "one engine per server", _INT, allowed=("1",)),
    Flag(("--pipeline-parallel-size", "-pp"), "use --tensor-parallel-size", _INT, allowed=("1",)),
    Flag(("--distributed-executor-backend",), "deltaserve spawns its rank processes", allowed=("mp", "uni")),
    Flag(("--tokenizer-mode",), "the checkpoint's tokenizer.json", allowed=("auto", "hf")),
    Flag(("--config-format",), "the checkpoint's config.json", allowed=("auto", "hf")),
    Flag(("--model-impl",), "deltaserve's own Qwen3.5 implementation", allowed=("auto", "vllm")),
    Flag(("--response-role",), "chat replies come from the assistant", allowed=("assistant",)),
    Flag(
        ("--scheduling-policy",),
        "requests are admitted in arrival order (deltaserve's --scheduler-policy fcfs | auto)",
        allowed=("fcfs",),
    ),
    Flag(
        ("--chat-template-content-format",),
        "message content is taken as a string or as a list of text parts",
        allowed=("auto", "string", "openai"),
    ),
    Flag(("--guided-decoding-backend",), "structured output runs on xgrammar", allowed=("auto", "xgrammar")),
    Flag(
        ("--performance-mode",),
        "one configuration serves both: the step budget bounds decode latency under load",
        allowed=("balanced", "throughput", "interactivity"),
    ),
)

# Features deltaserve does not have: refused whenever given.
UNSUPPORTED = (
    Flag(("--enable-lora",), "no LoRA adapters, the checkpoint's own weights are served", _TRUE),
    Flag(("--lora-modules",), "no LoRA adapters, the checkpoint's own weights are served", {"nargs": "+"}),
    Flag(("--enable-sleep-mode",), "no sleep mode (/sleep, /wake_up)", _TRUE),
    Flag(("--kv-transfer-config",), "no disaggregated prefill (KV transfer)"),
    Flag(("--middleware",), "deltaserve loads no code into its server", {"action": "append"}),
)


def add_table_arguments(group: argparse._ArgumentGroup) -> None:
    for flag in IGNORED:
        group.add_argument(
            *flag.names, dest=flag.dest, default=None, help=f"ignored: {flag.why}", **flag.kwargs
        )
    for flag in ONE_OF:
        group.add_argument(
            *flag.names,
            dest=flag.dest,
            default=None,
            help=f"{' | '.join(flag.allowed)} only: {flag.why}",
            **flag.kwargs,
        )
    for flag in UNSUPPORTED:
        group.add_argument(
            *flag.names, dest=flag.dest, default=None, help=f"refused: {flag.why}", **flag.kwargs
        )


def _given(value: Any) -> bool:
    return value is not None and value is not False


def check_table_arguments(args: argparse.Namespace) -> None:
    """Raises ConfigError for an unsupported flag or a value deltaserve does not behave as; logs what
    each accepted, ignored flag would have configured."""
    for flag in UNSUPPORTED:
        if _given(getattr(args, flag.dest)):
            raise ConfigError(f"{flag.names[0]} is not supported: {flag.why}")
    for flag in ONE_OF:
        value = getattr(args, flag.dest)
        if value is not None and str(value) not in flag.allowed:
            raise ConfigError(
                f"{flag.names[0]} must be {' or '.join(repr(a) for a in flag.allowed)} ({flag.why}), got {value!r}"
            )
    for flag in IGNORED:
        if _given(getattr(args, flag.dest)):
            logger.info("%s: accepted, configures nothing here: %s", flag.names[0], flag.why)
