"""The GPU correctness gate: the engine (GPU kernels, CUDA graphs) against HF transformers on the GPU, same
random weights (norm weights randomised), at the 0.8B and 4B shapes and on the tiny MoE preset (8 experts,
2 per token: the routing and fused-expert kernels, from one row per expert to thousands).

Log-probabilities are compared after the prompt, at sampled prompt positions (every token of a prefill
chunk is the model's output for that position) and after each teacher-forced decode token. Criteria (the
issue's): at every compared position the engine's argmax is within 0.2 nat of the reference's best, and
over the engine's top-8 tokens the mean |delta log-prob| <= 0.06 and the p99 <= 0.2, pooled over the
surface. Every surface runs in two precisions:

- fp32: the engine in float32 against HF float32, on the absolute criteria alone. Rounding noise is small
  here, so any indexing, state or kernel error shows. (The 16-bit-only GEMV is exercised by the kernel
  tests, not here.)
- bf16: the engine in bfloat16 against HF bfloat16. On random weights both sides' rounding noise can exceed
  the tolerance (HF bf16 itself sits 0.16-0.21 nat from fp32 at the 4B shape); then HF fp32 on the same
  tokens decides: the engine must be no further from it than HF bf16 is, with 25% slack: on the mean and
  p99, and for an argmax, which may move only among tokens whose fp32 log-probs lie within HF bf16's own
  p99 error of the best (or within its own pick's distance at that position), or farther where both of
  the engine's errors that moved it (at its pick and at the fp32 best) lie within that p99 error
  (tests/gate_judge.py says why). On the tiny MoE preset a
  bf16 rounding flips top-2 routing decisions, and HF bf16 itself sits ~0.34 nat (mean) and ~3 nat (p99)
  from fp32: an argmax there lands ~3 nat off for HF bf16 as for the engine.

Surfaces: batch of one, batched with padding rows (graph buckets), chunked prefill at odd boundaries, mixed
prefill+decode steps, slot reuse, graphs on and off, and long prompts (4097 and 8192 tokens).
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from driver import Driver, StepItem
from gate_judge import NOISE_SLACK, REGRET, Gate

from deltaserve.cache.device import build_device_caches
from deltaserve.cache.manager import CacheManager
from deltaserve.cache.prefix import PageKeys, extend_page_keys
from deltaserve.config import ModelConfig
from deltaserve.engine.backend import Backend
from deltaserve.engine.cuda_graphs import CudaGraphRunner
from deltaserve.engine.prefill_graphs import PrefillGraphRunner
from deltaserve.engine.worker import ModelWorker
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.model.weights import load_state_dict
from deltaserve.ops.batch import build_forward_batch
from deltaserve.tiny import official_config

DEVICE = torch.device("cuda")
DECODE_STEPS = 8
SAMPLED_POSITIONS = 24  # prompt positions compared per prompt, the last one always among them
PRECISIONS = ("bf16", "fp32")
# The resumed surface's prompt seeds: its shared prefix is prompt_of(203, seed), the two tails seed + 1 and
# seed + 2. DELTASERVE_GATE_RESUMED_SEEDS=7,17,27 runs more of them, to tell a kernel's bias from one
# position's luck where a bf16 surface fails (docs/benchmarks/2026-12-06-h100-moe-slot-gemv.md).
RESUMED_SEEDS = [int(seed) for seed in os.environ.get("DELTASERVE_GATE_RESUMED_SEEDS", "7").split(",")]


OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "down_proj")


@torch.no_grad()
def randomise_(model: torch.nn.Module, seed: int) -> None:
    """Weights with the conditioning of a trained model: linears N(0, 1/fan_in), the projections that
    write into the residual stream scaled by 1/sqrt(2 * layers) (each layer a small update), norm
    weights randomised around their identity values."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    residual_scale = (2 * model.config.num_hidden_layers) ** -0.5
    for name, p in model.named_parameters():
        shape = p.shape
        if name.endswith("A_log"):
            p.copy_(torch.rand(shape, generator=gen, device=DEVICE) * 1.5)
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn(shape, generator=gen, device=DEVICE) * 0.5 + 1.0)
        elif name.endswith("linear_attn.norm.weight"):
            p.copy_(torch.randn(shape, generator=gen, device=DEVICE) * 0.2 + 1.0)
        elif p.dim() == 1:
            p.copy_(torch.randn(shape, generator=gen, device=DEVICE) * 0.2)
        elif "embed_tokens" in name:
            # Tied head: logits = embed . normed hidden (norm ~ sqrt(hidden)); std 0.05 keeps their spread
            # at a few nats, like a trained model's, instead of a distribution peaked by tens of nats.
            p.copy_(torch.randn(shape, generator=gen, device=DEVICE) * 0.05)
        else:
            std = shape[-1] ** -0.5 * (
                residual_scale if name.rsplit(".", 2)[-2] in OUTPUT_PROJECTIONS else 1.0
            )
            p.copy_(torch.randn(shape, generator=gen, device=DEVICE) * std)


