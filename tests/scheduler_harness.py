"""A scheduler over a small random HF-format model, driven tick by tick, with every update recorded."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from deltaserve.cache.device import build_device_caches
from deltaserve.cache.manager import CacheManager
from deltaserve.config import ModelConfig
from deltaserve.engine.backend import Backend
from deltaserve.engine.protocol import AbortRequest, AddRequest, RequestUpdate, StepOutputs
from deltaserve.engine.scheduler import Scheduler, SchedulerConfig
from deltaserve.engine_config import DEFAULT_KV_RESERVE_TOKENS, SpeculativeConfig
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.model.weights import load_weights
from deltaserve.sampling_params import SamplingParams

VOCAB = 512

# fp32 logprobs of one token computed in batches of another size or chunking differ in the order of
# their reductions; over ~40 steps of recurrent GDN state that reaches ~1.1e-4 on some CPUs (seen on
# a CI machine), so comparisons across batch shapes allow 5e-4. Tokens and ranks still match exactly.
LOGPROB_TOL = 5e-4


def load_model(model_dir: Path, mtp: bool = False, device: torch.device | None = None) -> Qwen35ForCausalLM:
    """The checkpoint's model in float32, on the CPU unless `device` says otherwise."""
    model = Qwen35ForCausalLM(
        ModelConfig.from_dir(model_dir), dtype=torch.float32, device=device or torch.device("cpu"), mtp=mtp
    )
    load_weights(model, model_dir)
    return model


class Run:
    def __init__(
        self,
        model: Qwen35ForCausalLM,
        *,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 4096,
        num_pages: int = 1024,
        page_size: int = 4,
        max_model_len: int = 2048,
        policy: str = "fcfs",
        prefill_overlap: bool = False,
        decode_ahead: bool = True,
        eos: tuple[int, ...] = (),
        num_snapshots: int = 0,
        speculative: SpeculativeConfig | None = None,
        vocab_size: int = VOCAB,
        kv_reserve_tokens: int = DEFAULT_KV_RESERVE_TOKENS,
    ) -> None:
        """`speculative`: MTP speculative decoding (the model needs its MTP head: load_model(mtp=True));
        the state pool then ends with the verify scratch slots."""
        scratch = 0 if speculative is None else speculative.max_batch * speculative.num_speculative_tokens
        caches = build_device_caches(
            model.config,
            num_pages=num_pages,
            page_size=page_size,
            num_slots=max_num_seqs + 1 + scratch,
            dtype=torch.float32,
            device=torch.device("cpu"),
            num_snapshots=num_snapshots,
            num_kv_layers=model.num_kv_layers,
        )
        config = SchedulerConfig(
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            vocab_size=vocab_size,
            eos_token_ids=eos,
            policy=policy,
            prefill_overlap=prefill_overlap,
            decode_ahead=decode_ahead,
            speculative=speculative,
            kv_reserve_tokens=kv_reserve_tokens,
        )
        self.updates: dict[str, list[RequestUpdate]] = defaultdict(list)
        self.loads = []
        self.caches = caches
        cache = CacheManager.for_device(caches, scratch_slots=scratch)
        self.sched = Scheduler(config, Backend(model, caches), self._publish, cache=cache)

    def _publish(self, out: StepOutputs) -> None:
        self.loads.append(out.load)
        for u in out.updates:
            self.updates[u.request_id].append(u)

    def add(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams | None = None,
        cache_points: list[int] = (),
        cache_salt: str | None = None,
    ) -> None:
        params = params or SamplingParams(temperature=0.0, max_tokens=8)
        self.sched.submit(
            AddRequest(rid, prompt, params, cache_points=list(cache_points), cache_salt=cache_salt)
        )

    def abort(self, rid: str) -> None:
        self.sched.submit(AbortRequest(rid))

    def tick(self, n: int = 1) -> None:
        for _ in range(n):
            self.sched.tick()

    def run_until_idle(self, limit: int = 100_000) -> None:
        for _ in range(limit):
            if not self.sched.tick():
                return
        raise AssertionError("scheduler did not go idle")

    def logprobs(self, rid: str) -> list:
        return [lp for u in self.updates[rid] for lp in (u.new_logprobs or [])]

    def tokens(self, rid: str) -> list[int]:
        return [t for u in self.updates[rid] for t in u.new_token_ids]

    def terminals(self, rid: str) -> list[RequestUpdate]:
        return [u for u in self.updates[rid] if u.finished]

    def terminal(self, rid: str) -> RequestUpdate:
        ends = self.terminals(rid)
        assert len(ends) == 1, f"{rid}: {len(ends)} terminal updates"
        return ends[0]
