"""One rank's forward path: the same code runs a step on rank 0 (under the backend, which then samples)
and on every other tensor-parallel rank (engine/tp.py).

The worker reads and writes only the pages and slots a step's rows name; it allocates nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deltaserve.cache.copies import CacheCopy
from deltaserve.cache.device import DeviceCaches
from deltaserve.engine.cuda_graphs import CudaGraphRunner, padded_logits_rows
from deltaserve.engine.prefill_graphs import PrefillGraphRunner
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.ops.batch import BatchRow, build_forward_batch


class ModelWorker:
    def __init__(
        self,
        model: Qwen35ForCausalLM,
        caches: DeviceCaches,
        graphs: CudaGraphRunner | None = None,
        prefill_graphs: PrefillGraphRunner | None = None,
    ) -> None:
        self.model = model
        self.caches = caches
        self.graphs = graphs
        self.prefill_graphs = prefill_graphs
        self.device = model.device

    @torch.inference_mode()
    def run(
        self,
        rows: list[BatchRow],
        fed: torch.Tensor | None = None,
        *,
        logits: bool = True,
        copies_before: Sequence[CacheCopy] = (),
        copies_after: Sequence[CacheCopy] = (),
        decode_graphs: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The cache copies before, the forward over `rows` (a decode graph when one fits, else a
        prefill graph when one fits; none when there are no rows), the copies after. With `logits`:
        float32 logits of the rows that need them and the hidden states of the scored tokens (None when
        no row scores); without (a rank that does not sample), (None, None). `fed`: input tokens of
        the first fed.shape[0] rows, on the device. Without `decode_graphs` (an overlapped step beside
        the decode steps that own them) a step of one-token rows runs as a prefill graph or eager."""
        self.caches.copy(copies_before)
        out = self._forward(rows, fed, logits, decode_graphs) if rows else (None, None)
        self.caches.copy(copies_after)
        return out

    def capture_ahead(self) -> bool:
        """Idle time: captures one graph serving is likely to need, the decode buckets not captured at
        start-up first, then prefill graphs; False when there is none left to capture (or no graphs)."""
        if self.graphs is not None and self.graphs.capture_ahead():
            return True
        return self.prefill_graphs is not None and self.prefill_graphs.capture_ahead()

    @property
    def captures_ahead_done(self) -> bool:
        """Whether idle time has no graph left to capture."""
        return (self.graphs is None or self.graphs.ahead_done) and (
            self.prefill_graphs is None or self.prefill_graphs.ahead_done
        )

    def _in_graphs(self, rows: list[BatchRow], fed: torch.Tensor | None) -> torch.Tensor | None:
        """Logits of a step with prompt chunks replayed from a prefill graph, decode rows and chunks in
        one forward (the weights read once; the GDN layers take the decode rows through their decode
        kernel), or None to run it eager."""
        prefill = self.prefill_graphs
        assert prefill is not None
        return prefill.run(rows, fed) if prefill.can_run(rows) else None

    def _forward(
        self, rows: list[BatchRow], fed: torch.Tensor | None, logits: bool, decode_graphs: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        graphs = self.graphs if decode_graphs else None
        scoring = any(r.scored for r in rows)
        if logits and graphs is not None and not scoring and _all_need_logits(rows) and graphs.can_run(rows):
            replayed = graphs.run(rows, fed)
            if replayed is not None:  # else its capture failed just now: a prefill graph or eager
                return replayed, None
        if logits and self.prefill_graphs is not None and not scoring:
            out = self._in_graphs(rows, fed)
            if out is not None:
                return out, None
        batch = build_forward_batch(rows, self.caches.page_size, self.device)
        if fed is not None:
            batch.input_ids[: fed.shape[0]] = fed
        hidden = self.model(batch, self.caches.kv, self.caches.states)
        if not logits:
            return None, None
        sampled = sum(r.need_logits for r in rows)
        return self._logits(hidden[:sampled]), hidden[sampled:] if scoring else None

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of an eager forward's rows; with decode graphs, the GEMM runs at the rows' bucket
        (zero rows appended), whose kernel their capture has loaded."""
        rows = hidden.shape[0]
        padded = rows if self.graphs is None else padded_logits_rows(rows, self.graphs.buckets)
        if padded > rows:
            hidden = torch.cat([hidden, hidden.new_zeros(padded - rows, hidden.shape[1])])
        return self.model.compute_logits(hidden, rows=rows)


def _all_need_logits(rows: list[BatchRow]) -> bool:
    return all(r.need_logits for r in rows)
