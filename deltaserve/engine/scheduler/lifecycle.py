"""Where a request dies: exactly one terminal update per request, and its caches back.

- retire: the request's single terminal; its pages and slot are freed (or handed to a decode-ahead step
  still running over it, which frees them once waited for: no KV or state is released under a running
  step);
- fail_requests: a step failed for these requests only;
- prune_closed_requests: requests whose client went away leave before admission (or while their grammar
  compiles), in the same tick
  (their pages and slot are free before anything else is planned). An async prefill owns its requests:
  the tick drains it (steps.finish_async_prefill) before pruning, and it retires its closed ones;
- terminal_scheduler_shutdown: on shutdown or a fatal error every owned request (compiling, queued,
  prefilling, in flight, decoding, or still in the inbox) gets one error, then a zero load snapshot is published.
  Launched steps are drained (waited for) before any of their requests' KV or state is released.
"""

from __future__ import annotations

import contextlib
import queue

from deltaserve.engine.protocol import AddRequest, LoadSnapshot, RequestUpdate, StepOutputs
from deltaserve.engine.scheduler import prefix
from deltaserve.engine.scheduler.request import Phase, Request
from deltaserve.engine.scheduler.state import SchedulerState


def release_caches(sched: SchedulerState, req: Request) -> None:
    """Gives the request's pages and slot back, or, while a launched step over it may still run,
    hands them to that step to release once it has been waited for (no KV or state is released under
    a running step)."""
    if req.seq is None:
        return
    step = req.launched
    if step is not None and not step.waited:
        step.deferred.append(req.seq)
    else:
        sched.cache.release(req.seq)
    req.seq = None


def retire(
    sched: SchedulerState,
    req: Request,
    *,
    update: RequestUpdate | None = None,
    finish_reason: str | None = None,
) -> None:
    """The request's single terminal: frees its pages and slot (at once, or when a launched step
    over it has been waited for, within the tick for an abort) and emits `update` (or a bare update
    with `finish_reason`)."""

    reason = update.finish_reason if update is not None else finish_reason
    if reason in ("stop", "length"):
        prefix.save_request_end(sched, req)
        if sched.benchmark_drafts is not None:
            sched.benchmark_drafts.record(req.prompt_token_ids, req.output_token_ids)
    release_caches(sched, req)
    req.phase = Phase.DONE
    sched.by_id.pop(req.request_id, None)
    if update is None:
        update = RequestUpdate(
            req.request_id,
            finish_reason=finish_reason,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_output_tokens=len(req.output_token_ids),
            num_preemptions=req.num_preemptions,
            num_cached_tokens=req.num_cached_tokens,
        )
    sched.updates.append(update)


def send_rejection(sched: SchedulerState, req: Request, message: str, field: str | None) -> None:
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


def fail_requests(sched: SchedulerState, reqs: list[Request], message: str) -> None:
    """A step failed for these requests only: each gets an error terminal; the others keep running."""
    failed = set(map(id, reqs))
    sched.running = [r for r in sched.running if id(r) not in failed]
    for req in reqs:
        if req in sched.prefilling:
            sched.prefilling.remove(req)
        retire(sched, req, update=RequestUpdate(req.request_id, finish_reason="error", error=message))


def prune_closed_requests(sched: SchedulerState) -> None:
    for name in ("compiling", "waiting", "prefilling"):
        q = getattr(sched, name)
        if any(r.closed for r in q):
            for req in [r for r in q if r.closed]:
                retire(sched, req, finish_reason="abort")
            setattr(sched, name, type(q)(r for r in q if not r.closed))
    if any(r.closed for r in sched.running):
        for req in [r for r in sched.running if r.closed]:
            retire(sched, req, finish_reason="abort")
        sched.running = [r for r in sched.running if not r.closed]


def terminal_scheduler_shutdown(sched: SchedulerState, message: str) -> None:
    """Fans out exactly one error to every owned request, releases every cache, publishes zero load."""

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
            inflight.wait(sched.cache)  # drained before its caches are released
        owned = inflight.requests
    else:
        owned = []
    owned += list(sched.compiling) + list(sched.waiting) + list(sched.prefilling) + list(sched.running)
    # A step that failed part-way holds requests no queue does (its prefill chunks are off the FIFO
    # until promoted or requeued): every live request is owned, wherever the failure left it.
    listed = {id(req) for req in owned}
    owned += [req for req in sched.by_id.values() if id(req) not in listed and req.phase is not Phase.DONE]
    sched.compiling = []
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
