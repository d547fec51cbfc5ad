"""Config parsing: official and flat layouts, derived values, and one clear error per bad input."""

from __future__ import annotations

import copy
import json

import pytest

from deltaserve.config import ModelConfig
from deltaserve.engine_config import EngineConfig
from deltaserve.errors import ConfigError

TEXT_4B = {
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 2560,
    "num_hidden_layers": 32,
    "intermediate_size": 9216,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    "mamba_ssm_dtype": "float32",
    "eos_token_id": 248044,
}
OFFICIAL_4B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "tie_word_embeddings": True,
    "text_config": TEXT_4B,
    "vision_config": {"depth": 24},
}
MOE = {
    **{k: v for k, v in TEXT_4B.items() if k != "intermediate_size"},
    "model_type": "qwen3_5_moe_text",
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}


def test_official_4b_config_derives_layers_rope_and_sizes():
    cfg = ModelConfig.from_dict(OFFICIAL_4B)
    assert cfg.model_type == "qwen3_5_text" and not cfg.is_moe
    assert cfg.full_attention_layers == (3, 7, 11, 15, 19, 23, 27, 31)
    assert len(cfg.linear_attention_layers) == 24
    assert cfg.tie_word_embeddings  # read from the top level when text_config lacks it
    assert (cfg.rope_theta, cfg.rotary_dim) == (1e7, 64)
    assert cfg.conv_dim == 8192
    import torch

    assert cfg.kv_bytes_per_token(torch.bfloat16) == 32 * 1024  # 8 layers x 2 x 4 heads x 256 x 2 bytes
    # 24 layers x (8192 x 3 x 2 bytes + 32 x 128 x 128 x 4 bytes) = 49.125 MiB
    assert cfg.state_bytes_per_sequence(torch.bfloat16) == 24 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)


def test_mtp_layer_count_is_read_from_the_text_config_and_defaults_to_zero():
    assert ModelConfig.from_dict(OFFICIAL_4B).mtp_num_hidden_layers == 0
    assert (
        ModelConfig.from_dict(mutate(["text_config", "mtp_num_hidden_layers"], 1)).mtp_num_hidden_layers == 1
    )


def test_moe_flat_config_and_explicit_layer_types():
    raw = dict(MOE, layer_types=["linear_attention"] * 31 + ["full_attention"])
    cfg = ModelConfig.from_dict(raw)
    assert cfg.is_moe and cfg.num_experts == 256 and cfg.norm_topk_prob
    assert cfg.full_attention_layers == (31,)


def test_legacy_top_level_rope_keys_are_read():
    raw = {k: v for k, v in TEXT_4B.items() if k != "rope_parameters"}
    raw.update(rope_theta=5e6, partial_rotary_factor=0.5)
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.rope_theta, cfg.rotary_dim) == (5e6, 128)


def test_generation_config_eos_ids_win_over_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(OFFICIAL_4B))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [248046, 248044]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (248046, 248044)


def mutate(path: list, value) -> dict:
    raw = copy.deepcopy(OFFICIAL_4B)
    node = raw
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return raw


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (["text_config", "hidden_size"], KeyError, "missing required key 'hidden_size'"),
        (["model_type"], "llama", "model_type must be one of"),
        (["text_config", "model_type"], "qwen3_5_moe_text", "model_type must be 'qwen3_5_text'"),
        (
            ["text_config", "num_key_value_heads"],
            3,
            "num_attention_heads must be a multiple of num_key_value_heads (3)",
        ),
        (["text_config", "linear_num_value_heads"], 24, "linear_num_value_heads must be a multiple"),
        (["text_config", "head_dim"], "256", "head_dim must be an integer >= 1, got '256'"),
        (
            ["text_config", "layer_types"],
            ["full_attention"] * 3,
            "layer_types must be a list of num_hidden_layers (32)",
        ),
        (["text_config", "rope_parameters", "rope_type"], "yarn", "rope_type must be 'default'"),
        (["text_config", "hidden_act"], "gelu", "hidden_act must be 'silu', got 'gelu'"),
        (["text_config", "mamba_ssm_dtype"], "float8", "mamba_ssm_dtype must be one of"),
        (["text_config"], KeyError, "needs a text_config object"),
        (
            ["text_config", "mtp_num_hidden_layers"],
            -1,
            "mtp_num_hidden_layers must be an integer >= 0, got -1",
        ),
    ],
)
def test_bad_configs_fail_naming_key_expected_and_found(path, value, message):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict(mutate(path, value))
    assert message in str(err.value)


