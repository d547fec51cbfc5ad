"""Benchmark-only draft sources for speculative decoding (never for serving).

Random weights give an MTP head whose proposals are almost never accepted, so the mechanism is
measured at known acceptance instead: `benchmark_draft` "record" speculates with the MTP head's own
proposals and appends every finished request's prompt and output token ids to
`benchmark_draft_file` (JSON lines); a later run of the same greedy requests with "replay" proposes
the recorded next tokens (every proposal accepted) or with "wrong" a token that differs from each of
them (every proposal rejected). The MTP head still runs, so the measured cost is the real one; the
draft count is pinned while recording. A request whose prompt is not in the recording keeps the MTP
head's proposals.

"accept" needs no recording: the MTP head's proposals are accepted whatever the target says (the
engine emits the proposals and the target's token after the last one, and commits the state of the
last proposal), so every step has the cost of a step at 100% acceptance. The output is then the
proposals', not the model's: it measures the mechanism only. It exists because a recording made in
16-bit on the GPU does not replay bit for bit (see the GPU record), which leaves "replay" short of
100% there.

The recording is made on the speculative path because in 16-bit a verify forward and a plain decode
step round differently (other kernels, other GEMM shapes), and random weights leave the top logits so
close that the greedy tokens of the two paths part within a few dozen tokens; the verify path itself
gives each position the same logits whatever the drafts (every op is causal and per row), so its
recording is replayed exactly.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from deltaserve.engine_config import SpeculativeConfig
from deltaserve.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class BenchmarkDrafts:
    mode: str  # "record", "replay", "wrong" or "accept"
    path: Path | None
    vocab_size: int
    recorded: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    @classmethod
    def open(cls, spec: SpeculativeConfig, vocab_size: int) -> BenchmarkDrafts | None:
        if spec.benchmark_draft is None:
            return None
        path = None if spec.benchmark_draft_file is None else Path(spec.benchmark_draft_file)
        source = cls(spec.benchmark_draft, path, vocab_size)
        if path is not None and source.mode != "record":
            source.recorded = _read_recording(path)
        logger.warning(
            "speculative decoding with benchmark-only drafts (%s, %s): not for serving",
            source.mode,
            source.path or "no recording",
        )
        return source

    def proposals(self, prompt: Sequence[int], num_output: int, mtp: list[int]) -> list[int]:
        """Drafts for the output tokens from index `num_output` on: the recording's next len(mtp)
        tokens (replay), each of them shifted to another id (wrong), or `mtp` when the prompt was not
        recorded."""
        recorded = self.recorded.get(tuple(prompt))
        if recorded is None:
            return mtp
        start = num_output
        nxt = recorded[start : start + len(mtp)]
        if self.mode == "wrong":
            return [(t + 1) % self.vocab_size for t in nxt]
        return nxt

    @property
    def pins_draft_count(self) -> bool:
        """Recording and forced acceptance verify every step at the configured draft count."""
        return self.mode in ("record", "accept")

    @property
    def forces_acceptance(self) -> bool:
        return self.mode == "accept"

    def record(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        if self.mode != "record" or self.path is None:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"prompt_token_ids": list(prompt), "output_token_ids": list(output)}) + "\n")


def _read_recording(path: Path) -> dict[tuple[int, ...], list[int]]:
    if not path.is_file():
        raise ConfigError(
            f"--speculative-config: benchmark_draft_file {path} does not exist (record it first with "
            '"benchmark_draft": "record")'
        )
    recorded: dict[tuple[int, ...], list[int]] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            recorded[tuple(item["prompt_token_ids"])] = list(item["output_token_ids"])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}:{number}: not a recorded request ({exc})") from None
    return recorded
