"""Batched, device-agnostic sampling: one pass over a step's logits, with no host synchronisation.

Stages, in vLLM's order (each runs only when some row of the step uses it, decided from host data):
  log-probs of the raw logits → logit_bias → suppressed ids → allowed ids only → repetition penalty
  (prompt ∪ output) →
  frequency and presence penalties (output) → greedy argmax | temperature → top_k → top_p → min_p → draw.

The draw is Gumbel-max with counter-based noise, so a row's token depends only on its own logits, parameters,
seed and step — never on the batch around it or the device:
  key      = splitmix64(splitmix64(seed) + step)
  u(v)     = (top 23 bits of splitmix64(key + (v + 1) * GOLDEN) + 0.5) / 2**23        strictly inside (0, 1)
  token    = argmax_v  filtered_logit(v) - log(-log u(v))
All hashing is int64 torch arithmetic (multiplication wraps mod 2**64 identically on CPU and CUDA).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deltaserve.engine.penalty_counts import PenaltyCounts
from deltaserve.engine.row_buffers import row_buffer
from deltaserve.engine.structured import RequestGrammar
from deltaserve.ops.batch import to_device
from deltaserve.sampling_params import SamplingParams


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= (1 << 63) else value


# splitmix64's constants, as the signed int64 values torch stores.
_GOLDEN = _signed64(0x9E3779B97F4A7C15)
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)
# float32 holds (2**23 - 1) + 0.5 exactly, so 23 bits keep every uniform strictly inside (0, 1).
_UNIFORM_BITS = 23
# Noise is materialised for at most this many [row, token] elements at once (about 400 MiB of transients).
_NOISE_CHUNK_ELEMS = 1 << 24


def make_seed() -> int:
    """A random seed for a request that did not give one (63 bits, the range SamplingParams accepts)."""
    return secrets.randbits(63)


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    seed: int  # resolved per request for its whole life (make_seed() when params.seed is None)
    step: int  # index of the output token being sampled (0 = first output token)
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far (len == step)
    suppressed_token_ids: Sequence[int] = ()  # never sampled this step (EOS/stop ids while step < min_tokens)
    grammar: RequestGrammar | None = None  # structured output: masks what the grammar forbids
    # Penalties counted on the device (engine/penalty_counts.py): the slot whose row holds the outputs
    # the host had at the last launch, plus `penalty_extra` (a verify position's drafts before it) and,
    # with `penalty_pending`, the row's own input token, fed from the device (a step launched ahead).
    # None: counted here from output_token_ids (and prompt_token_ids).
    penalty_slot: int | None = None
    penalty_extra: Sequence[int] = ()
    penalty_pending: bool = False


@dataclass(slots=True)
class LogprobsTensors:
    """Every row gets K alternatives, K = the most any row of the step asked for; rows slice their own."""

    sampled_logprob: torch.Tensor  # [B] float32, log-prob of the sampled token
    sampled_rank: torch.Tensor  # [B] int64, 1 + the number of tokens strictly more likely
    top_ids: torch.Tensor  # [B, K] int64, most likely first
    top_logprobs: torch.Tensor  # [B, K] float32


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64 on the logits' device
    logprobs: LogprobsTensors | None  # present only if some row asked for logprobs


class Sampler:
    """Samples one token per row of `logits` [B, V] (float32 or bf16, already cut to the tokenizer's V ids).

    Never writes `logits`, never synchronises with the device; host row data travels in one copy per
    per-step tensor (pinned and asynchronous on CUDA). `penalty_counts`: the device rows that rows with
    a `penalty_slot` are counted from."""

    def __init__(self, penalty_counts: PenaltyCounts | None = None) -> None:
        self.penalty_counts = penalty_counts

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], fed: torch.Tensor | None = None
    ) -> SamplerOutput:
        """`fed`: the input tokens of the step's first rows, on the device (a step launched ahead): row
        i < len(fed) with `penalty_pending` counts fed[i] as an output."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [rows={len(rows)}, vocab], got {tuple(logits.shape)}")
        token_ids = _sample(process_logits(logits, rows, self.penalty_counts, fed), rows)
        asked = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        logprobs = logprobs_of(logits, token_ids, max(asked)) if asked else None
        return SamplerOutput(token_ids, logprobs)


