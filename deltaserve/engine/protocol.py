"""Messages between an engine client (the offline LLM or the API server) and the EngineCore.

The same dataclasses travel in-process (queues) and between processes (msgpack via msgspec). Each
request gets exactly one terminal update: finish_reason in FINISH_REASONS, with `error` set for
"rejected" and "error".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from deltaserve.sampling_params import SamplingParams

FINISH_REASONS = ("stop", "length", "abort", "rejected", "error")


@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0  # monotonic seconds, set by the client
    echo: bool = False  # a contract the engine refuses (fail-closed) rather than degrades
    # Prompt positions where a later request is likely to diverge (chat message boundaries): the
    # prefix cache saves the GDN state there (engine/scheduler/prefix.py).
    cache_points: list[int] = field(default_factory=list)
    # vLLM's cache_salt: only requests with the same salt share cached prefixes (deltaserve.cache.prefix)
    cache_salt: str | None = None


@dataclass(slots=True)
class AbortRequest:
    """The client is gone (or cancelled): the request is pruned at the next tick, before admission."""

    request_id: str


@dataclass(slots=True)
class Shutdown:
    reason: str = "engine shutdown"


@dataclass(slots=True)
class ResetPrefixCache:
    """Forget every cached page and state snapshot (requests in flight keep theirs)."""


@dataclass(slots=True)
class TokenLogprobs:
    logprob: float  # of the sampled token, from the unmodified distribution
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass(slots=True)
class RequestUpdate:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # None while the request runs; one of FINISH_REASONS at its end
    stop_reason: int | None = None  # the stop_token_id that finished it
    error: str | None = None  # rejected/error: what went wrong, naming the field where one is at fault
    error_field: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    queued_time: float | None = None  # monotonic: first scheduled minus arrival, set on the first token
    # Asked-for prompt logprobs, once, with the first token: entry i scores prompt token i (None for i=0).
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def coalesce_updates(updates: list[RequestUpdate]) -> RequestUpdate:
    """One request's consecutive updates as the one update an engine emitting them all at once would
    have sent: tokens and logprobs joined in order, counts and the end (finish, stop, error) from the
    last, what comes once (queue time, prompt logprobs) from the first that has it. A client that fell
    behind its engine hands each request's backlog on as one delta rather than one per step."""
    if len(updates) == 1:
        return updates[0]
    last = updates[-1]
    logprobs = [u.new_logprobs for u in updates if u.new_logprobs is not None]
    return RequestUpdate(
        last.request_id,
        new_token_ids=[t for u in updates for t in u.new_token_ids],
        new_logprobs=[lp for batch in logprobs for lp in batch] if logprobs else None,
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        error=last.error,
        error_field=last.error_field,
        num_prompt_tokens=next((u.num_prompt_tokens for u in reversed(updates) if u.num_prompt_tokens), 0),
        num_output_tokens=last.num_output_tokens,
        num_preemptions=last.num_preemptions,
        num_cached_tokens=last.num_cached_tokens,
        queued_time=next((u.queued_time for u in updates if u.queued_time is not None), None),
        prompt_logprobs=next((u.prompt_logprobs for u in updates if u.prompt_logprobs is not None), None),
    )


@dataclass(slots=True, frozen=True)
class LoadSnapshot:
    running: int = 0  # requests holding a state slot: prefilling, in flight or decoding
    waiting: int = 0
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    state_slots_free: int = 0
    state_slots_total: int = 0
    num_preemptions: int = 0  # since start
    prefix_cache_queries: int = 0  # since start: prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # since start: of those, tokens found cached
    kv_pages_cached: int = 0  # pages registered under a content key (shared or reusable)
    state_snapshots_used: int = 0
    state_snapshots_total: int = 0
    # Speculative decoding, since start: verify rows, drafts they verified, drafts accepted, and
    # accepted drafts by position (index i: the (i+1)-th draft of a row).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()

    @property
    def kv_usage(self) -> float:
        return self.kv_pages_used / self.kv_pages_total if self.kv_pages_total else 0.0


@dataclass(slots=True)
class StepOutputs:
    """Everything one scheduler tick produced, delivered as one message."""

    updates: list[RequestUpdate]
    load: LoadSnapshot


@dataclass(slots=True)
class Heartbeat:
    """Sent by the engine process every HEARTBEAT_INTERVAL_S, whatever its scheduler loop is doing: its
    absence means the process is frozen; a growing `stalled_s` while the client has requests in flight
    means the loop is stuck (or in a long step)."""

    stalled_s: float  # since the scheduler loop last completed a tick (it replaces its load each tick)
    load: LoadSnapshot


HEARTBEAT_INTERVAL_S = 0.5

ClientMessage = AddRequest | AbortRequest | Shutdown | ResetPrefixCache
EngineMessage = StepOutputs | Heartbeat

_encoder = msgspec.msgpack.Encoder()
_envelope = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
_client_decoders = {
    t.__name__: msgspec.msgpack.Decoder(t) for t in (AddRequest, AbortRequest, Shutdown, ResetPrefixCache)
}
_engine_decoders = {t.__name__: msgspec.msgpack.Decoder(t) for t in (StepOutputs, Heartbeat)}


def encode_client_message(msg: ClientMessage) -> bytes:
    return _encoder.encode((type(msg).__name__, msg))


def decode_client_message(data: bytes) -> ClientMessage:
    name, payload = _envelope.decode(data)
    return _client_decoders[name].decode(payload)


def encode_engine_message(msg: EngineMessage) -> bytes:
    return _encoder.encode((type(msg).__name__, msg))


def decode_engine_message(data: bytes) -> EngineMessage:
    name, payload = _envelope.decode(data)
    return _engine_decoders[name].decode(payload)
