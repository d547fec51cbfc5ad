"""The SSM state dtype: float32 by default (the checkpoint's mamba_ssm_dtype), bf16 only when asked for,
with its accuracy cost measured against HF transformers (fp32, CPU, random weights).

Measured when this was written (prompt 40 tokens, 48 teacher-forced decode steps, two models), engine
in fp32 against HF fp32, top-8 |delta log-prob|:
  float32 state:  mean 2e-6..9e-6, p99 <= 1.1e-4, no argmax flips
  bfloat16 state: mean 0.021..0.033, p99 0.20..0.55, 1-2 argmax flips in 49 steps
(docs/benchmarks/2026-11-30-ssm-state-bf16-accuracy.md).
"""

from __future__ import annotations

import random
from pathlib import Path

import hf_oracle
import pytest
import torch
from engine_harness import Harness

from deltaserve.engine.core import EngineCore
from deltaserve.engine_config import EngineConfig
from deltaserve.errors import ConfigError
from deltaserve.tiny import default_model_dir

DECODE_STEPS = 48


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory):
    hf = hf_oracle.build_hf_causal_lm(seed=5, attn_group=2, gdn_group=2, tied=True)
    model_dir = hf_oracle.save_text_layout(hf, tmp_path_factory.mktemp("ssm_dtype") / "m")
    rng = random.Random(5)
    prompt = [rng.randrange(512) for _ in range(40)]
    ref, tokens = hf_oracle.hf_incremental_logprobs(hf, prompt, DECODE_STEPS)
    return Path(model_dir), prompt, ref, tokens


def top8_deltas(model_dir: Path, prompt, ref, tokens, ssm_dtype: torch.dtype | None) -> torch.Tensor:
    h = Harness(model_dir, ssm_dtype=ssm_dtype)
    seq = h.open()
    outs = [h.prefill(seq, prompt, 16)]
    outs += [h.step([(seq, [t])])[0] for t in tokens]
    assert h.caches.states.ssm.dtype == (ssm_dtype or torch.float32)
    return torch.cat(
        [(o[o.topk(8).indices] - r[o.topk(8).indices]).abs() for o, r in zip(outs, ref, strict=True)]
    )


def test_float32_state_is_exact_and_bf16_state_costs_a_bounded_measured_error(case):
    fp32 = top8_deltas(*case, ssm_dtype=None)
    bf16 = top8_deltas(*case, ssm_dtype=torch.bfloat16)
    for name, d in (("float32", fp32), ("bfloat16", bf16)):
        print(
            f"{name} SSM state: top-8 |d logprob| mean {d.mean():.2e} p99 {d.quantile(0.99):.2e} max {d.max():.2e}"
        )
    assert fp32.max() <= 1e-3
    # bf16 rounds the state every step: clearly worse than fp32, within the measured band (x3 margin).
    assert bf16.mean() > 100 * fp32.mean()
    assert bf16.mean() <= 0.1 and bf16.quantile(0.99) <= 1.5


def test_engine_flag_sets_the_state_dtype_and_halves_its_memory():
    def core(dtype: str) -> EngineCore:
        return EngineCore(
            EngineConfig(model=str(default_model_dir()), mamba_ssm_cache_dtype=dtype, max_model_len=64)
        )

    default, narrow = core("auto"), core("bfloat16")
    assert default.backend.caches.states.ssm.dtype == torch.float32
    assert narrow.backend.caches.states.ssm.dtype == torch.bfloat16
    cfg = default.model_config
    ssm_fp32 = cfg.state_bytes_per_sequence(torch.float32) - narrow.model_config.state_bytes_per_sequence(
        torch.float32
    )
    assert ssm_fp32 * 2 == (
        cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    ) * len(cfg.linear_attention_layers)


def test_bad_state_dtype_is_rejected_naming_the_flag():
    with pytest.raises(ConfigError, match="--mamba-ssm-cache-dtype must be one of .* got 'fp8'"):
        EngineConfig(mamba_ssm_cache_dtype="fp8").validate()