def test_missing_config_file_names_the_directory(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_num_seqs", 0, "--max-num-seqs must be an integer >= 1, got 0"),
        ("kv_reserve_tokens", 0, "--kv-reserve-tokens must be an integer >= 1, got 0"),
        ("page_size", 12, "--page-size must be a power of two, got 12"),
        ("scheduler_policy", "lifo", "--scheduler-policy must be one of ['fcfs', 'auto'], got 'lifo'"),
        ("dtype", "int8", "--dtype must be one of"),
        ("gpu_memory_utilization", 1.5, "--gpu-memory-utilization must be in (0, 1], got 1.5"),
        (
            "prefill_graph_max_tokens",
            -1,
            "--prefill-graph-max-tokens must be an integer >= 0 (0: off), got -1",
        ),
        (
            "max_num_batched_tokens_saturated",
            1024,
            "--max-num-batched-tokens-saturated must be 0 (off) or at least --max-num-batched-tokens (2048), "
            "got 1024",
        ),
    ],
)
def test_bad_engine_flags_fail_before_loading(field, value, message):
    with pytest.raises(ConfigError) as err:
        EngineConfig(**{field: value}).validate()
    assert message in str(err.value)


def test_speculation_with_the_async_prefill_is_refused_naming_both_flags():
    from deltaserve.engine_config import SpeculativeConfig

    with pytest.raises(ConfigError) as err:
        EngineConfig(
            prefill_overlap=True, speculative_config=SpeculativeConfig(num_speculative_tokens=2)
        ).validate()
    assert "--speculative-config cannot be combined with --prefill-overlap" in str(err.value)
    EngineConfig(speculative_config=SpeculativeConfig(num_speculative_tokens=2)).validate()


def test_warm_up_measures_the_largest_step_either_budget_allows():
    assert EngineConfig(max_num_seqs=256, max_num_batched_tokens_saturated=0).largest_step_tokens == 2048
    assert EngineConfig(max_num_seqs=256, max_num_batched_tokens_saturated=8192).largest_step_tokens == 8192
    # the default saturated step: a row per sequence beside 4,096 prompt tokens
    assert EngineConfig(max_num_seqs=512).saturated_step_tokens == 4608
    assert EngineConfig(max_num_seqs=256).largest_step_tokens == 4352
    # a budget lowered for latency: twice it beside the rows, not 4,096
    assert EngineConfig(max_num_seqs=512, max_num_batched_tokens=1024).saturated_step_tokens == 512 + 2048
    assert EngineConfig(max_num_seqs=8, max_num_batched_tokens=16).saturated_step_tokens == 8 + 32
    # off where the base budget is already larger
    assert EngineConfig(max_num_seqs=512, max_num_batched_tokens=8192).saturated_step_tokens == 0
    assert EngineConfig(max_num_seqs=512, max_num_batched_tokens=8192).largest_step_tokens == 8192


def test_the_default_max_num_seqs_is_read_only_once_resolved():
    with pytest.raises(RuntimeError, match="resolved from memory"):
        _ = EngineConfig().saturated_step_tokens
    EngineConfig().validate()  # None is the default, not an error


def test_prefill_graph_tokens_default_to_the_largest_step_up_to_4608():
    assert EngineConfig(max_num_seqs=512).prefill_graph_tokens == 4608
    assert EngineConfig(max_num_seqs=256).prefill_graph_tokens == 4352
    base = dict(max_num_seqs=256, max_num_batched_tokens_saturated=0)
    assert EngineConfig(max_num_batched_tokens=1024, **base).prefill_graph_tokens == 1024
    assert EngineConfig(max_num_batched_tokens=8192, **base).prefill_graph_tokens == 4608
    assert (
        EngineConfig(max_num_batched_tokens=8192, prefill_graph_max_tokens=4096, **base).prefill_graph_tokens
        == 4096
    )
    assert (
        EngineConfig(max_num_batched_tokens=512, prefill_graph_max_tokens=4096, **base).prefill_graph_tokens
        == 512
    )
    assert EngineConfig(prefill_graph_max_tokens=0, **base).prefill_graph_tokens == 0
