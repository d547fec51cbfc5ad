"""`vllm serve` flags that configure nothing here, so that a copied vLLM command line starts or fails
with one sentence.

Accepted: flags that ask for what deltaserve always does (auto tool choice, the Qwen XML tool-call and
`<think>` reasoning parsers, chunked prefill, a text-only model) or that have nothing to act on
(`--trust-remote-code`: no checkpoint code is ever run). Refused, naming what is supported: features
the engine does not have (an fp8 KV cache, online or non-FP8 quantization, images). `--quantization`
naming the checkpoint's own FP8 format (`fp8`, `compressed-tensors`) is accepted: it loads dequantized.
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from deltaserve.errors import ConfigError

logger = logging.getLogger("deltaserve.server")

# Every name of the Qwen XML call format (`<tool_call><function=NAME><parameter=KEY>`), which the
# server always parses; vLLM's two parsers of that format.
TOOL_CALL_PARSERS = ("qwen3_coder", "qwen3_xml")
# `<think> ... </think>` reasoning, which the server always separates.
REASONING_PARSERS = ("qwen3", "deepseek_r1")
MEDIA = ("image", "video", "audio")


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("vLLM compatibility (accepted where nothing needs configuring)")
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="tool_choice auto: always on (calls in the output are parsed whenever tools are given)",
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        help=f"{' | '.join(TOOL_CALL_PARSERS)}: the Qwen XML call format, always parsed",
    )
    g.add_argument(
        "--reasoning-parser",
        default=None,
        help=f"{' | '.join(REASONING_PARSERS)}: <think> reasoning, always parsed into reasoning_content",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="always on: prompts are prefilled in chunks of --max-num-batched-tokens",
    )
    g.add_argument(
        "--trust-remote-code", action="store_true", help="nothing to trust: no checkpoint code is run"
    )
    g.add_argument("--language-model-only", action="store_true", help="always: the server is text only")
    g.add_argument(
        "--limit-mm-per-prompt",
        default=None,
        help='text only: accepted when it allows no media, e.g. \'{"image": 0, "video": 0}\'',
    )
    g.add_argument("--kv-cache-dtype", default="auto", help="auto only: the KV cache is in the model dtype")
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="the checkpoint's own FP8 format only (fp8, compressed-tensors; its weights load dequantized)",
    )


def check_vllm_arguments(args: argparse.Namespace, checkpoint_quantization: str | None = None) -> None:
    """Raises ConfigError (one sentence naming the flag, the supported and the found value).
    `checkpoint_quantization`: the model's quantization_config.quant_method (None: unquantized)."""
    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_CALL_PARSERS:
        raise ConfigError(
            f"--tool-call-parser must be one of {list(TOOL_CALL_PARSERS)} (the Qwen XML call format "
            f"Qwen3.5 writes), got {args.tool_call_parser!r}"
        )
    if args.reasoning_parser is not None and args.reasoning_parser not in REASONING_PARSERS:
        raise ConfigError(
            f"--reasoning-parser must be one of {list(REASONING_PARSERS)} (<think> reasoning), "
            f"got {args.reasoning_parser!r}"
        )
    if args.enable_chunked_prefill is False:
        raise ConfigError(
            "--no-enable-chunked-prefill is not supported: prefill is always chunked "
            "(size the chunks with --max-num-batched-tokens)"
        )
    _check_media_limits(args.limit_mm_per_prompt)
    if args.kv_cache_dtype != "auto":
        raise ConfigError(
            "--kv-cache-dtype must be 'auto' (the KV cache is kept in the model dtype; quantized KV caches "
            f"are not supported), got {args.kv_cache_dtype!r}"
        )
    if args.quantization is not None and args.quantization != checkpoint_quantization:
        served = (
            "an unquantized checkpoint (online quantization is not supported)"
            if checkpoint_quantization is None
            else f"a {checkpoint_quantization!r} checkpoint"
        )
        raise ConfigError(
            "--quantization must be left out, or name the checkpoint's own FP8 format ('fp8' or "
            f"'compressed-tensors'; its weights load dequantized), got {args.quantization!r} for {served}"
        )
    if args.trust_remote_code:
        logger.info("--trust-remote-code: nothing to trust, deltaserve runs no code from the checkpoint")


def _media_count(limit: Any) -> Any:
    """vLLM's per-modality limit: a count, or an object with a `count`."""
    return limit.get("count") if isinstance(limit, dict) else limit


def _check_media_limits(text: str | None) -> None:
    if text is None:
        return
    try:
        limits = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--limit-mm-per-prompt must be a JSON object, got {text!r} ({exc})") from exc
    if not isinstance(limits, dict):
        raise ConfigError(f"--limit-mm-per-prompt must be a JSON object, got {text!r}")
    allowed = {k: v for k, v in limits.items() if _media_count(v) != 0}
    if allowed:
        raise ConfigError(
            "--limit-mm-per-prompt must allow no media (deltaserve serves text only; give 0 for "
            f"{', '.join(MEDIA)}), got {json.dumps(allowed)}"
        )
