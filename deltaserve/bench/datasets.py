"""Benchmark prompts: the random token-id dataset and a JSONL custom dataset.

Random prompts are token-id lists sent as the `prompt` array of `/v1/completions`, so the server sees
exactly `prompt_len` tokens (no decode/re-encode drift as in `vllm bench serve`'s text prompts).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Qwen3.5's byte-level BPE ids; 248044 (<|endoftext|>) is the first special token.
QWEN35_BASE_VOCAB_SIZE = 248044


@dataclass(slots=True)
class BenchRequest:
    """One prompt to send. `prompt_len` is 0 for text prompts: only the server knows their length."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int


def _sample_lengths(
    rng: np.random.Generator, num: int, mean_len: int, range_ratio: float, minimum: int
) -> np.ndarray:
    """Lengths uniform over the integers in [floor(L·(1−r)), ceil(L·(1+r))], as `vllm bench serve`."""
    low = max(math.floor(mean_len * (1 - range_ratio)), minimum)
    high = max(math.ceil(mean_len * (1 + range_ratio)), minimum)
    return rng.integers(low, high + 1, size=num)


def random_token_prompts(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    token_id_low: int = 0,
    token_id_high: int = QWEN35_BASE_VOCAB_SIZE,
) -> list[BenchRequest]:
    """vLLM's random dataset over token ids in [token_id_low, token_id_high).

    Request i gets the consecutive run `low + (offset_i + i + arange(len_i)) % (high − low)` with a random
    offset, so prompts differ from each other (no accidental prefix-cache hits) and are reproducible
    from `seed`.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if math.floor(input_len * (1 - range_ratio)) < 1:
        raise ValueError(
            f"--random-input-len {input_len} with --random-range-ratio {range_ratio} can draw empty prompts; "
            "raise the input length or lower the ratio so that floor(len·(1−ratio)) >= 1"
        )
    if output_len < 1:
        raise ValueError(f"--random-output-len must be >= 1, got {output_len}")
    if not 0 <= token_id_low < token_id_high:
        raise ValueError(f"token id range [{token_id_low}, {token_id_high}) is empty or negative")
    rng = np.random.default_rng(seed)
    input_lens = _sample_lengths(rng, num_prompts, input_len, range_ratio, minimum=1)
    output_lens = _sample_lengths(rng, num_prompts, output_len, range_ratio, minimum=1)
    span = token_id_high - token_id_low
    offsets = rng.integers(0, span, size=num_prompts)
    requests = []
    for i in range(num_prompts):
        ids = token_id_low + (offsets[i] + i + np.arange(input_lens[i])) % span
        requests.append(BenchRequest(ids.tolist(), int(input_lens[i]), int(output_lens[i])))
    return requests


def load_custom_jsonl(path: str | Path, num_prompts: int) -> list[BenchRequest]:
    """Lines of `{"prompt": str | list[int], "output_len": int}`; the file is cycled to `num_prompts`."""
    rows: list[BenchRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                rows.append(_parse_custom_line(line, f"{path}:{lineno}"))
    if not rows:
        raise ValueError(f"--dataset-path {path} has no prompts; expected JSONL lines with 'prompt'")
    return [rows[i % len(rows)] for i in range(num_prompts)]


def _parse_custom_line(line: str, where: str) -> BenchRequest:
    row = json.loads(line)
    prompt = row.get("prompt") if isinstance(row, dict) else None
    output_len = row.get("output_len") if isinstance(row, dict) else None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompt_len = len(prompt)
    elif isinstance(prompt, str) and prompt:
        prompt_len = 0
    else:
        raise ValueError(f"{where}: 'prompt' must be a non-empty string or list of token ids, got {prompt!r}")
    if not isinstance(output_len, int) or output_len < 1:
        raise ValueError(f"{where}: 'output_len' must be an integer >= 1, got {output_len!r}")
    return BenchRequest(prompt, prompt_len, output_len)
