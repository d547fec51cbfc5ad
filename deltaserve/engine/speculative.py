"""A speculative step on the device: verify, accept, commit, draft (MTP speculative decoding).

One target forward runs every row; a verify row (its last token and k drafts) gets logits at all of
its k + 1 positions. The sampler draws the target's token after each position exactly as a plain step
would at that output index (same processing, same counter-based noise), so the rule
    accept draft i+1  iff  it equals the target's token after position i
emits, for greedy and for sampled requests alike, exactly the tokens decoding without speculation
emits: the drafts are deterministic proposals (one-hot), whose rejection-sampling residual is the
target's distribution with the draft removed, which is what a draw that differs from the draft has.

The GDN state after each verify token but the last went to a scratch slot during the forward; the
state after the last accepted token is committed to the row's own slot (a slot copy), so KV, conv and
SSM state and the position all end at the row's last accepted token (the scheduler rewinds its cursor
by the rejected drafts; their K/V lie beyond it and are overwritten before any read).

The MTP head then runs over every token of the step (its input at position p: the token at p + 1 and
the target's hidden state at p), which fills its KV, and drafts from each drafting row's last
committed position, then chains on its own hidden state for the further drafts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from deltaserve.cache.copies import CacheCopy, StateCommit
from deltaserve.cache.device import DeviceCaches
from deltaserve.cache.state_slots import DUMMY_SLOT
from deltaserve.engine.prefill_graphs import PrefillGraphRunner
from deltaserve.engine.protocol import TokenLogprobs
from deltaserve.engine.sampler import Sampler, SamplingRow, is_plain_argmax
from deltaserve.engine.spec_graphs import SpeculativeGraphs
from deltaserve.engine.step import PlannedRow, SpeculationResult, StepPlan, StepResult, sample_and_stage
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.ops.batch import BatchRow, build_forward_batch, logits_rows, to_device

ScorePrompts = Callable[[Sequence[PlannedRow], torch.Tensor], list[list[TokenLogprobs] | None]]


def emitted_tokens(drafts: Sequence[int], targets: Sequence[int], accepted: int) -> list[int]:
    """What a verify row emits: its accepted drafts (equal to the target's tokens unless acceptance is
    forced), then the target's token after the last of them."""
    return [*drafts[:accepted], targets[accepted]]


