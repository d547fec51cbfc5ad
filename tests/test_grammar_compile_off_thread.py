"""A structured-output request whose grammar is not compiled yet, arriving while others run, compiles on
the grammar backend's thread: the running requests keep their steps meanwhile, and the request joins
the queue when its grammar is ready (or is rejected with the compilation's error). It can be aborted
while it waits, and shutdown ends it. With nothing running, the grammar compiles in the tick."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import hf_oracle
import pytest
from scheduler_harness import VOCAB, Run, load_model

from deltaserve.engine.protocol import Shutdown
from deltaserve.engine.structured import GrammarBackend
from deltaserve.sampling_params import SamplingParams, StructuredOutputParams

# Asserts wall-clock bounds: `make test` runs it alone, after the tests it runs side by side.
pytestmark = pytest.mark.serial

pytest.importorskip("xgrammar")

EOS = 1
YES, NO = 10, 11
# Token strings for the harness model's ids: "yes" and "no" are one token each, the rest never spell them.
STRINGS = ["" if i == EOS else {YES: "yes", NO: "no"}.get(i, f"<{i}>") for i in range(VOCAB)]
FREE = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
CHOICE = SamplingParams(
    temperature=0.0, max_tokens=4, structured_output=StructuredOutputParams(choice=["yes", "no"])
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("grammar_model")
    hf_oracle.save_text_layout(hf_oracle.build_hf_causal_lm(seed=5, layers=4, tied=True), out)
    return load_model(Path(out))


class HeldCompiles:
    """The backend's compilations wait for `release` (on whichever thread they run)."""

    def __init__(self, backend: GrammarBackend) -> None:
        self.started, self.release = threading.Event(), threading.Event()
        self.threads: list[str] = []
        compile_ = backend.grammar

        def held(spec: StructuredOutputParams):
            self.threads.append(threading.current_thread().name)
            self.started.set()
            assert self.release.wait(30), "the test never released the compilation"
            return compile_(spec)

        backend.grammar = held  # type: ignore[method-assign]


def _run_with_grammars(model) -> tuple[Run, HeldCompiles]:
    run = Run(model, eos=(EOS,))
    backend = GrammarBackend(lambda: STRINGS, [EOS])
    run.sched.grammars = backend
    return run, HeldCompiles(backend)


def _tick_until(run: Run, done, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        if not run.sched.tick():
            time.sleep(0.005)


def test_other_requests_keep_stepping_while_a_grammar_compiles_then_it_runs_constrained(model):
    run, held = _run_with_grammars(model)
    run.add("free", [3, 4, 5], FREE)
    run.tick(2)
    run.add("choice", [6, 7], CHOICE)
    run.tick()
    assert held.started.wait(10)
    before = len(run.tokens("free"))
    run.tick(5)  # the former code compiled inside the first of these ticks, blocking them all
    assert len(run.tokens("free")) >= before + 5
    assert run.tokens("choice") == [] and run.sched.load.waiting == 1
    assert held.threads == ["deltaserve-grammar-compile_0"]
    held.release.set()
    _tick_until(run, lambda: run.terminals("choice"))
    assert run.terminal("choice").finish_reason == "stop"
    assert run.tokens("choice")[0] in (YES, NO) and not run.sched.compiling
    run.run_until_idle()
    assert len(run.tokens("free")) == 40


def test_a_grammar_that_fails_to_compile_rejects_its_request_and_nothing_else(model):
    run, held = _run_with_grammars(model)
    held.release.set()
    run.add("free", [3, 4, 5], FREE)
    run.tick(2)
    bad = SamplingParams(max_tokens=4, structured_output=StructuredOutputParams(ebnf="root ::= nope"))
    run.add("bad", [6, 7], bad)
    _tick_until(run, lambda: run.terminals("bad"))
    end = run.terminal("bad")
    assert end.finish_reason == "rejected" and end.error_field == "structured_output", end
    run.run_until_idle()
    assert len(run.tokens("free")) == 40 and not run.sched.compiling


def test_a_request_aborted_or_shut_down_while_its_grammar_compiles_gets_one_terminal(model):
    run, held = _run_with_grammars(model)
    run.add("free", [3, 4, 5], FREE)
    run.tick(2)
    run.add("gone", [6, 7], CHOICE)
    run.add("kept", [8, 9], CHOICE)
    run.tick()
    assert held.started.wait(10)
    run.abort("gone")
    run.tick()
    assert run.terminal("gone").finish_reason == "abort" and [r.request_id for r in run.sched.compiling] == [
        "kept"
    ]
    run.sched.submit(Shutdown("stopping"))
    run.tick()
    assert run.terminal("kept").error == "stopping" and run.terminal("free").error == "stopping"
    assert not run.sched.compiling and not run.sched.by_id
    held.release.set()  # the compilation ends after its request: nothing more is sent
    time.sleep(0.1)
    assert len(run.terminals("kept")) == 1 and len(run.terminals("gone")) == 1


def test_with_nothing_running_the_grammar_compiles_in_the_tick(model):
    run, held = _run_with_grammars(model)
    held.release.set()
    run.add("choice", [6, 7], CHOICE)
    run.tick()
    assert held.threads == [threading.current_thread().name] and not run.sched.compiling
    run.run_until_idle()
    assert run.terminal("choice").finish_reason == "stop" and run.tokens("choice")[0] in (YES, NO)