def sampled_positions(length: int) -> list[int]:
    """Prompt offsets whose logits are compared: evenly spaced, ending at the last token."""
    stride = max(1, length // SAMPLED_POSITIONS)
    return list(range(length - 1, -1, -stride))[:SAMPLED_POSITIONS][::-1]


@dataclass
class Reference:
    """HF's log-probs for one prompt: at `positions` of the prompt, then after each of `tokens` (HF bf16's
    greedy continuation, teacher-forced into every model). fp32 is computed on the same tokens."""

    positions: list[int]
    tokens: list[int]
    bf16: list[torch.Tensor]
    fp32: list[torch.Tensor]

    def at(self, precision: str, index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the reference, the fp32 truth that judges bf16 noise or None) for compared position `index`."""
        if precision == "fp32":
            return self.fp32[index], None
        return self.bf16[index], self.fp32[index]


class Engine:
    """The engine's model in one precision, its caches, its decode and prefill graphs."""

    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.model = Qwen35ForCausalLM(config, dtype=dtype, device=DEVICE)
        load_state_dict(self.model, state_dict, "HF model")
        self.caches = build_device_caches(
            config, num_pages=2048, page_size=16, num_slots=9, dtype=dtype, device=DEVICE, num_snapshots=4
        )
        self.cache = CacheManager.for_device(self.caches)
        self.graphs = CudaGraphRunner(self.model, self.caches, max_num_seqs=8, max_model_len=9000)
        self.graphs.capture()
        self.prefill_graphs = PrefillGraphRunner(self.model, self.caches, 8, 512, 9000, pool=self.graphs.pool)

    def backend(self, graphs: bool) -> Driver:
        """With `graphs`, steps run in the decode graphs and (through `forward`) the prefill graphs."""
        worker = (
            ModelWorker(self.model, self.caches, self.graphs, self.prefill_graphs)
            if graphs
            else ModelWorker(self.model, self.caches)
        )
        return Driver(Backend(self.model, self.caches, worker=worker), self.cache)


class Pair:
    """HF bf16 and fp32 models and the engine in each precision, all with the same weights."""

    def __init__(self, preset: str, seed: int = 0) -> None:
        import transformers

        text = official_config(preset)["text_config"]
        family = "Qwen3_5Moe" if text["model_type"] == "qwen3_5_moe_text" else "Qwen3_5"
        model_class = getattr(transformers, f"{family}ForCausalLM")
        config_class = getattr(transformers, f"{family}TextConfig")
        hf_cfg = config_class(**{k: v for k, v in text.items() if k not in ("model_type", "dtype")})
        with torch.device(DEVICE):
            self.hf = model_class(hf_cfg).to(torch.bfloat16).eval()
        randomise_(self.hf, seed)
        with torch.device(DEVICE):
            self.hf32 = model_class(hf_cfg).eval()
        self.hf32.load_state_dict({k: v.float() for k, v in self.hf.state_dict().items()})
        self._config = ModelConfig.from_dict(official_config(preset))
        self._engines: dict[str, Engine] = {}
        self._references: dict[tuple[tuple[int, ...], tuple[int, ...]], Reference] = {}

    def engine(self, precision: str) -> Engine:
        """The engine in `precision` ("bf16" or "fp32"), built at its first use: a run of one precision's
        cases (`-k bf16`) builds, compiles and captures that one alone."""
        if precision not in self._engines:
            hf, dtype = (self.hf, torch.bfloat16) if precision == "bf16" else (self.hf32, torch.float32)
            self._engines[precision] = Engine(self._config, hf.state_dict(), dtype)
        return self._engines[precision]

    @torch.no_grad()
    def reference(self, prompt: list[int], positions: Sequence[int] | None = None) -> Reference:
        """HF's log-probs for `prompt` at `positions` (None: sampled_positions) and its decode steps."""
        positions = sampled_positions(len(prompt)) if positions is None else list(positions)
        key = (tuple(prompt), tuple(positions))
        if key not in self._references:
            bf16, tokens = self._incremental(self.hf, prompt, positions, None)
            fp32, _ = self._incremental(self.hf32, prompt, positions, tokens)
            self._references[key] = Reference(positions, tokens, bf16, fp32)
        return self._references[key]

    @staticmethod
    def _incremental(
        model, prompt: list[int], positions: list[int], forced: list[int] | None, steps: int = DECODE_STEPS
    ) -> tuple[list[torch.Tensor], list[int]]:
        out = model(input_ids=torch.tensor([prompt], device=DEVICE), use_cache=True)
        logprobs = list(out.logits[0, positions].float().log_softmax(-1))
        tokens: list[int] = []
        past = out.past_key_values
        for step in range(steps):
            tokens.append(forced[step] if forced else int(logprobs[-1].argmax()))
            ids = torch.tensor([[tokens[-1]]], device=DEVICE)
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logprobs.append(out.logits[0, -1].float().log_softmax(-1))
        return logprobs, tokens


@torch.inference_mode()
def prefill_logits_at(backend: Driver, items: Sequence[StepItem], wanted: Sequence[Sequence[int]]):
    """The backend's eager path (the one every prefill row takes), returning logits at chosen token
    offsets of each item rather than only the last: [sum(len(w) for w in wanted), vocab], item order."""
    rows = backend.rows(items)
    batch = build_forward_batch(rows, backend.caches.page_size, backend.device)
    starts = batch.query_start_loc.tolist()
    index = [starts[i] + offset for i, offsets in enumerate(wanted) for offset in offsets]
    batch = dataclasses.replace(
        batch, logits_indices=torch.tensor(index, dtype=torch.int64, device=backend.device)
    )
    logits = backend.model.compute_logits(backend.model(batch, backend.caches.kv, backend.caches.states))
    backend.advance(items)
    return logits


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(248044) for _ in range(length)]