def accepted_drafts(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """How many leading drafts equal the target's token at their position (targets[i] is the
    target's token after the row's token i, so it judges drafts[i])."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return n


class SpeculativeStep:
    """Runs a `StepPlan` with num_drafts > 0 (eager; read back during the launch)."""

    def __init__(
        self,
        model: Qwen35ForCausalLM,
        caches: DeviceCaches,
        sampler: Sampler,
        graphs: SpeculativeGraphs | None = None,
        prefill_graphs: PrefillGraphRunner | None = None,
    ) -> None:
        if model.mtp is None:
            raise ValueError("a speculative step needs the model's MTP head")
        if prefill_graphs is not None and not prefill_graphs.every_token:
            raise ValueError("speculative steps need prefill graphs that keep every token's hidden state")
        self.model = model
        self.caches = caches
        self.sampler = sampler
        self.graphs = graphs  # CUDA graphs for steps of uniform verify rows only
        # Steps without verify rows (prompt chunks, decoders without proposals) replay the target
        # forward from these; their MTP pass runs eager (one layer) unless every row has one token,
        # and their chained drafts replay `graphs`' draft steps.
        self.prefill_graphs = prefill_graphs
        self.device = model.device

    @torch.inference_mode()
    def run(self, plan: StepPlan, score_prompts: ScorePrompts) -> StepResult:
        """`score_prompts(planned, scored_hidden)`: the backend's prompt scoring."""
        planned = plan.rows
        rows = [r.batch_row() for r in planned]
        caches = self.caches
        caches.copy(plan.copies_before)
        graphs = self.graphs if self.graphs is not None and self.graphs.can_run(rows) else None
        if (
            graphs is not None
            and not plan.copies_after
            and all(is_plain_argmax(s) for r in planned for s in r.sampling_rows)
        ):
            return self._greedy_graph_step(planned, rows, graphs, plan.force_accept)
        prompt = None
        batch = None
        # A step of one token per row that a prefill graph runs also takes its MTP pass from a graph.
        single = None
        if graphs is not None:
            hidden, logits = graphs.verify(rows)
        else:
            replayed = self._in_prefill_graph(rows)
            if replayed is not None and self.graphs is not None and self.graphs.can_run_single(rows):
                single = self.graphs
            else:
                batch = build_forward_batch(rows, caches.page_size, self.device)
            if replayed is not None:
                logits, hidden = replayed
            else:
                hidden = self.model(batch, caches.kv, caches.states, every_token=True)
                num_logits = sum(logits_rows(r) for r in rows)
                indices = batch.logits_indices
                logits = self.model.compute_logits(hidden[indices[:num_logits]])
                if any(r.scored for r in rows):
                    prompt = score_prompts(planned, hidden[indices[num_logits:]])
        caches.copy(plan.copies_after)
        flat = [s for r in planned for s in r.sampling_rows]
        targets, logprobs = self._sample(logits, flat)

        emitted: list[list[int]] = []
        emitted_logprobs: list[list[TokenLogprobs | None]] = []
        num_drafted: list[int] = []
        commits: list[CacheCopy] = []
        committed: list[int] = []  # per sampled row: its positions in the caches after this step
        last_offsets: list[int] = []  # per sampled row: token row of its last committed position
        mtp_ids: list[int] = []
        offset = 0  # into flat
        token_row = 0
        for row in planned:
            n_tokens = len(row.token_ids)
            if row.sampling is None:
                mtp_ids += [*row.token_ids[1:], _next_prompt_token(row)]
                token_row += n_tokens
                continue
            if row.is_verify:
                ys = targets[offset : offset + n_tokens]
                limit = n_tokens - 1 if row.accept_limit is None else row.accept_limit
                drafts = row.token_ids[1 : 1 + limit]
                n_acc = limit if plan.force_accept else accepted_drafts(drafts, ys)
                emitted.append(emitted_tokens(drafts, ys, n_acc))
                emitted_logprobs.append(logprobs[offset : offset + n_acc + 1])
                num_drafted.append(n_tokens - 1)
                if n_acc + 1 < n_tokens:
                    commits.append(StateCommit(row.state_after[n_acc], row.slot))
                # The MTP's input at a verify position i is the token after it: an accepted draft, then
                # the target's ys[i]; positions past the last accepted one are rewritten by the next step.
                mtp_ids += [*drafts[:n_acc], *ys[n_acc:]]
                committed.append(row.context_len + n_acc + 1)
                last_offsets.append(token_row + n_acc)
                offset += n_tokens
            else:
                y = targets[offset]
                emitted.append([y])
                emitted_logprobs.append([logprobs[offset]])
                num_drafted.append(0)
                mtp_ids += [*row.token_ids[1:], y]
                committed.append(row.context_len + n_tokens)
                last_offsets.append(token_row + n_tokens - 1)
                offset += 1
            token_row += n_tokens
        caches.copy(commits)

        sampled_rows = [r for r in planned if r.sampling is not None]
        # Under graphs every row drafts (the draft graphs run the verify rows' order); the proposals of
        # a row that does not draft are dropped.
        drafting = [i for i, row in enumerate(sampled_rows) if row.drafts or graphs is not None]
        drafts: list[list[int]] = [[] for _ in sampled_rows]
        ids = to_device(mtp_ids, torch.int64, self.device)
        if graphs is not None:
            mtp_hidden = graphs.mtp(len(rows), len(rows[0].token_ids) - 1, ids, hidden)
        elif single is not None:
            mtp_hidden = single.mtp_single(rows, ids, hidden)
        else:
            mtp_hidden = self.model.mtp_forward(ids, hidden, batch, caches.kv)
        if drafting:
            proposals = self._draft(
                mtp_hidden[to_device([last_offsets[i] for i in drafting], torch.int64, self.device)],
                [sampled_rows[i] for i in drafting],
                [committed[i] for i in drafting],
                plan.num_drafts,
                graphs,
            )
            for i, proposal in zip(drafting, proposals, strict=True):
                if sampled_rows[i].drafts:
                    drafts[i] = proposal
        return StepResult(
            [e[0] for e in emitted],
            [lp[0] for lp in emitted_logprobs],
            prompt or [],
            SpeculationResult(emitted, emitted_logprobs, drafts, num_drafted),
        )

    def _in_prefill_graph(self, rows: list[BatchRow]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(logits, every token's hidden state) of a step without verify rows replayed from a prefill
        graph, or None to run it eager (no graphs, a verify or scored row, no bucket, a failed capture)."""
        prefill = self.prefill_graphs
        if prefill is None or not prefill.can_run(rows):
            return None
        return prefill.run_every_token(rows)

    def _greedy_graph_step(
        self, planned: list[PlannedRow], rows: list[BatchRow], graphs: SpeculativeGraphs, force_accept: bool
    ) -> StepResult:
        """Greedy verify rows only: the whole step is one graph replay (accepting, committing and
        drafting on the device); the host reads targets, accepted counts and proposals once."""
        limits = [len(r.token_ids) - 1 if r.accept_limit is None else r.accept_limit for r in planned]
        targets, accepted, proposals = graphs.greedy_step(rows, limits, force_accept)
        emitted = [
            emitted_tokens(r.token_ids[1:], ys, n)
            for r, ys, n in zip(planned, targets, accepted, strict=True)
        ]
        return StepResult(
            [e[0] for e in emitted],
            [None] * len(emitted),
            [],
            SpeculationResult(
                emitted,
                [[None] * len(e) for e in emitted],
                [p if r.drafts else [] for p, r in zip(proposals, planned, strict=True)],
                [len(r.token_ids) - 1 for r in planned],
            ),
        )

    def _sample(
        self, logits: torch.Tensor, flat: list[SamplingRow]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        if not flat:
            return [], []
        result = sample_and_stage(self.sampler, logits, flat)[1].read(flat)
        return result.token_ids, result.logprobs

    def _draft(
        self,
        first_hidden: torch.Tensor,
        rows: list[PlannedRow],
        committed: list[int],
        num_drafts: int,
        graphs: SpeculativeGraphs | None,
    ) -> list[list[int]]:
        """num_drafts greedy proposals per row: the first from the MTP's state at the row's last
        committed position, each further one from an MTP step at the next position over the previous
        proposal and the MTP's own hidden state."""
        model = self.model
        hidden = first_hidden
        token = model.draft_tokens(hidden)
        out = [token]
        # The drafting rows' batch rows, once for every draft step; only the graph paths read them.
        uses_graphs = num_drafts > 1 and (graphs is not None or self.graphs is not None)
        batch_rows = [r.batch_row() for r in rows] if uses_graphs else []
        if uses_graphs and graphs is None and self.graphs.can_draft(batch_rows):
            # After a step no verify replay ran: the draft graphs, over the drafting rows' block tables.
            graphs = self.graphs
            graphs.load_tables(batch_rows)
        for j in range(1, num_drafts):
            # Draft j (0-based) is predicted at MTP position committed + j - 1: its input is draft
            # j - 1, the token at position committed + j.
            if graphs is not None:
                positions = [c + j - 1 for c in committed]
                hidden, token = graphs.draft(batch_rows, token, hidden, positions)
                out.append(token)
                continue
            step_rows = [
                BatchRow([0], c + j - 1, row.pages, DUMMY_SLOT)
                for row, c in zip(rows, committed, strict=True)
            ]
            batch = build_forward_batch(step_rows, self.caches.page_size, self.device)
            hidden = model.mtp_forward(token, hidden, batch, self.caches.kv)
            token = model.draft_tokens(hidden)
            out.append(token)
        return torch.stack(out, dim=1).tolist()


def _next_prompt_token(row: PlannedRow) -> int:
    if row.mtp_next_token is None:
        raise ValueError("a row that does not sample needs the MTP's next token (mtp_next_token)")
    return row.mtp_next_token
