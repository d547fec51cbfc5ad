"""The model against HF transformers (fp32, CPU) on random weights, over every replay surface.

Each case: HF prefills a prompt and decodes 8 greedy tokens through its own cache; we replay the same
tokens (teacher-forced) and compare log-probs over the whole vocabulary after the prompt and after
each decoded token. Tolerance: max |delta log-prob| <= 1e-3 and the same greedy token every step.
"""

from __future__ import annotations

import random
from pathlib import Path

import hf_oracle
import pytest
import torch
from engine_harness import Harness

TOL = 1e-3
DECODE_STEPS = 8


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(length)]


class Case:
    """One HF model saved to disk, with its reference log-probs for a few prompts."""

    def __init__(self, root: Path, name: str, *, official: bool = False, fused: bool = True, **kw) -> None:
        self.hf = hf_oracle.build_hf_causal_lm(seed=len(name), **kw)
        self.dir = root / name
        if official:
            hf_oracle.save_official_layout(self.hf, self.dir, fused_experts=fused)
        else:
            hf_oracle.save_text_layout(self.hf, self.dir)
        self._refs: dict[tuple[int, ...], tuple[list[torch.Tensor], list[int]]] = {}

    def reference(self, prompt: list[int]) -> tuple[list[torch.Tensor], list[int]]:
        key = tuple(prompt)
        if key not in self._refs:
            self._refs[key] = hf_oracle.hf_incremental_logprobs(self.hf, prompt, DECODE_STEPS)
        return self._refs[key]


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"{what}: max |delta log-prob| = {diff:.2e} > {TOL}"
    assert int(ours.argmax()) == int(ref.argmax()), f"{what}: greedy token differs"


def replay(h: Harness, case: Case, prompt: list[int], chunk: int, what: str) -> None:
    ref, tokens = case.reference(prompt)
    seq = h.open()
    assert_close(h.prefill(seq, prompt, chunk), ref[0], f"{what} prefill")
    for i, tok in enumerate(tokens):
        assert_close(h.step([(seq, [tok])])[0], ref[i + 1], f"{what} decode step {i}")
    h.cache.release(seq)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf_models")


@pytest.fixture(scope="module")
def dense(root: Path) -> Case:
    return Case(root, "dense", attn_group=2, gdn_group=2, tied=True)


@pytest.mark.parametrize(
    ("attn_group", "gdn_group", "tied"),
    [(1, 1, True), (2, 2, False), (3, 3, True), (2, 3, False)],
)
def test_dense_prefill_and_decode_match_hf_for_head_groupings(root, attn_group, gdn_group, tied):
    case = Case(
        root, f"dense_{attn_group}_{gdn_group}_{tied}", attn_group=attn_group, gdn_group=gdn_group, tied=tied
    )
    replay(Harness(case.dir), case, prompt_of(37, 1), chunk=1000, what="whole prompt")


@pytest.mark.parametrize("chunk", [1, 3, 17, 64, 65])
def test_chunked_prefill_matches_hf_at_every_split(dense, chunk):
    replay(Harness(dense.dir), dense, prompt_of(130, 2), chunk=chunk, what=f"chunk {chunk}")


def test_mixed_batch_of_requests_at_different_phases_matches_hf(dense):
    """One forward holds a decode row, a mid-prompt chunk and a fresh prompt start, all at once."""
    h = Harness(dense.dir)
    prompts = [prompt_of(n, 10 + n) for n in (20, 45, 9)]
    refs = [dense.reference(p) for p in prompts]
    seqs = [h.open() for _ in prompts]
    # Request 0 is fully prefilled, request 1 half, request 2 not at all.
    assert_close(h.step([(seqs[0], prompts[0])])[0], refs[0][0][0], "r0 prefill")
    h.step([(seqs[1], prompts[1][:22])])
    out = h.step([(seqs[0], [refs[0][1][0]]), (seqs[1], prompts[1][22:]), (seqs[2], prompts[2][:5])])
    assert_close(out[0], refs[0][0][1], "r0 decode 0 in mixed step")
    assert_close(out[1], refs[1][0][0], "r1 prefill tail in mixed step")
    out = h.step([(seqs[0], [refs[0][1][1]]), (seqs[1], [refs[1][1][0]]), (seqs[2], prompts[2][5:])])
    assert_close(out[0], refs[0][0][2], "r0 decode 1")
    assert_close(out[1], refs[1][0][1], "r1 decode 0")
    assert_close(out[2], refs[2][0][0], "r2 prefill")
    fed = [2, 1, 0]  # decode tokens each request has consumed
    for _ in range(4):
        out = h.step([(s, [refs[i][1][fed[i]]]) for i, s in enumerate(seqs)])
        fed = [f + 1 for f in fed]
        for i in range(3):
            assert_close(out[i], refs[i][0][fed[i]], f"r{i} decode {fed[i] - 1} in a 3-row decode step")


def test_released_slot_and_pages_are_reused_without_leaking_state(dense):
    """A slot and pages that held a long sequence serve a new one with no trace of the old state."""
    h = Harness(dense.dir, num_slots=2)  # one usable slot: reuse is forced
    replay(h, dense, prompt_of(90, 3), chunk=32, what="first tenant")
    replay(h, dense, prompt_of(30, 4), chunk=7, what="second tenant of the same slot")
    assert h.cache.states.num_free == 1 and h.cache.kv.num_used == 0


@pytest.mark.parametrize("official", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_moe_matches_hf_with_fused_and_per_expert_files(root, official, fused):
    if not official and fused:
        pytest.skip("HF's text save writes per-expert tensors only")
    case = Case(root, f"moe_{official}_{fused}", official=official, fused=fused, moe=True, tied=False)
    replay(Harness(case.dir), case, prompt_of(40, 5), chunk=16, what="moe")


def test_official_layout_with_mtp_and_vision_tensors_matches_hf(root):
    case = Case(root, "official_dense", official=True, attn_group=2, gdn_group=2, tied=False)
    names = hf_oracle.load_file(str(case.dir / "model.safetensors")).keys()
    assert any(n.startswith("mtp.") for n in names) and any(n.startswith("model.visual.") for n in names)
    replay(Harness(case.dir), case, prompt_of(33, 6), chunk=10, what="official layout")
