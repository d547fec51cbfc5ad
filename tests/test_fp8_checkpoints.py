"""FP8 checkpoints (Qwen's -FP8 releases): block-wise FP8 weights with inverse scales, dequantized at load.

The dequantization is checked against hand-computed values; whole models against HF transformers reading
the same FP8 checkpoint (`FineGrainedFP8Config(dequantize=True)`, fp32, CPU) over prefill and decode, in
the text layout and the official layout (fused MoE experts with fused scales, vision and MTP tensors).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import hf_oracle
import pytest
import torch
from engine_harness import Harness
from safetensors.torch import load_file, save_file

from deltaserve.config import ModelConfig
from deltaserve.errors import ConfigError
from deltaserve.model import fp8
from deltaserve.model.layers.parallel import TensorParallel
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.model.weights import load_weights
from deltaserve.quant_config import WeightQuantization
from deltaserve.tiny import official_config

BLOCK = (16, 16)
TOL = 1e-3
FP8 = torch.float8_e4m3fn


def _fp8(rows: list[list[float]]) -> torch.Tensor:
    t = torch.tensor(rows, dtype=torch.float32)
    assert torch.equal(t.to(FP8).float(), t)  # the test values are exact in e4m3
    return t.to(FP8)


# ---- the dequantization ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_element_takes_its_blocks_scale_with_partial_edge_blocks(dtype):
    """3 x 5 in 2 x 2 blocks: rows {0, 1} | {2}, columns {0, 1} | {2, 3} | {4}."""
    weight = _fp8([[1, 2, -0.5, 0.25, 3], [-1, 0.5, 4, -2, 1.5], [0.125, -3, 6, 8, -0.75]])
    scale = torch.tensor([[1.0, 2.0, 4.0], [0.5, 8.0, 16.0]])
    quant = WeightQuantization("fp8", "_scale_inv", ((2, 2),), "dynamic")
    out = fp8.dequantize(weight, scale, quant, dtype)
    expected = [[1, 2, -1, 0.5, 12], [-1, 0.5, 8, -4, 6], [0.0625, -1.5, 48, 64, -12]]
    assert out.dtype == dtype and out.float().tolist() == expected


@pytest.mark.parametrize("chunk_elements", [1, 4 * 23 * 2, 1 << 24])
def test_any_chunking_of_the_rows_gives_each_element_its_blocks_scale(monkeypatch, chunk_elements):
    """Stacked 37 x 23 matrices in 4 x 8 blocks, dequantized one block row, two, or all at a time."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(3, 37, 23, generator=gen) * 50).to(FP8)
    scale = torch.rand(3, 10, 3, generator=gen) + 0.01
    monkeypatch.setattr(fp8, "CHUNK_ELEMENTS", chunk_elements)
    out = fp8.dequantize(
        weight, scale, WeightQuantization("fp8", "_scale_inv", ((4, 8),), "dynamic"), torch.float32
    )
    i, j = torch.arange(37)[:, None], torch.arange(23)[None, :]
    assert torch.equal(out, weight.float() * scale[:, i // 4, j // 8])


def test_one_scale_per_matrix_of_a_stack_without_a_block_size():
    weight = torch.stack([_fp8([[1, 2], [3, 4]]), _fp8([[0.5, 1], [1.5, 2]])])
    quant = WeightQuantization("fp8", "_scale_inv", ((None, None),), "dynamic")
    for scale in (torch.tensor([2.0, 0.25]), torch.tensor([[[2.0]], [[0.25]]])):
        out = fp8.dequantize(weight, scale, quant, torch.float32)
        assert out.tolist() == [[[2, 4], [6, 8]], [[0.125, 0.25], [0.375, 0.5]]]


def test_scales_stored_in_bf16_give_the_same_values():
    weight = _fp8([[1, -2], [3, 4]])
    quant = WeightQuantization("fp8", "_scale_inv", ((1, 2),), "dynamic")
    out = fp8.dequantize(weight, torch.tensor([[0.5], [4.0]], dtype=torch.bfloat16), quant, torch.float32)
    assert out.tolist() == [[0.5, -1], [12, 16]]


def test_a_scale_of_the_wrong_shape_and_a_weight_not_in_fp8_are_refused():
    weight = _fp8([[1, 2, 3, 4, 6]] * 3)
    quant = WeightQuantization("fp8", "_scale_inv", ((2, 2),), "dynamic")
    with pytest.raises(
        ValueError,
        match=r"has a scale of shape \[1, 3\], expected \[2, 3\] \(2x2 blocks\) \(weight \[3, 5\]\)",
    ):
        fp8.dequantize(weight, torch.ones(1, 3), quant, torch.float32)
    with pytest.raises(ValueError, match="has dtype torch.bfloat16, an FP8 .* stores torch.float8_e4m3fn"):
        fp8.dequantize(weight.to(torch.bfloat16), torch.ones(2, 3), quant, torch.float32)


# ---- quantization_config ---------------------------------------------------------------------------


def _config(quantization: object, *, in_text: bool = False) -> dict:
    raw = official_config("tiny")
    (raw["text_config"] if in_text else raw)["quantization_config"] = quantization
    return raw


def test_quantization_config_is_read_at_the_top_level_or_in_text_config():
    qc = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    for in_text in (False, True):
        cfg = ModelConfig.from_dict(_config(qc, in_text=in_text))
        assert cfg.weight_quantization == WeightQuantization("fp8", "_scale_inv", ((128, 128),), "dynamic")
    per_tensor = ModelConfig.from_dict(_config({"quant_method": "fp8", "activation_scheme": "static"}))
    assert per_tensor.weight_quantization == WeightQuantization(
        "fp8", "_scale_inv", ((None, None),), "static"
    )
    assert ModelConfig.from_dict(official_config("tiny")).weight_quantization is None


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        ({"quant_method": "gptq", "bits": 4}, r"quant_method must be 'fp8' .*, got 'gptq'"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, r"fmt must be 'e4m3' .*, got 'e5m2'"),
        (
            {"quant_method": "fp8", "weight_block_size": [128]},
            r"weight_block_size must be two integers .*\[128\]",
        ),
        ({"quant_method": "fp8", "weight_block_size": [0, 128]}, r"weight_block_size .*\[0, 128\]"),
        ({"quant_method": "fp8", "activation_scheme": "per_token"}, r"activation_scheme .*'per_token'"),
        ("fp8", r"quantization_config must be an object, got 'fp8'"),
    ],
)
def test_unsupported_quantization_configs_are_refused_naming_the_key(quantization, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(_config(quantization))


# ---- whole models against HF -----------------------------------------------------------------------


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(length)]