def process_logits(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    penalty_counts: PenaltyCounts | None = None,
    fed: torch.Tensor | None = None,
) -> torch.Tensor:
    """logit_bias, then suppressed ids (-inf), then every id outside a row's allowed_token_ids (-inf), then
    repetition, frequency and presence penalties.

    Returns `logits` itself when no row uses any of them, else a new float32 [B, V] tensor."""
    bias = [
        (i, tok, b)
        for i, r in enumerate(rows)
        if r.params.logit_bias
        for tok, b in r.params.logit_bias.items()
    ]
    suppressed = [(i, tok) for i, r in enumerate(rows) for tok in r.suppressed_token_ids]
    allowed = [(i, tok) for i, r in enumerate(rows) for tok in r.params.allowed_token_ids or ()]
    penalised = [i for i, r in enumerate(rows) if uses_penalties(r.params)]
    if not (bias or suppressed or allowed or penalised):
        return logits
    x = row_buffer(logits.shape[0], logits.shape[1], torch.float32, logits.device).copy_(logits)
    if bias:
        row_ids, tok_ids, values = zip(*bias, strict=True)
        index = to_device([row_ids, tok_ids], torch.int64, x.device)
        x.index_put_((index[0], index[1]), to_device(values, torch.float32, x.device), accumulate=True)
    if suppressed:
        index = to_device(list(zip(*suppressed, strict=True)), torch.int64, x.device)
        x[index[0], index[1]] = float("-inf")
    if allowed:
        index = to_device(list(zip(*allowed, strict=True)), torch.int64, x.device)
        restricted = to_device(sorted({i for i, _ in allowed}), torch.int64, x.device)
        kept = x[index[0], index[1]]
        x[restricted] = float("-inf")
        x[index[0], index[1]] = kept
    if penalised:
        x = _apply_penalties(x, rows, penalised, penalty_counts, fed)
    return x


