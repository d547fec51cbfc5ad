"""Checkpoint loading: sharded files, dtype choice, random weights, and one clear error per bad file."""

from __future__ import annotations

import json
from pathlib import Path

import hf_oracle
import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.config import ModelConfig
from deltaserve.errors import ConfigError
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.model.weights import init_dummy_weights, load_weights


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt")
    hf_oracle.save_text_layout(hf_oracle.build_hf_causal_lm(seed=3, tied=False, layers=4), out)
    return out


def copy_with(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    for name in ("config.json", "generation_config.json"):
        (dst / name).write_text((src / name).read_text())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def new_model(model_dir: Path, dtype=torch.float32) -> Qwen35ForCausalLM:
    return Qwen35ForCausalLM(ModelConfig.from_dir(model_dir), dtype=dtype, device=torch.device("cpu"))


def test_missing_tensor_is_named(checkpoint, tmp_path):
    bad = copy_with(
        checkpoint, tmp_path / "bad", lambda t: t.pop("model.layers.1.linear_attn.in_proj_z.weight")
    )
    with pytest.raises(ConfigError, match=r"missing tensors: layers\.1\.linear_attn\.in_proj_z\.weight"):
        load_weights(new_model(bad), bad)


def test_misshaped_tensor_reports_both_shapes(checkpoint, tmp_path):
    def edit(t):
        t["model.layers.3.self_attn.k_proj.weight"] = torch.zeros(48, 64)

    bad = copy_with(checkpoint, tmp_path / "bad", edit)
    with pytest.raises(
        ConfigError, match=r"k_proj\.weight has shape \[48, 64\], the config implies \[64, 64\]"
    ):
        load_weights(new_model(bad), bad)


def test_unexpected_tensor_is_named(checkpoint, tmp_path):
    def edit(t):
        t["model.layers.0.mlp.gate_proj.weight_scale"] = torch.ones(1)

    bad = copy_with(checkpoint, tmp_path / "bad", edit)
    with pytest.raises(ConfigError, match=r"does not have: model\.layers\.0\.mlp\.gate_proj\.weight_scale"):
        load_weights(new_model(bad), bad)


def test_sharded_index_loads_the_same_weights(checkpoint, tmp_path):
    tensors = load_file(str(checkpoint / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    out = tmp_path / "sharded"
    out.mkdir()
    (out / "config.json").write_text((checkpoint / "config.json").read_text())
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(out / file))
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a, b = new_model(checkpoint), new_model(out)
    load_weights(a, checkpoint)
    load_weights(b, out)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_bfloat16_load_keeps_decay_parameters_in_float32(checkpoint):
    model = new_model(checkpoint, torch.bfloat16)
    load_weights(model, checkpoint)
    gdn = model.layers[0].mixer
    assert gdn.A_log.dtype == torch.float32 and gdn.dt_bias.dtype == torch.float32
    assert gdn.in_proj.dtype == torch.bfloat16
    ref = load_file(str(checkpoint / "model.safetensors"))["model.layers.0.linear_attn.A_log"]
    assert torch.equal(gdn.A_log, ref)


def test_dummy_weights_are_finite_and_deterministic(checkpoint):
    a, b = new_model(checkpoint), new_model(checkpoint)
    init_dummy_weights(a, seed=7)
    init_dummy_weights(b, seed=7)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.isfinite(pa).all() and torch.equal(pa, pb), name
    assert (a.layers[0].mixer.A_log.exp() >= 1.0).all()
