"""Start-up warm-up (GPU only): forwards at the shapes serving will use, and every stage of the
sampler, before the KV pool is sized.

Every Triton kernel compiles and autotunes here, never on a user request, and the activation peak is
measured for the memory plan. The forwards write only the reserved page and slot. Kernels that need no
compiling still load on their first launch in the process (CUDA's lazy loading), and a load waits for
all work queued on the device: under load, a stall for every running request. Hence the sampler too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from deltaserve.cache.device import DeviceCaches
from deltaserve.cache.kv_pages import DUMMY_PAGE
from deltaserve.cache.state_slots import DUMMY_SLOT
from deltaserve.engine.cuda_graphs import graph_buckets
from deltaserve.engine.penalty_counts import PenaltyCounts, PenaltyReset
from deltaserve.engine.sampler import Sampler, SamplingRow
from deltaserve.engine.step import sample_and_stage
from deltaserve.model.layers.attention import GatedAttention
from deltaserve.model.layers.gdn import GatedDeltaNet
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.ops import fresh_attention, gated_rms_norm
from deltaserve.ops.batch import BatchRow, build_forward_batch
from deltaserve.sampling_params import SamplingParams

# Between them these take every stage of the sampler (engine/sampler.py): greedy argmax; temperature
# with top-k, top-p, min-p and logprobs; top-p over the whole vocabulary (a full sort); bias, allowed ids,
# penalties.
SAMPLER_STAGES = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, logprobs=5),
    SamplingParams(temperature=1.0, top_p=0.95),
    SamplingParams(
        temperature=0.6,
        repetition_penalty=1.1,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        logit_bias={1: 2.0},
        allowed_token_ids=[1, 2, 3],
        logprobs=0,
    ),
)


def dummy_rows(num_seqs: int, tokens_each: int, page_size: int, *, context: int = 0) -> list[BatchRow]:
    """Rows that write only the reserved page and slot: for warm-up and graph capture."""
    pages = [DUMMY_PAGE] * -(-(context + tokens_each) // page_size)
    return [BatchRow([0] * tokens_each, context, pages, DUMMY_SLOT) for _ in range(num_seqs)]


@dataclass(frozen=True, slots=True)
class MixedStep:
    """An eager step of one decode row (after `decode_context` tokens) beside prefill chunks."""

    decode_context: int
    chunks: tuple[int, ...]


def mixed_steps(
    max_batched_tokens: int, page_size: int, apart_tokens: int, split_tokens: int
) -> list[MixedStep]:
    """The warm-up's eager steps with a decode row beside prefill chunks.

    The attention kernel compiles a variant per launch kind (ops/triton/attention.py): steps of up to
    `apart_tokens` launch their decode rows apart from the chunks, longer ones launch both together;
    either way the decode programs split a row's keys where the batch's block table spans at least
    2 x `split_tokens` tokens. A variant first met while serving compiles there (2.2 s at the 9B shape
    on an H100, a stall for every running request), so each is met here: one chunk step, and where the
    budget allows a longer step, one of `apart_tokens` chunk tokens (one token past the bound with its
    decode row); each with a decode row after a short context and after a long one. The chunks are too
    short to make the table span a split: only the decode row's context decides it."""
    chunk = max(1, split_tokens // 2)
    totals = [min(max_batched_tokens - 1, chunk)]
    if max_batched_tokens > apart_tokens:
        totals.append(apart_tokens)
    steps = []
    for total in totals:
        if total < 1:
            continue
        chunks = (chunk,) * (total // chunk) + ((total % chunk,) if total % chunk else ())
        for context in (page_size + 1, 2 * split_tokens):
            steps.append(MixedStep(context, chunks))
    return steps


def mixed_rows(step: MixedStep, page_size: int) -> list[BatchRow]:
    """The step's rows on the reserved page and slot: its decode row first, then its chunks."""
    rows = dummy_rows(1, 1, page_size, context=step.decode_context)
    for tokens in step.chunks:
        rows += dummy_rows(1, tokens, page_size)
    return rows


@dataclass(slots=True)
class WarmupReport:
    peak_activation_bytes: int
    seconds: float
    fresh_attention_plans: int = 0  # cuDNN plans built for fresh prefill chunks (DELTASERVE_FRESH_SDPA)
    # Seconds of each phase, in order (together all of `seconds` but its last synchronisation): where a
    # slow start-up spends its time.
    phases: dict[str, float] = field(default_factory=dict)

    def phase_summary(self) -> str:
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases.items())


@torch.inference_mode()
def warm_up(
    model: Qwen35ForCausalLM,
    cache: DeviceCaches,
    max_batched_tokens: int,
    max_num_seqs: int,
    *,
    sample: bool = True,
) -> WarmupReport:
    """Runs prefill and decode forwards at the shapes serving will use, on the reserved page and slot,
    then (`sample`: the rank that samples) the sampler, and measures the activation peak above the
    resident weights and caches: a full batch's sampling temporaries (a top-p sort over the vocabulary)
    included."""
    from deltaserve.ops.triton.attention import DECODE_APART_MAX_TOKENS, MIN_SPLIT_TOKENS  # GPU only

    device = model.device
    torch.cuda.synchronize(device)
    started = time.monotonic()
    phases: dict[str, float] = {}

    def phase_done(name: str) -> None:
        torch.cuda.synchronize(device)
        phases[name] = time.monotonic() - started - sum(phases.values())

    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    page = cache.page_size
    shapes = [(1, max_batched_tokens), (1, 64), (1, 17), (4, max(1, min(64, max_batched_tokens // 4)))]
    for seqs, tokens in shapes:
        batch = build_forward_batch(dummy_rows(seqs, tokens, page), page, device)
        model.compute_logits(model(batch, cache.kv, cache.states))
    phase_done("prefill forwards")
    for step in mixed_steps(max_batched_tokens, page, DECODE_APART_MAX_TOKENS, MIN_SPLIT_TOKENS):
        model.compute_logits(
            model(build_forward_batch(mixed_rows(step, page), page, device), cache.kv, cache.states)
        )
    phase_done("mixed forwards")
    # The last forward leaves `hidden` at every decode bucket's rows; the first splits its row's keys.
    decodes = [(1, 2 * MIN_SPLIT_TOKENS)] + [
        (seqs, page + 1) for seqs in sorted({1, min(8, max_num_seqs), max_num_seqs})
    ]
    for seqs, context in decodes:
        batch = build_forward_batch(dummy_rows(seqs, 1, page, context=context), page, device)
        hidden = model(batch, cache.kv, cache.states)
        model.compute_logits(hidden)
    phase_done("decode forwards")
    warm_gated_norm(model)
    phase_done("gated norm shapes")
    # The LM head's GEMM at every decode bucket's row count, where steps outside a decode graph run it
    # (cuda_graphs.padded_logits_rows): each loads its kernel here, not behind a step launched ahead,
    # whether or not that bucket's graph has been captured yet.
    for rows in graph_buckets(max_num_seqs):
        model.compute_logits(hidden[:rows])
    phase_done("LM head at each bucket")
    if sample:
        warm_sampler(Sampler(), model.logits_vocab_size, device, max_num_seqs)
        phase_done("sampler")
    fresh_plans = warm_fresh_attention(model, max_batched_tokens)
    if fresh_plans:
        phase_done("cuDNN plans")
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    return WarmupReport(
        peak_activation_bytes=peak,
        seconds=time.monotonic() - started,
        fresh_attention_plans=fresh_plans,
        phases=phases,
    )


def gated_norm_tokens(heads: int, head_dim: int) -> list[int]:
    """Token counts whose gated-norm rows (`heads` each) reach every program shape of the kernel."""
    from deltaserve.ops.triton.norm import gated_launch_row_counts

    return [-(-rows // heads) for rows in gated_launch_row_counts(head_dim)]


def warm_gated_norm(model: Qwen35ForCausalLM) -> None:
    """The GDN layers' gated norm at each of its program shapes (chosen by its row count, heads x tokens:
    `gated_launch_row_counts`), on views laid out as a GDN layer's (z a slice of in_proj's output), so
    its compiles happen here whatever row counts the forwards above met."""
    layer = next((m for m in model.modules() if isinstance(m, GatedDeltaNet)), None)
    if layer is None:
        return
    heads, head_dim = layer.num_v_heads, layer.head_v_dim
    for tokens in gated_norm_tokens(heads, head_dim):
        proj = torch.zeros(tokens, layer.in_proj.shape[0], dtype=layer.in_proj.dtype, device=model.device)
        z = proj[:, layer.conv_dim : layer.conv_dim + layer.value_dim].reshape(tokens, heads, head_dim)
        out = torch.zeros(tokens, heads, head_dim, dtype=z.dtype, device=model.device)
        gated_rms_norm(out, z, layer.norm, layer.eps)


def warm_fresh_attention(model: Qwen35ForCausalLM, max_batched_tokens: int) -> int:
    """Every padded length a fresh prefill chunk can take through cuDNN (ops/fresh_attention.py), at
    this rank's attention geometry: the plans are built now, not on a request. The count."""
    attention = next((m for m in model.modules() if isinstance(m, GatedAttention)), None)
    if attention is None:
        return 0
    dtype = attention.qkv_proj.dtype
    if not fresh_attention.applies(dtype):
        return 0
    return fresh_attention.warm_plans(
        attention.num_heads,
        attention.num_kv_heads,
        attention.head_dim,
        dtype,
        model.device,
        max_batched_tokens,
    )


@torch.inference_mode()
def warm_sampler(sampler: Sampler, vocab: int, device: torch.device, max_rows: int) -> None:
    """Every SAMPLER_STAGES entry alone and all of them in one step (greedy rows beside sampled ones),
    at 1, 8 and `max_rows` rows, through to the staged host copy a step reads; and the penalties
    counted on the device (a slot's row, drafts before a position, a fed token), as serving counts them."""
    counts = PenaltyCounts(2, vocab, device)
    counts.apply([(1, 3)], [PenaltyReset(1, [3], [1, 2])])
    counted = Sampler(counts)
    for rows in sorted({1, min(8, max_rows), max_rows}):
        # Varied values without the global generator (the warm-up leaves every random stream as it was).
        logits = torch.arange(rows * vocab, device=device, dtype=torch.float32).view(rows, vocab).sin_()
        batches = [[params] * rows for params in SAMPLER_STAGES]
        batches.append([SAMPLER_STAGES[i % len(SAMPLER_STAGES)] for i in range(rows)])
        for batch in batches:
            sampling = [
                SamplingRow(params, seed=i, step=1, prompt_token_ids=[1, 2], output_token_ids=[3])
                for i, params in enumerate(batch)
            ]
            sampling[0].suppressed_token_ids = (4,)
            sample_and_stage(sampler, logits, sampling)[1].read(sampling)
        sampling = [
            SamplingRow(SAMPLER_STAGES[-1], seed=i, step=2, prompt_token_ids=(), output_token_ids=[3])
            for i in range(rows)
        ]
        for row in sampling:
            row.penalty_slot, row.penalty_extra, row.penalty_pending = 1, (5,), True
        fed = torch.zeros(rows, dtype=torch.int64, device=device)
        sample_and_stage(counted, logits, sampling, fed)[1].read(sampling)
