"""The embedded default checkpoint (make-tiny) and the offline LLM API, end to end on CPU."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from deltaserve import LLM, SamplingParams
from deltaserve.errors import EngineStoppedError, RequestValidationError
from deltaserve.tiny import default_model_dir, make_tiny


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return default_model_dir()


@pytest.fixture(scope="module")
def llm(tiny_dir: Path):
    with LLM(str(tiny_dir), dtype="float32", device="cpu", max_num_seqs=8, max_model_len=4096) as engine:
        yield engine


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_make_tiny_writes_the_official_layout_deterministically(tmp_path, tiny_dir):
    out = make_tiny(tmp_path / "again", "tiny", 0)
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert digest(out / name) == digest(tiny_dir / name), name
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and config["text_config"]["model_type"] == "qwen3_5_text"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [248046, 248044]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        assert any(n.startswith("mtp.") for n in names)
        assert all(n.startswith(("model.language_model.", "mtp.")) for n in names)
        norm = f.get_tensor("model.language_model.layers.0.input_layernorm.weight")
        assert norm.float().std() > 0.05  # norm weights are randomised too
    other = make_tiny(tmp_path / "seed1", "tiny", 1)
    assert digest(other / "model.safetensors") != digest(out / "model.safetensors")


WEIGHTS_DIGEST = """
import dataclasses, hashlib, torch
from deltaserve.config import ModelConfig
from deltaserve.tiny import official_config, random_text_weights
cfg = dataclasses.replace(ModelConfig.from_dict(official_config("tiny-moe")), vocab_size=1024)
tensors = random_text_weights(cfg, 5)
h = hashlib.sha256()
for name in sorted(tensors):
    h.update(name.encode() + tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
print(torch.backends.cpu.get_cpu_capability(), h.hexdigest())
"""


def weights_digest(capability: str | None) -> tuple[str, str]:
    """(the CPU kernels torch ran, a digest of make-tiny's weights) from a fresh process forced to
    `capability` (None: the machine's best)."""
    env = dict(os.environ)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    out = subprocess.run(
        [sys.executable, "-c", WEIGHTS_DIGEST], env=env, capture_output=True, text=True, check=True
    )
    kernels, digest_hex = out.stdout.split()
    return kernels, digest_hex


def test_make_tiny_weights_are_the_same_bits_whatever_the_cpu_kernels():
    """torch picks its CPU kernels by the machine's instruction set (ATEN_CPU_CAPABILITY forces one); the
    random weights must not depend on it, or the embedded model differs between machines."""
    runs = [weights_digest(None), weights_digest("default")]
    assert runs[1][0] == "DEFAULT"
    if runs[0][0] == "AVX512":  # x86 machines this one's kernels may differ from: AVX2 too
        runs.append(weights_digest("avx2"))
        assert runs[2][0] == "AVX2"
    assert len({digest_hex for _, digest_hex in runs}) == 1, runs


def test_tiny_moe_preset_loads_and_matches_hf(tmp_path):
    """HF reads our official-layout MoE checkpoint (fused experts, mtp tensors) to the same logits."""
    from transformers import AutoModelForCausalLM

    from deltaserve.engine.core import EngineCore

    out = make_tiny(tmp_path / "moe", "tiny-moe", 3)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt = [9419, 11, 821, 803, 369, 17]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([prompt])).logits[0, -1, :248077].log_softmax(-1)
    from deltaserve.engine_config import EngineConfig

    core = EngineCore(
        EngineConfig(model=str(out), dtype="float32", device="cpu", max_num_seqs=2, max_model_len=256)
    )
    from driver import Driver, StepItem

    seq = core.cache.open()
    ours = (
        Driver(core.backend, core.cache).forward([StepItem(seq, prompt)], all_logits=True)[0].log_softmax(-1)
    )
    assert ours.shape == ref.shape == (248077,)  # logits only over the tokenizer's id space
    assert (ours - ref).abs().max() < 1e-3


def test_generate_returns_one_output_per_prompt_in_order(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(
        ["Hello, my name is", {"prompt_token_ids": [1, 2, 3]}, "The capital of France"], params
    )
    assert [o.prompt for o in outs] == ["Hello, my name is", None, "The capital of France"]
    assert outs[0].prompt_token_ids == llm.tokenizer.encode("Hello, my name is")
    assert outs[1].prompt_token_ids == [1, 2, 3]
    for out in outs:
        completion = out.outputs[0]
        assert len(completion.token_ids) == 6 and completion.finish_reason == "length"
        assert completion.text == llm.tokenizer.decode(completion.token_ids)
        assert all(t < llm.tokenizer.vocab_size for t in completion.token_ids)
    # batching changes nothing: the same prompt alone gives the same tokens
    alone = llm.generate(["The capital of France"], params)[0]
    assert alone.outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_stop_strings_cut_the_text_and_end_the_request(llm):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    full = llm.generate(["Once upon a time"], params)[0].outputs[0]
    # a stop string made of the middle of the greedy text, spanning a token boundary
    stop = full.text[len(full.text) // 3 : len(full.text) // 3 + 3]
    cut = llm.generate(
        ["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop])
    )
    completion = cut[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == full.text[: full.text.index(stop)]


def test_n_completions_per_prompt_each_seeded_by_its_index(llm):
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=3, n=3)
    out = llm.generate(["Hello"], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for j, completion in enumerate(out.outputs):
        alone = llm.generate(
            ["Hello"], SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=3 + j)
        )
        assert alone[0].outputs[0].token_ids == completion.token_ids


def test_invalid_parameters_raise_before_anything_runs(llm):
    with pytest.raises(RequestValidationError, match="temperature"):
        llm.generate(["hi"], SamplingParams(temperature=-0.5))
    with pytest.raises(RequestValidationError, match="prompt_token_ids"):
        llm.generate([{"prompt_token_ids": "abc"}])
    with pytest.raises(RequestValidationError, match=r"n must be an integer in \[1, 128\], got 0"):
        llm.generate(["hi"], SamplingParams(n=0))


def test_work_after_shutdown_raises_at_once_instead_of_waiting_forever(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", max_num_seqs=2, max_model_len=256)
    llm.shutdown()
    outcome: list[BaseException] = []

    def generate() -> None:
        try:
            llm.generate(["hi"], SamplingParams(max_tokens=2))
        except BaseException as exc:  # noqa: BLE001 (the test reads what was raised)
            outcome.append(exc)

    worker = threading.Thread(target=generate, daemon=True)  # the former code waited here for good
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "generate() after shutdown() is still waiting for outputs"
    [exc] = outcome
    assert isinstance(exc, EngineStoppedError) and "LLM shut down" in str(exc), exc
    with pytest.raises(EngineStoppedError, match="start a new one"):
        llm.reset_prefix_cache()


def test_an_llm_dropped_without_shutdown_stops_its_engine_when_collected(tiny_dir):
    def schedulers() -> int:
        return sum(t.name == "deltaserve-scheduler" and t.is_alive() for t in threading.enumerate())

    before = schedulers()
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", max_num_seqs=2, max_model_len=256)
    engine = llm.engine
    assert schedulers() == before + 1
    del llm  # the former code's scheduler thread ran on, holding the model and its pools
    gc.collect()
    assert engine.thread is not None and not engine.thread.is_alive() and schedulers() == before
    assert engine.stopped == "LLM dropped"


def test_cli_generate_runs_on_the_embedded_default():
    result = subprocess.run(
        [sys.executable, "-m", "deltaserve.cli", "generate", "--device", "cpu", "--max-tokens", "4", "Hello"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "weights are RANDOM" in result.stderr and "[4 tokens, finish_reason=length]" in result.stderr


def test_chat_renders_the_template_then_generates(llm):
    messages = [{"role": "user", "content": "Hello"}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (chatted,) = llm.chat(messages, params, chat_template_kwargs={"enable_thinking": False})
    prompt = llm.tokenizer.apply_chat_template(messages, enable_thinking=False)
    assert chatted.prompt == prompt and prompt.endswith("</think>\n\n")
    assert chatted.outputs[0].token_ids == llm.generate([prompt], params)[0].outputs[0].token_ids
    two = llm.chat([messages, [*messages, {"role": "assistant", "content": "Hi"}, *messages]], params)
    assert len(two) == 2 and two[0].outputs[0].token_ids != two[1].outputs[0].token_ids


def test_vllm_llm_arguments_are_taken_as_their_serve_flags(tiny_dir):
    """A vLLM script's LLM(...) arguments: accepted, applied as their alias, or refused as the flag of
    the same name is, before any engine starts; a name neither knows is a TypeError."""
    from deltaserve.errors import ConfigError

    small = {"device": "cpu", "dtype": "float32", "max_model_len": 256, "max_num_seqs": 2}
    compat = {
        "trust_remote_code": True,
        "tokenizer": str(tiny_dir),
        "kv_cache_dtype": "auto",
        "block_size": 32,
        "swap_space": 4,
        "disable_log_stats": True,
        "limit_mm_per_prompt": {"image": 0, "video": 0},
        "enable_prefix_caching": True,
        "mamba_cache_mode": "align",
    }
    with LLM(str(tiny_dir), **small, **compat) as llm:
        assert llm.engine.config.page_size == 32 and llm.engine.config.enable_prefix_caching
        (out,) = llm.generate("Hello", SamplingParams(max_tokens=2, temperature=0))
        assert len(out.outputs[0].token_ids) == 2
    refused = [
        ({"enable_lora": True}, "--enable-lora is not supported"),
        ({"quantization": "fp8"}, "got 'fp8' for an unquantized checkpoint"),
        ({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype must be 'auto'"),
        ({"limit_mm_per_prompt": {"image": 2}}, "--limit-mm-per-prompt must allow no media"),
    ]
    for kwargs, message in refused:
        with pytest.raises(ConfigError, match=message):
            LLM(str(tiny_dir), **small, **kwargs)
    with pytest.raises(TypeError, match=r"unknown engine arguments \['no_such_argument'\]"):
        LLM(str(tiny_dir), **small, no_such_argument=1)


def test_prompt_dicts_take_text_ids_and_a_cache_salt(llm):
    """vLLM's {"prompt": ...} and {"prompt_token_ids": ...} prompts, each with an optional cache_salt:
    a salted request reuses only its own salt's cached prefix."""
    text = "The salted prefix of a tenant's request, long enough to fill several pages of the cache."
    ids = llm.tokenizer.encode(text)
    greedy = SamplingParams(max_tokens=2, temperature=0)
    (a,) = llm.generate({"prompt": text, "cache_salt": "tenant-a"}, greedy)
    longer = ids + llm.tokenizer.encode(" And then the question.")  # resumes at the first prompt's end
    (again,) = llm.generate({"prompt_token_ids": longer, "cache_salt": "tenant-a"}, greedy)
    (other,) = llm.generate({"prompt_token_ids": longer, "cache_salt": "tenant-b"}, greedy)
    assert a.prompt_token_ids == ids and again.prompt_token_ids == other.prompt_token_ids == longer
    assert again.num_cached_tokens == len(ids) and other.num_cached_tokens == 0
    assert again.outputs[0].token_ids == other.outputs[0].token_ids
    for bad, field in (
        ({"prompt": text, "cache_salt": ""}, "cache_salt"),
        ({"prompt": text, "multi_modal_data": {}}, "multi_modal_data"),
    ):
        with pytest.raises(RequestValidationError, match=field):
            llm.generate(bad, greedy)


def test_offline_bad_words_are_tokenized_and_never_completed(llm):
    paris, london = llm.tokenizer.encode(" Paris"), llm.tokenizer.encode(" London")
    assert len(paris) == len(london) == 1
    params = SamplingParams(
        max_tokens=16, temperature=1.0, seed=3, ignore_eos=True, allowed_token_ids=[*paris, *london]
    )
    (free,) = llm.generate("Cities:", params)
    assert paris[0] in free.outputs[0].token_ids
    (banned,) = llm.generate("Cities:", dataclasses.replace(params, bad_words=["Paris"]))
    assert set(banned.outputs[0].token_ids) == set(london)