def uses_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _flat_token_index(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Index of (row j, token t) into a flattened [len(token_lists), vocab] tensor: j * vocab + t."""
    row_of: list[int] = []
    flat: list[int] = []
    for j, ids in enumerate(token_lists):
        row_of.extend([j] * len(ids))
        flat.extend(ids)
    pairs = to_device([row_of, flat], torch.int64, device)
    return pairs[0] * vocab + pairs[1]


def _apply_penalties(
    x: torch.Tensor,
    rows: Sequence[SamplingRow],
    penalised: list[int],
    penalty_counts: PenaltyCounts | None,
    fed: torch.Tensor | None,
) -> torch.Tensor:
    """Penalties over the penalised rows only (their output counts: `_output_counts`)."""
    prows = [rows[i] for i in penalised]
    n, vocab = len(prows), x.shape[1]
    params = to_device(
        [
            [r.params.repetition_penalty for r in prows],
            [r.params.frequency_penalty for r in prows],
            [r.params.presence_penalty for r in prows],
        ],
        torch.float32,
        x.device,
    )
    device = x.device
    whole = n == x.shape[0]
    row_index = None if whole else to_device(penalised, torch.int64, device)
    # `sub` is the step's own copy (process_logits), or a copy of its penalised rows: changed in place.
    sub = x if whole else torch.index_select(x, 0, row_index, out=row_buffer(n, vocab, x.dtype, device))

    def floats() -> torch.Tensor:
        return row_buffer(n, vocab, torch.float32, device)

    def flags() -> torch.Tensor:
        return row_buffer(n, vocab, torch.bool, device)

    repetition = any(r.params.repetition_penalty != 1.0 for r in prows)
    counts, in_prompt = _output_counts(prows, penalised, vocab, device, penalty_counts, fed, repetition)
    if repetition:
        assert in_prompt is not None
        rep = params[0, :, None]
        seen = torch.gt(counts, 0, out=flags()).logical_or_(in_prompt)
        scaled = torch.where(
            torch.gt(sub, 0, out=flags()),
            torch.div(sub, rep, out=floats()),
            torch.mul(sub, rep, out=floats()),
            out=floats(),
        )
        sub = torch.where(seen, scaled, sub, out=floats())
    if any(r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0 for r in prows):
        # sub - (frequency * counts + presence * (counts > 0)), in that order
        shift = torch.mul(counts, params[1, :, None], out=floats())
        shift.add_(torch.mul(torch.gt(counts, 0, out=flags()), params[2, :, None], out=floats()))
        sub.sub_(shift)
    if whole:
        return sub
    return x.index_copy_(0, row_index, sub)


def _output_counts(
    prows: Sequence[SamplingRow],
    penalised: list[int],
    vocab: int,
    device: torch.device,
    penalty_counts: PenaltyCounts | None,
    fed: torch.Tensor | None,
    repetition: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[P, vocab] float32: how often each penalised row has output each token; with `repetition`,
    [P, vocab] bool: the tokens of its prompt (rows without a repetition penalty: none, so their factor
    is exactly 1). A row with a penalty slot starts from its device row, plus its extra tokens and its
    fed token; any other row is counted from its token lists (one scatter for all)."""
    n = len(prows)
    counts = row_buffer(n, vocab, torch.float32, device).zero_()
    in_prompt = row_buffer(n, vocab, torch.bool, device).zero_() if repetition else None
    on_device = [j for j, r in enumerate(prows) if r.penalty_slot is not None]
    if on_device:
        if penalty_counts is None:
            raise ValueError("rows with a penalty slot need a sampler with penalty counts")
        at = to_device([on_device, [prows[j].penalty_slot for j in on_device]], torch.int64, device)
        slot_counts, slot_prompt = penalty_counts.rows(at[1], prompt=in_prompt is not None)
        counts.index_copy_(0, at[0], slot_counts)
        if in_prompt is not None:
            assert slot_prompt is not None
            in_prompt.index_copy_(0, at[0], slot_prompt)
    listed = [r.output_token_ids if r.penalty_slot is None else r.penalty_extra for r in prows]
    if any(listed):
        index = _flat_token_index(listed, vocab, device)
        counts.view(-1).index_add_(0, index, torch.ones_like(index, dtype=torch.float32))
    pending = [j for j, r in enumerate(prows) if r.penalty_pending]
    if pending:
        if fed is None or penalised[pending[-1]] >= fed.shape[0]:
            raise ValueError("a row counting its fed token must be one of the step's fed rows")
        at = to_device([pending, [penalised[j] for j in pending]], torch.int64, device)
        ones = torch.ones(len(pending), dtype=torch.float32, device=device)
        counts.index_put_((at[0], fed.index_select(0, at[1])), ones, accumulate=True)
    if in_prompt is not None:
        prompts = [
            r.prompt_token_ids if r.penalty_slot is None and r.params.repetition_penalty != 1.0 else ()
            for r in prows
        ]
        if any(prompts):
            in_prompt.view(-1)[_flat_token_index(prompts, vocab, device)] = True
    return counts, in_prompt


def is_plain_argmax(row: SamplingRow) -> bool:
    """The row's token is the argmax of its raw logits: greedy, with nothing that changes the logits
    (bias, suppressed ids, penalties, a grammar) and no logprobs asked for."""
    p = row.params
    return (
        _is_greedy_row(p)
        and not p.logit_bias
        and not p.allowed_token_ids
        and not row.suppressed_token_ids
        and not uses_penalties(p)
        and row.grammar is None
        and p.logprobs is None
    )


def _is_greedy_row(p: SamplingParams) -> bool:
    # top_k == 1 keeps only the argmax whatever the temperature, so it is greedy (ties: lowest id).
    return p.is_greedy or p.top_k == 1


def _sample(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Greedy rows take the argmax (torch returns the first maximum: ties go to the lowest id); the others
    are scaled, filtered and drawn as one sub-batch."""
    sampled = [i for i, r in enumerate(rows) if not _is_greedy_row(r.params)]
    if not sampled:
        return x.argmax(dim=-1)
    srows = [rows[i] for i in sampled]
    vocab = x.shape[1]
    # top_k >= vocab keeps everything: encoded as 0 (disabled) like top_k in {-1, 0}.
    top_k = [r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in srows]
    ints = to_device(
        [sampled, [r.seed for r in srows], [r.step for r in srows], top_k], torch.int64, x.device
    )
    # top_p == 1 keeps everything: encoded as +inf, because a float32 cumulative sum over a large vocabulary
    # can reach 1.0 before its last tokens, and "mass before < 1.0" would then drop them.
    floats = to_device(
        [
            [r.params.temperature for r in srows],
            [r.params.top_p if r.params.top_p < 1.0 else float("inf") for r in srows],
            [r.params.min_p for r in srows],
        ],
        torch.float32,
        x.device,
    )
    whole = len(sampled) == len(rows)
    n = len(srows)
    picked = x if whole else torch.index_select(x, 0, ints[0], out=row_buffer(n, vocab, x.dtype, x.device))
    scores = torch.div(picked, floats[0, :, None], out=row_buffer(n, vocab, torch.float32, x.device))
    any_top_p = any(r.params.top_p < 1.0 for r in srows)
    if any(top_k) or any_top_p:
        _top_k_top_p_(scores, ints[3], floats[1], k_max=max(top_k), all_top_k=all(top_k), any_top_p=any_top_p)
    if any(r.params.min_p > 0.0 for r in srows):
        # prob < min_p * max prob  <=>  logit < max logit + log(min_p); log(0) = -inf keeps every token.
        floor = scores.amax(dim=-1, keepdim=True) + floats[2, :, None].log()
        scores.masked_fill_(scores < floor, float("-inf"))
    drawn = _gumbel_argmax(scores, ints[1], ints[2])
    if whole:
        return drawn
    return x.argmax(dim=-1).index_copy_(0, ints[0], drawn)


def _top_k_top_p_(
    scores: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    k_max: int,
    all_top_k: bool,
    any_top_p: bool,
) -> None:
    """Masks (in place, to -inf) every token below its row's top-k and top-p thresholds.

    top_k: [S] int64, 0 = disabled. top_p: [S] float32, +inf = disabled. top_p is taken over the top-k
    renormalised distribution: the smallest prefix of the sorted tokens whose mass reaches top_p (at least
    one token). A token is kept iff its score is >= its row's threshold, so tokens tied with the last kept
    one are kept too, and a row's thresholds come only from its own k largest (or all) sorted values."""
    vocab = scores.shape[1]
    # topk(k_max) holds every value a threshold can come from, unless a row without top_k needs top_p.
    width = k_max if k_max and (all_top_k or not any_top_p) else vocab
    if width < vocab:
        ordered = scores.topk(width, dim=-1).values
    else:
        rows, device = scores.shape[0], scores.device
        ordered, _ = torch.sort(
            scores,
            dim=-1,
            descending=True,
            out=(row_buffer(rows, vocab, scores.dtype, device), row_buffer(rows, vocab, torch.int64, device)),
        )
    threshold = ordered.gather(1, (top_k.clamp(1, width) - 1)[:, None])
    threshold.masked_fill_(top_k[:, None] == 0, float("-inf"))
    if any_top_p:
        beyond_k = torch.arange(width, device=scores.device) >= torch.where(top_k == 0, width, top_k)[:, None]
        kept = ordered.masked_fill(beyond_k, float("-inf"))
        probs = kept.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        n_keep = (mass_before < top_p[:, None]).sum(dim=-1, keepdim=True).clamp_(min=1)
        threshold = torch.maximum(threshold, kept.gather(1, n_keep - 1))
    scores.masked_fill_(scores < threshold, float("-inf"))


def _gumbel_argmax(scores: torch.Tensor, seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Draws argmax(score + Gumbel noise) per row, i.e. a sample of softmax(score), from counter-based noise."""
    rows, vocab = scores.shape
    device = scores.device
    key = _mix64_(_mix64_(seed.clone()).add_(step))
    counters = torch.arange(1, vocab + 1, dtype=torch.int64, device=device).mul_(_GOLDEN)
    drawn = torch.empty(rows, dtype=torch.int64, device=device)
    # A power of two of rows per chunk, so that a last, shorter chunk's row buffers fit a full one's.
    chunk = 1 << (max(1, _NOISE_CHUNK_ELEMS // vocab).bit_length() - 1)
    for lo in range(0, rows, chunk):
        hi = min(lo + chunk, rows)
        z = torch.add(key[lo:hi, None], counters, out=row_buffer(hi - lo, vocab, torch.int64, device))
        # Only the top 23 bits are used, and splitmix64's last xorshift (>> 31) never changes them.
        _mix64_(z, final_xorshift=False)
        u = row_buffer(hi - lo, vocab, torch.float32, device)
        u.copy_(_shift_right_logical(z, 64 - _UNIFORM_BITS, out=z)).add_(0.5).mul_(2.0**-_UNIFORM_BITS)
        # -log(-log u) is standard Gumbel noise: score + noise = score - log(-log u).
        drawn[lo:hi] = torch.sub(scores[lo:hi], u.log_().neg_().log_(), out=u).argmax(dim=-1)
    return drawn


def _shift_right_logical(z: torch.Tensor, shift: int, out: torch.Tensor | None = None) -> torch.Tensor:
    # torch's >> on int64 is arithmetic; masking off the copied sign bits makes it logical.
    return torch.bitwise_right_shift(z, shift, out=out).bitwise_and_((1 << (64 - shift)) - 1)


def _mix64_(z: torch.Tensor, *, final_xorshift: bool = True) -> torch.Tensor:
    """splitmix64's finaliser, in place over int64 (products wrap mod 2**64, as the C original's uint64)."""
    tmp = torch.empty_like(z) if z.dim() == 1 else row_buffer(z.shape[0], z.shape[1], z.dtype, z.device)
    z.bitwise_xor_(_shift_right_logical(z, 30, out=tmp)).mul_(_MIX1)
    z.bitwise_xor_(_shift_right_logical(z, 27, out=tmp)).mul_(_MIX2)
    if final_xorshift:
        z.bitwise_xor_(_shift_right_logical(z, 31, out=tmp))
    return z


def logprobs_of(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Log-probs of the raw distribution (before bias, penalties and temperature), as vLLM reports them."""
    logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    sampled = logprobs.gather(1, token_ids[:, None])
    rank = (logprobs > sampled).sum(dim=-1) + 1
    top = logprobs.topk(k, dim=-1)
    return LogprobsTensors(sampled.squeeze(1), rank, top.indices, top.values)
