"""Emission concerns: exactly one terminal update per request.

- prune_closed_requests: requests whose client went away leave before admission, in the same tick
  (their pages and slot are free before anything else is planned);
- reject_unsupported: contracts the engine refuses (echo, prompt logprobs, n > 1) and invalid fields are
  rejected fail-closed with a reason, never silently degraded;
- terminal_scheduler_shutdown: on shutdown or a fatal error every owned request (queued, prefilling, in
  flight, decoding, or still in the inbox) gets one error, then a zero load snapshot is published.
An async prefill is always drained (waited for) before any of its requests' KV or state is released.
So is a decode-ahead step: a request retiring while one runs over it hands its pages and slot to the
step, which releases them once waited for (steps.release_caches); its tokens go only to running requests.
"""

from __future__ import annotations

import contextlib
import queue
from typing import TYPE_CHECKING

from deltaserve.engine.protocol import AddRequest, LoadSnapshot, RequestUpdate, StepOutputs
from deltaserve.engine.structured import StructuredOutputError
from deltaserve.errors import RequestValidationError

if TYPE_CHECKING:
    from deltaserve.engine.scheduler import Request, Scheduler

UNSUPPORTED_ECHO_MESSAGE = "echo=true is not supported: the engine does not return prompt tokens"


def retire(
    sched: Scheduler, req: Request, *, update: RequestUpdate | None = None, finish_reason: str | None = None
) -> None:
    """The request's single terminal: frees its pages and slot (at once, or when a decode-ahead step
    over it has been waited for, within the tick for an abort) and emits `update` (or a bare update
    with `finish_reason`)."""
    from deltaserve.engine.scheduler import Phase, steps

    steps.release_caches(sched, req)
    req.phase = Phase.DONE
    sched.by_id.pop(req.request_id, None)
    if update is None:
        update = RequestUpdate(
            req.request_id,
            finish_reason=finish_reason,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_output_tokens=len(req.output_token_ids),
            num_preemptions=req.num_preemptions,
        )
    sched.updates.append(update)


def send_rejection(sched: Scheduler, req: Request, message: str, field: str | None) -> None:
    retire(
        sched,
        req,
        update=RequestUpdate(
            req.request_id,
            finish_reason="rejected",
            error=message,
            error_field=field,
            num_prompt_tokens=len(req.prompt_token_ids),
        ),
    )


def fail_requests(sched: Scheduler, reqs: list[Request], message: str) -> None:
    """A step failed for these requests only: each gets an error terminal; the others keep running."""
    failed = set(map(id, reqs))
    sched.running = [r for r in sched.running if id(r) not in failed]
    for req in reqs:
        if req in sched.prefilling:
            sched.prefilling.remove(req)
        retire(sched, req, update=RequestUpdate(req.request_id, finish_reason="error", error=message))


def prune_closed_requests(sched: Scheduler) -> None:
    if sched.inflight is not None and any(r.closed for r in sched.inflight.requests):
        from deltaserve.engine.scheduler import steps

        steps.finish_async_prefill(sched)  # drain first: the device may still read their state
    for name in ("waiting", "prefilling"):
        q = getattr(sched, name)
        if any(r.closed for r in q):
            for req in [r for r in q if r.closed]:
                retire(sched, req, finish_reason="abort")
            setattr(sched, name, type(q)(r for r in q if not r.closed))
    if any(r.closed for r in sched.running):
        for req in [r for r in sched.running if r.closed]:
            retire(sched, req, finish_reason="abort")
        sched.running = [r for r in sched.running if not r.closed]


def reject_unsupported(sched: Scheduler) -> None:
    """Checks each newly queued request once; a failing one is rejected before any accounting."""
    bad: list[tuple[Request, str, str]] = []
    for req in sched.waiting:
        if req.checked:
            continue
        req.checked = True
        problem = _submission_problem(sched, req)
        if problem is not None:
            bad.append((req, *problem))
    if bad:
        for req, field, message in bad:
            send_rejection(sched, req, message, field)
        gone = set(id(r) for r, _, _ in bad)
        sched.waiting = type(sched.waiting)(r for r in sched.waiting if id(r) not in gone)


def _submission_problem(sched: Scheduler, req: Request) -> tuple[str, str] | None:
    if req.echo:
        return "echo", UNSUPPORTED_ECHO_MESSAGE
    try:
        req.params.validate()
        req.params.validate_token_ids(sched.config.vocab_size)
    except RequestValidationError as err:
        return err.field, err.message
    prompt = req.prompt_token_ids
    if not prompt:
        return "prompt", "prompt must contain at least one token, got an empty prompt"
    vocab = sched.config.vocab_size
    for i, tok in enumerate(prompt):
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab:
            return "prompt", f"prompt token {i} must be a token id in [0, {vocab}), got {tok!r}"
    spec = req.params.structured_output
    if spec is not None:
        if sched.grammars is None:
            return "structured_output", "structured output is not available on this engine (no tokenizer)"
        try:
            req.grammar = sched.grammars.grammar(spec)
        except StructuredOutputError as err:
            return "structured_output", str(err)
    return None


def terminal_scheduler_shutdown(sched: Scheduler, message: str) -> None:
    """Fans out exactly one error to every owned request, releases every cache, publishes zero load."""
    from deltaserve.engine.scheduler import Phase

    sched.stopped = True
    if sched.decode_ahead is not None:
        ahead = sched.decode_ahead
        sched.decode_ahead = None  # its requests are in `running`; its tokens are dropped with them
        with contextlib.suppress(Exception):  # its own failure does not change the outcome
            ahead.wait(sched.cache)  # drained before its requests' caches are released
    if sched.inflight is not None:
        inflight = sched.inflight
        sched.inflight = None
        with contextlib.suppress(Exception):  # its own failure does not change the outcome
            inflight.pending.wait()  # drained before its caches are released
        owned = inflight.requests
    else:
        owned = []
    owned += list(sched.waiting) + list(sched.prefilling) + list(sched.running)
    # A step that failed part-way holds requests no queue does (its prefill chunks are off the FIFO
    # until promoted or requeued): every live request is owned, wherever the failure left it.
    listed = {id(req) for req in owned}
    owned += [req for req in sched.by_id.values() if id(req) not in listed and req.phase is not Phase.DONE]
    sched.waiting.clear()
    sched.prefilling.clear()
    sched.running = []
    for req in owned:
        retire(sched, req, update=RequestUpdate(req.request_id, finish_reason="error", error=message))
    while True:  # requests submitted but never drained are owned too
        try:
            msg = sched.inbox.get_nowait()
        except queue.Empty:
            break
        if isinstance(msg, AddRequest):
            sched.updates.append(RequestUpdate(msg.request_id, finish_reason="error", error=message))
    sched.by_id.clear()
    sched.load = LoadSnapshot(
        kv_pages_total=sched.cache.kv.capacity,
        state_slots_free=sched.cache.states.num_free,
        state_slots_total=sched.cache.states.capacity,
        num_preemptions=sched.num_preemptions,
    )
    updates, sched.updates = sched.updates, []
    sched.publish(StepOutputs(updates, sched.load))
