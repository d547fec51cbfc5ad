"""DELTASERVE_PROFILE_STARTUP: a start-up profile written and summarised when asked for, nothing otherwise."""

from __future__ import annotations

import logging
import pstats
import time

from deltaserve.startup_profile import ENV, profiled_startup


def _busy_start_up() -> None:
    end = time.monotonic() + 0.05
    while time.monotonic() < end:
        pass


def test_the_profile_is_written_and_its_slowest_functions_logged(tmp_path, monkeypatch, caplog) -> None:
    target = tmp_path / "profiles"  # created on demand
    monkeypatch.setenv(ENV, str(target))
    with caplog.at_level(logging.INFO, logger="deltaserve.startup_profile"), profiled_startup("engine"):
        _busy_start_up()
    [written] = list(target.iterdir())
    assert written.name.startswith("engine-") and written.suffix == ".prof"
    functions = {name for (_, _, name) in pstats.Stats(str(written)).stats}  # type: ignore[attr-defined]
    assert "_busy_start_up" in functions
    [message] = [r.getMessage() for r in caplog.records]
    assert str(written) in message
    assert "test_startup_profile.py" in message and "(_busy_start_up)" in message


def test_unset_profiles_nothing(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO, logger="deltaserve.startup_profile"), profiled_startup("engine"):
        _busy_start_up()
    assert not caplog.records
    assert not list(tmp_path.iterdir())


def test_an_error_in_the_start_up_still_writes_the_profile(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV, str(tmp_path))
    try:
        with profiled_startup("rank1"):
            raise RuntimeError("start-up failed")
    except RuntimeError:
        pass
    assert [p.name.startswith("rank1-") for p in tmp_path.iterdir()] == [True]
