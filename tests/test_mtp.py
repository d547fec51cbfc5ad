"""The checkpoint's MTP head: loading, its math against HF transformers' layer, its KV layer, and the
rank's caches and memory plan with speculative decoding on."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deltaserve.cache.device import build_device_caches
from deltaserve.config import ModelConfig
from deltaserve.engine.rank import build_rank, verify_scratch_slots
from deltaserve.engine_config import EngineConfig, SpeculativeConfig
from deltaserve.errors import ConfigError
from deltaserve.model.layers.parallel import SINGLE, TensorParallel
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.model.weights import checkpoint_has_mtp, init_dummy_weights, load_weights
from deltaserve.ops.batch import BatchRow, build_forward_batch
from deltaserve.tiny import default_model_dir, make_tiny

CPU = torch.device("cpu")
TOKENIZER_VOCAB = 248077
PAGE = 4
PREFILL = 20
DECODE_STEPS = 3


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {"tiny": default_model_dir(), "tiny-moe": make_tiny(tmp_path_factory.mktemp("moe"), "tiny-moe", 5)}


@pytest.fixture(scope="module")
def models(dirs: dict[str, Path]) -> dict[str, Qwen35ForCausalLM]:
    """Each tiny preset loaded in fp32 with its MTP head."""
    return {preset: load(path, mtp=True) for preset, path in dirs.items()}


def load(model_dir: Path, *, mtp: bool) -> Qwen35ForCausalLM:
    model = Qwen35ForCausalLM(ModelConfig.from_dir(model_dir), dtype=torch.float32, device=CPU, mtp=mtp)
    load_weights(model, model_dir)
    return model


def rewrite(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint `src` whose tensors went through `edit(dict)`."""
    dst.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, dst / name)
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def drop_mtp(tensors: dict[str, torch.Tensor]) -> None:
    for name in [n for n in tensors if n.startswith("mtp.")]:
        del tensors[name]


def mtp_specs(model: Qwen35ForCausalLM):
    """(name, target) of every official-layout MTP tensor the model declares."""
    for req in model.weight_requirements():
        for spec in req.alternatives[0]:
            if spec.name.startswith("mtp."):
                yield spec.name, spec.target


def caches_for(model: Qwen35ForCausalLM, num_kv_layers: int | None = None):
    return build_device_caches(
        model.config,
        num_pages=16,
        page_size=PAGE,
        num_slots=4,
        dtype=torch.float32,
        device=CPU,
        num_kv_layers=model.num_kv_layers if num_kv_layers is None else num_kv_layers,
    )


def batch_of(tokens: list[int], context: int, pages: list[int]):
    return build_forward_batch([BatchRow(tokens, context, pages, state_slot=1)], PAGE, CPU)


# ---- loading ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_tiny_checkpoint_loads_every_mtp_tensor_as_written(dirs, models, preset):
    model = models[preset]
    assert model.mtp is not None and model.num_kv_layers == len(model.config.full_attention_layers) + 1
    with safe_open(str(dirs[preset] / "model.safetensors"), "pt") as f:
        written = {n for n in f.keys() if n.startswith("mtp.")}  # noqa: SIM118 - not a mapping
        specs = dict(mtp_specs(model))
        assert written == set(specs)  # a complete official head, nothing else under mtp.
        for name, target in specs.items():
            assert torch.equal(target, f.get_tensor(name).float()), name
        assert f.get_tensor("mtp.pre_fc_norm_embedding.weight").float().std() > 0.05  # norms random too
    mlp = "mlp.experts.gate_up_proj" if preset == "tiny-moe" else "mlp.gate_proj.weight"
    assert f"mtp.layers.0.{mlp}" in specs  # the main layers' MLP kind, under mtp.layers.0.


def test_without_the_head_mtp_tensors_are_ignored(dirs):
    model = load(dirs["tiny"], mtp=False)
    assert model.mtp is None and model.num_kv_layers == len(model.config.full_attention_layers)
    assert not any("mtp" in name for name, _ in model.named_parameters())


def test_model_mtp_prefix_variant_loads_the_same_head(dirs, models, tmp_path):
    def rename(tensors):
        for name in [n for n in tensors if n.startswith("mtp.")]:
            tensors["model." + name] = tensors.pop(name)

    variant = rewrite(dirs["tiny"], tmp_path / "variant", rename)
    assert checkpoint_has_mtp(variant)
    model = load(variant, mtp=True)
    for (name, ours), (_, ref) in zip(mtp_specs(model), mtp_specs(models["tiny"]), strict=True):
        assert torch.equal(ours, ref), name


