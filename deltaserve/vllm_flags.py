"""`vllm serve` flags that configure nothing here, so that a copied vLLM command line starts or fails
with one sentence.

Accepted: flags that ask for what deltaserve always does (auto tool choice, the Qwen XML tool-call and
`<think>` reasoning parsers, chunked prefill, a text-only model, the model's own tokenizer, xgrammar)
or that have nothing to act on (`--trust-remote-code`: no checkpoint code is ever run); aliases
(`--block-size` is `--page-size`, `--mamba-cache-mode none` turns the prefix cache off). Refused,
naming what is supported: features the engine does not have (an fp8 KV cache, online or non-FP8
quantization, images, config overrides). `--quantization` naming the checkpoint's own FP8 format
(`fp8`, `compressed-tensors`) is accepted: it loads dequantized. The flags that need no code of their
own are tables in vllm_flag_table.py.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from deltaserve.config import ModelConfig
from deltaserve.engine_config import EngineConfig, parse_json_object
from deltaserve.errors import ConfigError
from deltaserve.vllm_flag_table import add_table_arguments, check_table_arguments

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
    g.add_argument("--tokenizer", default=None, help="the model directory only: its tokenizer.json is used")
    g.add_argument("--block-size", type=int, default=None, help="the KV page size: --page-size")
    g.add_argument(
        "--mamba-cache-mode",
        default=None,
        choices=("align", "all", "none"),
        help="align | all: the prefix cache keeps GDN state at any token; none: no prefix caching",
    )
    g.add_argument(
        "--structured-outputs-config",
        default=None,
        help='JSON with a backend of auto or xgrammar only, e.g. \'{"backend": "xgrammar"}\'',
    )
    g.add_argument(
        "--hf-overrides", default=None, help="{} only: the checkpoint's config.json is used as it is"
    )
    add_table_arguments(g)
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
    _check_tokenizer(args.tokenizer, getattr(args, "model_tag", None) or args.model)
    _apply_block_size(args)
    if args.mamba_cache_mode == "none":  # vLLM keeps no GDN state for reuse: no prefix caching
        logger.info("--mamba-cache-mode none: the prefix cache is off")
        args.enable_prefix_caching = False
    _check_json_flag(
        "--structured-outputs-config", args.structured_outputs_config, {"backend": ("auto", "xgrammar")}
    )
    _check_json_flag("--hf-overrides", args.hf_overrides, {})
    check_table_arguments(args)


def checkpoint_quantization(model: str | None) -> str | None:
    """The model's quantization_config.quant_method (None: unquantized, or the embedded default)."""
    if model is None:
        return None
    quant = ModelConfig.from_dir(model).weight_quantization
    return None if quant is None else quant.method


# Engine arguments of vLLM's LLM() that the offline engine has nothing to do with (it logs no stats).
OFFLINE_IGNORED = ("disable_log_stats",)


def offline_engine_kwargs(
    model: str | None, kwargs: dict[str, Any], engine_fields: set[str]
) -> dict[str, Any]:
    """vLLM's LLM(**kwargs) here: the engine flags among `kwargs`, after vLLM's other keyword arguments
    were checked as their `vllm serve` flags are (accepted, logged as configuring nothing here, applied
    as an alias, or refused with ConfigError). A name neither knows is a TypeError, as in vLLM."""
    args = argparse.Namespace()
    parser = argparse.ArgumentParser(add_help=False)
    add_vllm_arguments(parser)
    parser.parse_args([], namespace=args)
    compat = set(vars(args)) - engine_fields
    unknown = sorted(set(kwargs) - engine_fields - compat - set(OFFLINE_IGNORED))
    if unknown:
        known = sorted(engine_fields | compat | set(OFFLINE_IGNORED))
        raise TypeError(f"LLM() got unknown engine arguments {unknown}; known: {known}")
    for name in compat & set(kwargs):
        value = kwargs[name]
        setattr(args, name, json.dumps(value) if isinstance(value, dict) else value)
    engine = {k: v for k, v in kwargs.items() if k in engine_fields}
    defaults = EngineConfig()
    args.model = model
    args.page_size = engine.get("page_size", defaults.page_size)
    args.enable_prefix_caching = engine.get("enable_prefix_caching", defaults.enable_prefix_caching)
    check_vllm_arguments(args, checkpoint_quantization(model) if args.quantization is not None else None)
    if args.page_size != defaults.page_size:
        engine["page_size"] = args.page_size
    if args.enable_prefix_caching != defaults.enable_prefix_caching:
        engine["enable_prefix_caching"] = args.enable_prefix_caching
    return engine


def parse_json_flag(flag: str, text: str | None) -> dict[str, Any]:
    """A flag's JSON object ({} when the flag is absent)."""
    return parse_json_object(flag, text) if text else {}


def _check_tokenizer(tokenizer: str | None, model: str | None) -> None:
    if tokenizer is None:
        return
    if model is None or Path(tokenizer).resolve() != Path(model).resolve():
        where = "the embedded default" if model is None else repr(model)
        raise ConfigError(
            f"--tokenizer must be the model directory ({where}: its tokenizer.json is the one used), "
            f"got {tokenizer!r}"
        )


def _apply_block_size(args: argparse.Namespace) -> None:
    """vLLM's --block-size is the KV page size."""
    if args.block_size is None:
        return
    if args.page_size not in (args.block_size, EngineConfig().page_size):  # --page-size given too
        raise ConfigError(
            f"--block-size {args.block_size} and --page-size {args.page_size} both set the KV page size; give one"
        )
    args.page_size = args.block_size


def _check_json_flag(flag: str, text: str | None, allowed: dict[str, tuple[str, ...]]) -> None:
    """A JSON object whose keys are among `allowed`, each with one of its allowed values."""
    for key, found in parse_json_flag(flag, text).items():
        if key not in allowed:
            keys = f"keys among {sorted(allowed)}" if allowed else "no keys"
            raise ConfigError(f"{flag} may have {keys} (nothing else is configurable here), got {key!r}")
        if found not in allowed[key]:
            raise ConfigError(f"{flag}: {key} must be one of {list(allowed[key])}, got {found!r}")


def _media_count(limit: Any) -> Any:
    """vLLM's per-modality limit: a count, or an object with a `count`."""
    return limit.get("count") if isinstance(limit, dict) else limit


def _check_media_limits(text: str | None) -> None:
    allowed = {
        k: v for k, v in parse_json_flag("--limit-mm-per-prompt", text).items() if _media_count(v) != 0
    }
    if allowed:
        raise ConfigError(
            "--limit-mm-per-prompt must allow no media (deltaserve serves text only; give 0 for "
            f"{', '.join(MEDIA)}), got {json.dumps(allowed)}"
        )
