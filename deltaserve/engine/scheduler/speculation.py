"""Speculative decoding's policy: how many drafts a step verifies (the adaptive guard), and where the
drafts come from.

The guard keeps speculation from ever costing throughput. A step with k drafts per row emits, per row,
1 + a_1 + a_1 a_2 + ... + a_1...a_k tokens in expectation (a_i: the measured probability that draft i
is accepted given that the ones before it were), and costs 1 + k (DRAFT_STEP_COST + rows *
VERIFY_TOKEN_COST) plain steps: an MTP step is about a fifth of a target step at the 4B shape (its
full-vocabulary head dominates), and each verified token adds a little compute, which matters only as
the batch grows. The guard picks the k with the best ratio, 0 (plain decoding) included. When it has
stepped down to 0 for low acceptance it probes every PROBE_INTERVAL steps with PROBE_STEPS one-draft
steps (the first drafts, the next verifies what it drafted), so a workload that becomes predictable
again is noticed. Only requests whose MTP K/V has no gap verify (Request.mtp_gaps): after plain steps
those are the requests a probe admits. `adaptive=False` pins k at the configured count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltaserve.engine_config import SpeculativeConfig

DRAFT_STEP_COST = 0.2  # one MTP draft step, in target decode steps
VERIFY_TOKEN_COST = 0.01  # one more token per row in the verify forward, per row of the batch
PROBE_INTERVAL = 32  # plain steps between one-draft probes while the guard has speculation off
PROBE_STEPS = 2  # one-draft steps per probe: proposals are verified by the step after the one drafting
ACCEPTANCE_PRIOR = 0.8  # before any measurement
ACCEPTANCE_SMOOTHING = 0.1  # weight of one step's measurement in the running estimate


def expected_tokens(acceptance: list[float], k: int) -> float:
    """Tokens a row emits per step with k drafts: 1 + sum over i <= k of a_1 ... a_i."""
    total, run = 1.0, 1.0
    for a in acceptance[:k]:
        run *= a
        total += run
    return total


def step_cost(k: int, rows: int) -> float:
    return 1.0 + k * (DRAFT_STEP_COST + rows * VERIFY_TOKEN_COST)


def best_draft_length(acceptance: list[float], max_drafts: int, rows: int) -> int:
    """The k in 0..max_drafts with the most tokens per unit of step cost (the smallest on ties)."""
    best, best_rate = 0, 1.0
    for k in range(1, max_drafts + 1):
        rate = expected_tokens(acceptance, k) / step_cost(k, rows)
        if rate > best_rate + 1e-9:
            best, best_rate = k, rate
    return best


@dataclass(slots=True)
class DraftGuard:
    config: SpeculativeConfig
    acceptance: list[float] = field(default_factory=list)  # per draft position, conditional
    plain_steps: int = 0  # consecutive steps the guard has run without drafts
    probe_left: int = 0  # one-draft steps still owed to the probe under way

    def __post_init__(self) -> None:
        if not self.acceptance:
            self.acceptance = [ACCEPTANCE_PRIOR] * self.config.num_speculative_tokens

    def draft_length(self, rows: int) -> int:
        """Drafts per row for a step over `rows` decoders (a pure read)."""
        cfg = self.config
        if rows < 1:
            return 0
        if not cfg.adaptive:
            return cfg.num_speculative_tokens
        if rows > cfg.max_batch:
            return 0
        k = best_draft_length(self.acceptance, cfg.num_speculative_tokens, rows)
        if k == 0 and (self.probe_left > 0 or self.plain_steps >= PROBE_INTERVAL):
            return 1
        return k

    def record_step(self, drafted: bool) -> None:
        if not drafted:
            self.plain_steps += 1
            self.probe_left = 0  # a plain step drops the proposals a probe was to verify
            return
        if self.probe_left > 0:
            self.probe_left -= 1
        elif self.plain_steps >= PROBE_INTERVAL:
            self.probe_left = PROBE_STEPS - 1
        self.plain_steps = 0

    def record_verify(self, num_drafts: int, num_accepted: int) -> None:
        """One verify row: `num_accepted` leading drafts of its `num_drafts` were accepted. Position i
        was tried when the i - 1 before it were accepted."""
        for i in range(min(num_drafts, num_accepted + 1)):
            hit = 1.0 if i < num_accepted else 0.0
            self.acceptance[i] += ACCEPTANCE_SMOOTHING * (hit - self.acceptance[i])


@dataclass(slots=True)
class SpeculationCounters:
    """Since start, with vLLM's metric names (vllm:spec_decode_*)."""

    num_drafts: int = 0  # verify rows
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position.append(0)
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify row: 1 + accepted drafts on average (vLLM's "mean acceptance length")."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