def test_checkpoint_without_mtp_tensors_refuses_the_head_by_name(dirs, tmp_path):
    bare = rewrite(dirs["tiny"], tmp_path / "bare", drop_mtp)
    assert not checkpoint_has_mtp(bare) and checkpoint_has_mtp(dirs["tiny"])
    model = Qwen35ForCausalLM(ModelConfig.from_dir(bare), dtype=torch.float32, device=CPU, mtp=True)
    with pytest.raises(
        ConfigError,
        match=r"the checkpoint has no MTP weights \(mtp\.\*\); --speculative-config method 'mtp' needs "
        r"them \(missing: mtp\.fc\.weight, mtp\.pre_fc_norm_embedding\.weight",
    ):
        load_weights(model, bare)
    load_weights(Qwen35ForCausalLM(ModelConfig.from_dir(bare), dtype=torch.float32, device=CPU), bare)


def test_checkpoint_has_mtp_reads_a_sharded_index_without_its_files(tmp_path):
    def index(names: list[str]) -> Path:
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        out.mkdir()
        weight_map = {n: "model-00001-of-00002.safetensors" for n in names}  # shard files absent
        (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        return out

    assert checkpoint_has_mtp(index(["model.language_model.norm.weight", "mtp.fc.weight"]))
    assert not checkpoint_has_mtp(index(["model.language_model.norm.weight", "lm_head.weight"]))


@pytest.mark.parametrize("layers", [0, 2])
def test_mtp_layer_counts_other_than_one_are_refused(dirs, layers):
    cfg = dataclasses.replace(ModelConfig.from_dir(dirs["tiny"]), mtp_num_hidden_layers=layers)
    expected = (
        r"the checkpoint has no MTP head \(mtp_num_hidden_layers is 0\); speculative decoding with "
        r"method 'mtp' needs one"
        if layers == 0
        else r"mtp_num_hidden_layers must be 1 \(.*\), got 2"
    )
    with pytest.raises(ConfigError, match=expected):
        Qwen35ForCausalLM(cfg, dtype=torch.float32, device=torch.device("meta"), mtp=True)
    Qwen35ForCausalLM(cfg, dtype=torch.float32, device=torch.device("meta"))  # no head asked: fine


def test_mtp_head_under_tensor_parallelism_is_refused(dirs):
    cfg = ModelConfig.from_dir(dirs["tiny"])
    with pytest.raises(ConfigError, match=r"MTP head runs on one rank only, got --tensor-parallel-size 2"):
        Qwen35ForCausalLM(
            cfg, dtype=torch.float32, device=torch.device("meta"), tp=TensorParallel(0, 2), mtp=True
        )


def test_dummy_weights_fill_the_mtp_head_deterministically(dirs):
    cfg = ModelConfig.from_dir(dirs["tiny"])
    a, b = (Qwen35ForCausalLM(cfg, dtype=torch.float32, device=CPU, mtp=True) for _ in range(2))
    plain = Qwen35ForCausalLM(cfg, dtype=torch.float32, device=CPU)
    for model in (a, b, plain):
        init_dummy_weights(model, seed=7)
    for (name, pa), (_, pb) in zip(mtp_specs(a), mtp_specs(b), strict=True):
        assert torch.isfinite(pa).all() and torch.equal(pa, pb), name
        assert pa.std() > 0.01, name  # filled, norms included
    # The main model's dummy weights do not depend on whether the head exists.
    assert torch.equal(a.layers[3].mixer.qkv_proj, plain.layers[3].mixer.qkv_proj)
    assert not torch.equal(a.mtp.layer.mixer.qkv_proj, a.layers[3].mixer.qkv_proj)


# ---- the forward ------------------------------------------------------------------------------------


def test_every_token_forward_returns_all_rows_and_the_default_path_its_logits_rows(models):
    model = models["tiny"]
    tokens = list(range(1000, 1000 + 11))
    batch = batch_of(tokens, 0, [1, 2, 3])
    a, b = caches_for(model), caches_for(model)
    with torch.inference_mode():
        last = model(batch, a.kv, a.states)
        every = model(batch, b.kv, b.states, every_token=True)
    assert every.shape == (len(tokens), model.config.hidden_size)
    assert torch.allclose(every[batch.logits_indices], last, atol=1e-6, rtol=0)


def test_main_forward_never_writes_the_mtp_kv_layer_and_the_mtp_step_writes_only_it(models):
    model = models["tiny"]
    caches = caches_for(model)
    kv, states = caches.kv, caches.states
    tokens = list(range(2000, 2000 + PREFILL))
    pages = [1, 2, 3, 4, 5]
    batch = batch_of(tokens, 0, pages)
    written = batch.slot_mapping
    with torch.inference_mode():
        hidden = model(batch, kv, states, every_token=True)
        last = model.mtp_kv_index
        assert last == kv.k.shape[0] - 1
        assert not kv.k[last].any() and not kv.v[last].any()
        main_k, main_v = kv.k[:last].clone(), kv.v[:last].clone()
        conv, ssm = states.conv.clone(), states.ssm.clone()
        model.mtp_forward(torch.tensor(tokens[1:] + [7]), hidden, batch, kv)
    assert torch.equal(kv.k[:last], main_k) and torch.equal(kv.v[:last], main_v)
    assert torch.equal(states.conv, conv) and torch.equal(states.ssm, ssm)
    for cache in (kv.k[last], kv.v[last]):
        flat = cache.reshape(-1, *cache.shape[2:])
        assert flat[written].abs().amax(dim=(1, 2)).gt(0).all()  # every token's row written
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[written] = False
        assert not flat[untouched].any()  # nothing else


def test_mtp_forward_without_the_head_is_an_error(dirs):
    model = Qwen35ForCausalLM(ModelConfig.from_dir(dirs["tiny"]), dtype=torch.float32, device=CPU)
    batch = batch_of([1, 2], 0, [1])
    with pytest.raises(RuntimeError, match="needs the MTP head"):
        model.mtp_forward(torch.tensor([2, 3]), torch.zeros(2, model.config.hidden_size), batch, None)


class HfMtpReference:
    """The MTP step from HF transformers' own Qwen3.5 classes: its RMSNorm for the four mtp norms, its
    decoder layer (full attention, dense MLP or MoE block) and its rotary embedding, over one whole
    sequence with a causal mask; fc, the concat and the embedding lookup in plain torch."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir).get_text_config()
        config._attn_implementation = "eager"
        moe = config.model_type == "qwen3_5_moe_text"
        if moe:
            from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf
        else:
            from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
        prefix = "Qwen3_5Moe" if moe else "Qwen3_5"
        tensors = {k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
        layer_idx = config.layer_types.index("full_attention")
        self.layer = getattr(hf, f"{prefix}DecoderLayer")(config, layer_idx).eval()
        head = "mtp.layers.0."
        state = {k[len(head) :]: v for k, v in tensors.items() if k.startswith(head)}
        self.layer.load_state_dict(state, strict=True)
        norm_cls = getattr(hf, f"{prefix}RMSNorm")
        self.norms = {}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            norm = norm_cls(config.hidden_size, eps=config.rms_norm_eps).eval()
            norm.load_state_dict({"weight": tensors[f"mtp.{name}.weight"]})
            self.norms[name] = norm
        self.rotary = getattr(hf, f"{prefix}TextRotaryEmbedding")(config)
        self.fc = tensors["mtp.fc.weight"]
        self.embed = tensors["model.language_model.embed_tokens.weight"]

    @torch.no_grad()
    def __call__(self, next_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        n = next_tokens.shape[0]
        emb = self.norms["pre_fc_norm_embedding"](self.embed[next_tokens])
        x = torch.cat([emb, self.norms["pre_fc_norm_hidden"](hidden)], dim=-1) @ self.fc.T
        x = x[None]
        cos_sin = self.rotary(x, torch.arange(n)[None])
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.layer(x, position_embeddings=cos_sin, attention_mask=mask)
        out = out[0] if isinstance(out, tuple) else out
        return self.norms["norm"](out)[0]


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_mtp_forward_matches_hf_layer_over_prefill_and_paged_decode_steps(dirs, models, preset):
    """A 20-token prefill, then 3 single-token steps that read the MTP layer's own KV from the pages."""
    model = models[preset]
    total = PREFILL + DECODE_STEPS
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, TOKENIZER_VOCAB, (total + 1,), generator=gen)
    next_tokens = tokens[1:]  # row i drafts from token i+1 and the target's hidden at i
    hidden = torch.randn(total, model.config.hidden_size, generator=gen)
    ref = HfMtpReference(dirs[preset])(next_tokens, hidden)

    caches = caches_for(model)
    pages = [3, 1, 6, 2, 5, 4]  # scattered, covers 24 positions
    ids = tokens[:total].tolist()
    with torch.inference_mode():
        batch = batch_of(ids[:PREFILL], 0, pages)
        outs = [model.mtp_forward(next_tokens[:PREFILL], hidden[:PREFILL], batch, caches.kv)]
        for i in range(PREFILL, total):
            batch = batch_of(ids[i : i + 1], i, pages)
            outs.append(model.mtp_forward(next_tokens[i : i + 1], hidden[i : i + 1], batch, caches.kv))
    ours = torch.cat(outs)
    diff = (ours - ref).abs().max().item()
    assert diff < 2e-5 * ref.abs().max().item(), f"max |delta| {diff:.2e}"
    # The draft logits: the shared lm_head over the MTP hidden.
    logits = model.compute_logits(ours[-1:])
    assert logits.shape == (1, model.logits_vocab_size)


