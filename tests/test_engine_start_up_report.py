"""How the API process reads its engine's start-up report (engine/client.py's wait_for_start_up_report)."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from deltaserve.engine.client import wait_for_start_up_report

# Asserts wall-clock bounds: `make test` runs it alone, after the tests it runs side by side.
pytestmark = pytest.mark.serial


class _LatePipe:
    """A pipe whose report lands just after a poll gave up: the race between the engine's send-then-exit
    and the reader's poll-then-is_alive."""

    def __init__(self, report: tuple[str, object]) -> None:
        self.report = report
        self.polls = 0

    def poll(self, timeout: float) -> bool:
        self.polls += 1
        return self.polls > 1

    def recv(self) -> tuple[str, object]:
        return self.report


class _ExitedProcess:
    exitcode = 1

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float) -> None:
        pass


def test_a_report_sent_just_before_the_engine_exited_is_read_not_lost_to_the_exit_code() -> None:
    message = "--max-model-len 999999 exceeds the model's max_position_embeddings (32768)"
    pipe = _LatePipe(("error", message))
    deadline = time.monotonic() + 10
    assert wait_for_start_up_report(pipe, _ExitedProcess(), deadline, 10) == ("error", message)


def _exit_silently(ready: object) -> None:
    raise SystemExit(3)


def test_an_engine_that_exits_without_a_report_is_named_by_its_exit_code() -> None:
    ctx = multiprocessing.get_context("spawn")
    parent_end, child_end = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_exit_silently, args=(child_end,))
    process.start()
    child_end.close()
    status, message = wait_for_start_up_report(parent_end, process, time.monotonic() + 60, 60)
    assert (status, message) == ("error", "the engine process exited during start-up (exit code 3)")


def test_an_engine_that_never_reports_runs_into_the_deadline() -> None:
    class _Silent:
        def poll(self, timeout: float) -> bool:
            return False

    class _Alive:
        def is_alive(self) -> bool:
            return True

    status, message = wait_for_start_up_report(_Silent(), _Alive(), time.monotonic() + 0.3, 0.3)
    assert (status, message) == ("error", "the engine did not become ready within 0 s")