def replay(
    pair: Pair, precision: str, graphs: bool, prompts: list[list[int]], chunk: int, gate: Gate
) -> None:
    """Prefills every prompt (in chunks, all sequences in each step), comparing the sampled prompt
    positions, then decodes all of them together teacher-forced on HF's greedy tokens."""
    engine = pair.engine(precision)
    backend = engine.backend(graphs)
    refs = [pair.reference(p) for p in prompts]
    seqs = [engine.cache.open() for _ in prompts]
    done = [0] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
        items, wanted, owners = [], [], []
        for i, p in enumerate(prompts):
            if done[i] < len(p):
                end = min(len(p), done[i] + chunk)
                items.append(StepItem(seqs[i], p[done[i] : end]))
                compared = [k for k, pos in enumerate(refs[i].positions) if done[i] <= pos < end]
                wanted.append([refs[i].positions[k] - done[i] for k in compared])
                owners.append((i, compared))
                done[i] = end
        logits = iter(prefill_logits_at(backend, items, wanted))
        for i, compared in owners:
            for k in compared:
                where = f"prompt {i} position {refs[i].positions[k]}"
                gate.check(next(logits), *refs[i].at(precision, k), where)
    decode_teacher_forced(backend, precision, refs, seqs, gate)
    for seq in seqs:
        engine.cache.release(seq)