def _hf_reading(model_dir: Path) -> torch.nn.Module:
    """HF transformers' own reading of an FP8 checkpoint, dequantized in fp32."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32
    )
    return model.eval()


def _replay_matches(model_dir: Path, hf: torch.nn.Module, prompt: list[int], chunk: int) -> None:
    ref, tokens = hf_oracle.hf_incremental_logprobs(hf, prompt, 6)
    h = Harness(model_dir)
    seq = h.open()
    out = h.prefill(seq, prompt, chunk)
    for i, expected in enumerate(ref):
        diff = (out - expected).abs().max().item()
        assert diff <= TOL and int(out.argmax()) == int(expected.argmax()), f"position {i}: {diff:.2e}"
        if i < len(tokens):
            out = h.step([(seq, [tokens[i]])])[0]


def _fp8_text_checkpoint(root: Path, name: str, **kw) -> tuple[torch.nn.Module, Path, list[str]]:
    hf = hf_oracle.build_hf_causal_lm(seed=7, **kw)
    out = hf_oracle.save_text_layout(hf, root / name)
    return (
        hf,
        out,
        hf_oracle.quantize_checkpoint(out, BLOCK, hf_oracle.is_linear_weight, hf_oracle.fp8_config(BLOCK)),
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fp8")


@pytest.fixture(scope="module")
def dense(root: Path) -> tuple[torch.nn.Module, Path, list[str]]:
    return _fp8_text_checkpoint(root, "dense", tied=False, layers=4)


def test_dense_fp8_checkpoint_matches_hf_reading_it(dense):
    original, model_dir, quantized = dense
    assert any("in_proj_qkv" in n for n in quantized) and any("self_attn.o_proj" in n for n in quantized)
    hf = _hf_reading(model_dir)
    # HF dequantized: the weights moved from the originals by the FP8 rounding, and not further.
    name = next(n for n in quantized if "down_proj" in n)
    ours, theirs = hf.state_dict()[name], original.state_dict()[name]
    assert not torch.equal(ours, theirs) and torch.allclose(ours, theirs, rtol=0.07, atol=1e-6)
    _replay_matches(model_dir, hf, _prompt(29, 1), chunk=8)


def test_moe_fp8_in_the_official_layout_with_fused_experts_matches_hf(root):
    hf_model, text_dir, quantized = _fp8_text_checkpoint(root, "moe_text", moe=True, tied=False, layers=4)
    assert any(".experts.3.down_proj" in n for n in quantized) and any(
        "mlp.gate.weight" in n for n in quantized
    )
    hf = _hf_reading(text_dir)
    official = hf_oracle.save_official_layout(hf_model, root / "moe_official", fused_experts=False)
    hf_oracle.quantize_checkpoint(official, BLOCK, hf_oracle.is_linear_weight, hf_oracle.fp8_config(BLOCK))
    (path,) = official.glob("*.safetensors")
    tensors = hf_oracle.fuse_experts(load_file(str(path)), hf_model.config.num_experts)
    assert tensors["model.language_model.layers.0.mlp.experts.gate_up_proj"].dtype == FP8
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj_scale_inv" in tensors
    assert any(k.startswith("mtp.") and k.endswith("_scale_inv") for k in tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    for model_dir in (text_dir, official):
        _replay_matches(model_dir, hf, _prompt(23, 2), chunk=5)


def test_tensor_parallel_ranks_take_their_shard_of_the_dequantized_weights(dense):
    _, model_dir, _ = dense
    cfg, cpu = ModelConfig.from_dir(model_dir), torch.device("cpu")
    whole = Qwen35ForCausalLM(cfg, dtype=torch.float32, device=cpu)
    load_weights(whole, model_dir)
    full = {spec.name: spec.target for req in whole.weight_requirements() for spec in req.alternatives[0]}
    sharded = 0
    for rank in range(2):
        part = Qwen35ForCausalLM(cfg, dtype=torch.float32, device=cpu, tp=TensorParallel(rank, 2))
        load_weights(part, model_dir)
        for req in part.weight_requirements():
            for spec in req.alternatives[0]:
                want = full[spec.name] if spec.shard is None else spec.shard.take(full[spec.name])
                sharded += spec.shard is not None
                assert torch.equal(spec.target, want), (rank, spec.name)
    assert sharded > 0


# ---- what the loader refuses or skips ---------------------------------------------------------------


def _edited_copy(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    (path,) = src.glob("*.safetensors")
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(dst / path.name), metadata={"format": "pt"})
    return dst


def test_an_fp8_weight_without_its_scale_or_with_a_misshaped_one_is_refused(root, dense):
    _, model_dir, quantized = dense
    name = next(n for n in quantized if "down_proj" in n)  # 64 x 128: 4 x 8 blocks
    missing = _edited_copy(model_dir, root / "no_scale", lambda t: t.pop(name + "_scale_inv"))
    with pytest.raises(ConfigError, match=f"FP8 tensor {name} has no scale {name}_scale_inv"):
        Harness(missing)

    def misshape(t: dict[str, torch.Tensor]) -> None:
        t[name + "_scale_inv"] = t[name + "_scale_inv"][:1]

    shape = list(
        fp8.scale_shape(tuple(load_file(str(next(model_dir.glob("*.safetensors"))))[name].shape), BLOCK)
    )
    bad = _edited_copy(model_dir, root / "bad_scale", misshape)
    with pytest.raises(
        ConfigError,
        match=rf"FP8 tensor {name} has a scale of shape \[1, 8\], expected {re.escape(str(shape))}",
    ):
        Harness(bad)


def test_fp8_tensors_need_the_quantization_config(root, dense):
    _, model_dir, _ = dense
    undeclared = _edited_copy(model_dir, root / "undeclared", lambda t: None)
    config = json.loads((undeclared / "config.json").read_text())
    del config["quantization_config"]
    (undeclared / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConfigError, match="has dtype torch.float8_e4m3fn, but config.json has no quantization_config"
    ):
        Harness(undeclared)


def test_static_activation_scales_are_skipped_and_the_weights_load_the_same(root, dense):
    original, model_dir, quantized = dense

    def add_activation_scales(t: dict[str, torch.Tensor]) -> None:
        for name in quantized:
            t[name.removesuffix(".weight") + ".input_scale"] = torch.tensor(0.5)

    static = _edited_copy(model_dir, root / "static", add_activation_scales)
    config = json.loads((static / "config.json").read_text())
    config["quantization_config"]["activation_scheme"] = "static"
    (static / "config.json").write_text(json.dumps(config))
    a, b = Harness(model_dir).model.state_dict(), Harness(static).model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- `--quantization` ----------------------------------------------------------------------------------


def test_the_quantization_flag_is_accepted_as_fp8_with_an_fp8_checkpoint_only(capsys, dense):
    from deltaserve.cli import build_parser, main
    from deltaserve.vllm_flags import check_vllm_arguments, checkpoint_quantization

    _, model_dir, _ = dense
    args = build_parser().parse_args(["serve", str(model_dir), "--quantization", "fp8"])
    assert checkpoint_quantization(str(model_dir)) == "fp8"
    check_vllm_arguments(args, "fp8")  # accepted
    assert main(["serve", str(model_dir), "--device", "cpu", "--quantization", "awq"]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert line.endswith("got 'awq' for a 'fp8' checkpoint")


# ---- compressed-tensors (llm-compressor's FP8 checkpoints) ------------------------------------------


def test_compressed_tensors_strategies_give_their_scale_layouts():
    cases = [
        ({"strategy": "tensor"}, (None, None)),
        ({"strategy": "channel"}, (1, None)),
        ({"strategy": "group", "group_size": 32}, (1, 32)),
        ({"strategy": "block", "block_structure": [128, 128]}, (128, 128)),
    ]
    for weights, block in cases:
        quant = ModelConfig.from_dict(
            _config(hf_oracle.compressed_tensors_config(weights))
        ).weight_quantization
        assert quant == WeightQuantization("compressed-tensors", "_scale", (block,), "dynamic"), weights
    two = hf_oracle.compressed_tensors_config({"strategy": "channel"})
    two["config_groups"]["group_1"] = {
        **two["config_groups"]["group_0"],
        "weights": {
            **two["config_groups"]["group_0"]["weights"],
            "strategy": "block",
            "block_structure": [64, 64],
        },
        "input_activations": {"dynamic": False, "num_bits": 8, "strategy": "tensor", "type": "float"},
    }
    quant = ModelConfig.from_dict(_config(two)).weight_quantization
    assert quant == WeightQuantization("compressed-tensors", "_scale", ((1, None), (64, 64)), "static")


def _ct_refused(change) -> dict:
    config = hf_oracle.compressed_tensors_config({"strategy": "channel"})
    change(config, config["config_groups"]["group_0"]["weights"])
    return config


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda c, w: w.update(num_bits=4, type="int"),
            r"num_bits and type must be 8 and 'float' .*got \(4, 'int'\)",
        ),
        (lambda c, w: w.update(symmetric=False), r"weights: symmetric must be true .*got False"),
        (lambda c, w: w.update(strategy="token"), r"strategy must be one of .*got 'token'"),
        (lambda c, w: w.update(strategy="group"), r"group_size must be an integer >= 1 .*got None"),
        (
            lambda c, w: c.update(format="pack-quantized"),
            r"group_0: format must be one of .*got 'pack-quantized'",
        ),
        (
            lambda c, w: c.update(sparsity_config={"format": "sparse-24-bitmask"}),
            r"sparsity_config must be empty",
        ),
        (
            lambda c, w: c.update(quantization_status="frozen"),
            r"quantization_status must be 'compressed', got 'frozen'",
        ),
        (lambda c, w: c.update(config_groups={}), r"config_groups must be an object of one or more"),
    ],
)
def test_unsupported_compressed_tensors_configs_are_refused_naming_the_key(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(_config(_ct_refused(change)))


def _hf_reading_compressed(model_dir: Path) -> torch.nn.Module:
    """HF transformers' reading of a compressed-tensors checkpoint (the compressed-tensors library),
    decompressed in fp32."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32
    )
    return model.eval()


@pytest.mark.parametrize(
    ("weights", "block", "moe"),
    [
        ({"strategy": "channel"}, (1, None), True),  # HF reads merged MoE experts with per-row scales only
        ({"strategy": "block", "block_structure": [16, 16]}, (16, 16), False),
    ],
)
def test_compressed_tensors_fp8_checkpoints_match_hf_reading_them(root, weights, block, moe):
    hf_model = hf_oracle.build_hf_causal_lm(seed=11, moe=moe, tied=False, layers=4)
    model_dir = hf_oracle.save_text_layout(hf_model, root / f"ct_{weights['strategy']}")
    config = hf_oracle.compressed_tensors_config(weights)
    names = hf_oracle.quantize_checkpoint(
        model_dir, block, hf_oracle.is_linear_weight, config, suffix="_scale"
    )
    assert len(names) > 10
    hf = _hf_reading_compressed(model_dir)
    name = next(n for n in names if "o_proj" in n)
    assert not torch.equal(hf.state_dict()[name], hf_model.state_dict()[name])  # HF read the FP8 values
    _replay_matches(model_dir, hf, _prompt(27, 3), chunk=6)