# ---- the rank: caches and memory plan ---------------------------------------------------------------


def engine_config(model_dir: Path, spec: SpeculativeConfig | None, **kw) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        max_num_seqs=4,
        kv_cache_memory_gb=0.01,
        enable_prefix_caching=False,
        speculative_config=spec,
        **kw,
    )


def build(config: EngineConfig, model_dir: Path):
    return build_rank(config, model_dir, ModelConfig.from_dir(model_dir), TOKENIZER_VOCAB, SINGLE)


def test_verify_scratch_slots_are_max_batch_times_draft_length(dirs):
    assert verify_scratch_slots(engine_config(dirs["tiny"], None)) == 0
    spec = SpeculativeConfig(num_speculative_tokens=3, max_batch=5)
    assert verify_scratch_slots(engine_config(dirs["tiny"], spec)) == 15


def test_speculative_rank_adds_the_mtp_kv_layer_and_scratch_slots_to_its_pools(dirs, caplog):
    cfg = ModelConfig.from_dir(dirs["tiny"])
    page_bytes = 2 * cfg.num_key_value_heads * cfg.head_dim * 4 * 16  # one fp32 layer, 16-token pages
    budget = 0.01 * 2**30
    plain = build(engine_config(dirs["tiny"], None), dirs["tiny"])
    assert plain.model.mtp is None
    assert plain.caches.kv.k.shape[0] == 2 and plain.caches.states.num_slots == 4 + 1
    assert plain.caches.kv.num_pages == int(budget // (2 * page_bytes)) + 1

    spec = SpeculativeConfig(num_speculative_tokens=2, max_batch=3)
    with caplog.at_level(logging.INFO, logger="deltaserve.engine.rank"):
        rank = build(engine_config(dirs["tiny"], spec), dirs["tiny"])
    assert rank.model.mtp is not None
    assert rank.caches.kv.k.shape[0] == 3 == rank.model.num_kv_layers  # the MTP layer is the last
    assert rank.caches.states.num_slots == 4 + 1 + 6  # scratch slots 5..10 at the end
    assert rank.caches.kv.num_pages == int(budget // (3 * page_bytes)) + 1  # pages hold the extra layer
    logged = [r.getMessage() for r in caplog.records if "MTP head" in r.getMessage()]
    assert (
        len(logged) == 1 and "KV layer 2" in logged[0] and "6 verify scratch state slots (5..10" in logged[0]
    )


def test_speculative_rank_refuses_a_checkpoint_without_mtp_weights_unless_dummy(dirs, tmp_path):
    bare = rewrite(dirs["tiny"], tmp_path / "bare", drop_mtp)
    spec = SpeculativeConfig()
    with pytest.raises(
        ConfigError, match=r"bare: the checkpoint has no MTP weights \(mtp\.\*\); --speculative"
    ):
        build(engine_config(bare, spec), bare)
    rank = build(engine_config(bare, spec, load_format="dummy"), bare)
    assert rank.model.mtp is not None and rank.model.mtp.fc.std() > 0