def decode_teacher_forced(
    backend: Driver, precision: str, refs: list[Reference], seqs: list, gate: Gate
) -> None:
    """Every sequence decodes together, each step fed HF's greedy token."""
    for step in range(DECODE_STEPS):
        items = [StepItem(seqs[i], [refs[i].tokens[step]]) for i in range(len(refs))]
        logits = backend.forward(items, all_logits=True)
        for i, ref in enumerate(refs):
            gate.check(logits[i], *ref.at(precision, len(ref.positions) + step), f"prompt {i} decode {step}")


@pytest.fixture(scope="module", params=["0.8b-shape", "4b-shape", "tiny-moe"])
def pair(request) -> Pair:
    p = Pair(request.param)
    yield p
    del p
    torch.cuda.empty_cache()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("graphs", [True, False])
def test_batch_of_one(pair, precision, graphs):
    gate = Gate(f"{precision} batch of one, graphs={graphs}")
    replay(pair, precision, graphs, [prompt_of(37, 1)], chunk=10_000, gate=gate)
    gate.finish()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("graphs", [True, False])
def test_batched_with_padding_rows(pair, precision, graphs):
    """Five sequences decode together: the graph bucket is 8, three padding rows."""
    gate = Gate(f"{precision} batch of five, graphs={graphs}")
    prompts = [prompt_of(n, n) for n in (5, 33, 64, 100, 17)]
    replay(pair, precision, graphs, prompts, chunk=10_000, gate=gate)
    gate.finish()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("chunk", [17, 65])
def test_chunked_prefill_at_odd_boundaries(pair, precision, chunk):
    gate = Gate(f"{precision} chunk {chunk}")
    replay(pair, precision, True, [prompt_of(300, 2), prompt_of(140, 3)], chunk=chunk, gate=gate)
    gate.finish()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_mixed_prefill_and_decode_steps_and_slot_reuse(pair, precision):
    gate = Gate(f"{precision} mixed steps + slot reuse")
    engine = pair.engine(precision)
    backend, cache = engine.backend(True), engine.cache
    a, b = prompt_of(50, 4), prompt_of(90, 5)
    ref_a, ref_b = pair.reference(a), pair.reference(b)
    last_a, last_b = len(ref_a.positions) - 1, len(ref_b.positions) - 1
    # occupy and release slots first, so the sequences below reuse dirty slots
    for _ in range(3):
        tmp = cache.open()
        backend.forward([StepItem(tmp, prompt_of(40, 9))], all_logits=True)
        cache.release(tmp)
    sa, sb = cache.open(), cache.open()
    out = backend.forward([StepItem(sa, a)], all_logits=True)
    gate.check(out[0], *ref_a.at(precision, last_a), "a prefill")
    out = backend.forward([StepItem(sa, [ref_a.tokens[0]]), StepItem(sb, b[:45])], all_logits=True)
    gate.check(out[0], *ref_a.at(precision, last_a + 1), "a decode 0 with b's first chunk")
    out = backend.forward([StepItem(sa, [ref_a.tokens[1]]), StepItem(sb, b[45:])], all_logits=True)
    gate.check(out[0], *ref_a.at(precision, last_a + 2), "a decode 1 with b's last chunk")
    gate.check(out[1], *ref_b.at(precision, last_b), "b prefill (mixed)")
    for step in range(2, DECODE_STEPS):
        items = [StepItem(sa, [ref_a.tokens[step]]), StepItem(sb, [ref_b.tokens[step - 2]])]
        out = backend.forward(items, all_logits=True)
        gate.check(out[0], *ref_a.at(precision, last_a + step + 1), f"a decode {step}")
        gate.check(out[1], *ref_b.at(precision, last_b + step - 1), f"b decode {step - 2}")
    cache.release(sa)
    cache.release(sb)
    gate.finish()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("length", [4097, 8192])
def test_long_prompts(pair, precision, length):
    gate = Gate(f"{precision} long prompt {length}")
    replay(pair, precision, True, [prompt_of(length, length)], chunk=2048, gate=gate)
    gate.finish()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("seed", RESUMED_SEEDS)
