"""The start-up logs' process clock (Linux /proc)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deltaserve.process_clock import since_start_note

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_a_process_that_slept_half_a_second_reports_about_that():
    code = "import time; time.sleep(0.5); from deltaserve.process_clock import *; print(seconds_since_process_start())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert 0.45 <= float(out) < 5.0


def test_the_note_reads_as_a_clause():
    assert since_start_note().startswith(", ") and since_start_note().endswith(" s after the process started")