def test_resumed_from_the_prefix_cache(pair, precision, graphs, seed):
    """A prompt sharing 203 tokens (a boundary inside a page of 16) with an earlier one resumes from its
    cached KV pages and GDN state snapshot: its logits at every position after the boundary and its
    decode steps match HF's over the whole prompt. (Every position, not the sampled ones: 68 compared
    positions instead of 14 keep the bf16 p99 out of run-to-run noise.)"""
    gate = Gate(f"{precision} resumed from the prefix cache, graphs={graphs}, seed {seed}")
    engine = pair.engine(precision)
    backend, cache = engine.backend(graphs), engine.cache
    boundary = 203
    shared = prompt_of(boundary, seed)
    a, b = shared + prompt_of(40, seed + 1), shared + prompt_of(60, seed + 2)
    ref = pair.reference(b, positions=range(boundary, len(b)))
    keys_a = PageKeys()
    extend_page_keys(keys_a, a, cache.page_size)
    sa = cache.open()
    backend.forward([StepItem(sa, a[:boundary])])
    saved = cache.save(sa, keys_a, a, boundary, donate=False)
    engine.caches.copy(saved.copies)
    cache.launched(saved)
    backend.forward([StepItem(sa, a[boundary:])])  # a goes on writing past the boundary
    cache.register_pages(sa, keys_a)
    cache.release(sa)
    keys_b = PageKeys()
    extend_page_keys(keys_b, b, cache.page_size)
    hit = cache.lookup(keys_b, b, len(b) - 1)
    assert hit is not None and hit.position == boundary
    sb = cache.open_hit(hit)
    restore = cache.take_pending()
    engine.caches.copy(restore.copies)
    cache.launched(restore)
    compared = [k for k, pos in enumerate(ref.positions) if pos >= boundary]
    logits = prefill_logits_at(
        backend, [StepItem(sb, b[boundary:])], [[ref.positions[k] - boundary for k in compared]]
    )
    for row, k in zip(logits, compared, strict=True):
        gate.check(row, *ref.at(precision, k), f"position {ref.positions[k]}")
    for step in range(DECODE_STEPS):
        out = backend.forward([StepItem(sb, [ref.tokens[step]])])
        gate.check(out[0], *ref.at(precision, len(ref.positions) + step), f"decode {step}")
    cache.release(sb)
    cache.reset_prefix_cache()
    gate.finish()


LOOP_RUN = 8  # a single token repeated more often than this is a loop, unless HF would repeat it too
CLEARLY_WORSE = 1.0  # nat below HF fp32's best: beyond the dense shapes' bf16 noise (gate p99 <= 0.7)


def picks_regret(logprobs: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """How far below the best of each row of `logprobs` (the judge's) each row's pick lies, in nat."""
    return logprobs.max(-1).values - logprobs[torch.arange(len(picks), device=picks.device), picks]


def free_run_failures(ours: torch.Tensor, hf: torch.Tensor) -> list[str]:
    """Judges the engine's free-running picks (`ours`: each pick's regret under HF fp32, pooled over the
    runs) against HF bf16's picks on the same prefixes, decoded as the engine decodes them: one token
    at a time over its cache (`hf`, the same positions). Where HF bf16 keeps
    every pick within CLEARLY_WORSE (the dense shapes), so must the engine. Where it does not (routing
    flips of the MoE preset: HF bf16's own free runs there reach 2-4 nat), single picks are noise, and
    the engine may be at most NOISE_SLACK times as often clearly worse (plus two picks) and as far off on
    average (plus 0.05 nat): a bug is wrong at most positions, a flip at a few."""
    if float(hf.max()) <= CLEARLY_WORSE:
        worst = float(ours.max())
        return [] if worst <= CLEARLY_WORSE else [f"a pick {worst:.3f} nat below HF fp32's best"]
    failures = []
    ours_n, hf_n = int((ours > CLEARLY_WORSE).sum()), int((hf > CLEARLY_WORSE).sum())
    if ours_n > NOISE_SLACK * hf_n + 2:
        failures.append(f"{ours_n} of {len(ours)} picks clearly worse against HF bf16's {hf_n}")
    ours_mean, hf_mean = float(ours.mean()), float(hf.mean())
    if ours_mean > NOISE_SLACK * hf_mean + 0.05:
        failures.append(f"mean regret {ours_mean:.3f} nat against HF bf16's {hf_mean:.3f}")
    return failures


def test_free_running_greedy_does_not_collapse_into_a_token_loop(pair):
    """Degenerate-output detector: the engine's free-running greedy continuations, judged by HF fp32 on the
    engine's own prefix at every step, with HF bf16's picks on the same prefixes as the noise level
    (free_run_failures). HF bf16 decodes those prefixes as the engine does, one token at a time over its
    cache, so the noise level is that of the same computation (a whole-sequence forward would take the
    chunked kernels instead). A run of one token longer than LOOP_RUN is allowed only where HF fp32 picks that
    token at every step of the run (random tied-embedding models do repeat tokens; bf16 noise can lead to
    a different, legitimate trajectory)."""
    engine = pair.engine("bf16")
    backend = engine.backend(True)
    ours_regrets, hf_regrets, runs = [], [], []
    for seed in range(3):
        prompt = prompt_of(24, 100 + seed)
        seq = engine.cache.open()
        logits = backend.forward([StepItem(seq, prompt)], all_logits=True)[0]
        ours: list[int] = []
        for _ in range(48):
            ours.append(int(logits.argmax()))
            logits = backend.forward([StepItem(seq, [ours[-1]])], all_logits=True)[0]
        engine.cache.release(seq)
        ids = torch.tensor([prompt + ours], device=DEVICE)
        with torch.no_grad():
            logprobs = pair.hf32(input_ids=ids).logits[0, 23:-1].float().log_softmax(-1)
            hf_steps, _ = Pair._incremental(pair.hf, prompt, [len(prompt) - 1], ours[:-1], len(ours) - 1)
        hf_picks = torch.stack(hf_steps).argmax(-1)
        ours_regrets.append(picks_regret(logprobs, torch.tensor(ours, device=DEVICE)))
        hf_regrets.append(picks_regret(logprobs, hf_picks))
        regrets = ours_regrets[-1].tolist()
        runs.append(
            (seed, ours, [round(r, 3) for r in regrets], [round(r, 3) for r in hf_regrets[-1].tolist()])
        )
        run_start = 0
        for t in range(1, len(ours) + 1):
            if t == len(ours) or ours[t] != ours[run_start]:
                run = range(run_start, t)
                if len(run) > LOOP_RUN:
                    assert all(regrets[i] <= REGRET for i in run), (seed, ours, run, regrets)
                run_start = t
    failures = free_run_failures(torch.cat(ours_regrets), torch.cat(hf_regrets))
    assert not failures, (failures, runs)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_prefill_steps_in_the_prefill_graphs(pair, precision):
    """Both prompts prefill through the step path, every step ending each prompt's chunk at its next
    compared position (chunks of 1..13 tokens beside each other), so each step runs a prefill graph."""
    gate = Gate(f"{precision} prefill graphs")
    engine = pair.engine(precision)
    backend = engine.backend(True)
    prompts = [prompt_of(300, 2), prompt_of(140, 3)]
    refs = [pair.reference(p) for p in prompts]
    seqs = [engine.cache.open() for _ in prompts]
    done, compared = [0, 0], [0, 0]
    while any(k < len(r.positions) for k, r in zip(compared, refs, strict=True)):
        items, owners = [], []
        for i, prompt in enumerate(prompts):
            k = compared[i]
            if k < len(refs[i].positions):
                end = refs[i].positions[k] + 1
                items.append(StepItem(seqs[i], prompt[done[i] : end]))
                owners.append((i, k))
                done[i], compared[i] = end, k + 1
        logits = backend.forward(items, all_logits=True)
        for row, (i, k) in enumerate(owners):
            gate.check(logits[row], *refs[i].at(precision, k), f"prompt {i} position {refs[i].positions[k]}")
    assert engine.prefill_graphs.graphs and not engine.prefill_graphs.failed, "the steps ran eager"
    decode_teacher_forced(backend, precision, refs, seqs, gate)
    for seq in seqs:
        engine.cache.release(seq)
    gate.finish()
