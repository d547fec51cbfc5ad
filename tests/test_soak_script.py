"""The soak script runs against a real server, within its time bound, and finds it sound."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from server_fixture import running_server


def test_a_short_soak_finds_no_hung_request_no_5xx_and_an_idle_server_after() -> None:
    with running_server("--max-queued-requests", "64", "--max-choices-per-request", "16") as server:
        started = time.monotonic()
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "deltaserve.bench.soak",
                "--base-url",
                server.url,
                "--duration-s",
                "6",
                "--server-pid",
                str(server.proc.pid),
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
        took = time.monotonic() - started
        assert result.returncode == 0, result.stdout + result.stderr
        summary = json.loads(result.stdout.strip().splitlines()[-1])
        assert summary["completed"] > 0 and summary["clean_errors"] > 0 and summary["disconnects"] > 0
        assert summary["hung"] == 0 and summary["server_errors"] == 0 and summary["returned_to_idle"]
        assert summary["rss_after_mib"] > 0 and took < 150
        assert server.proc.poll() is None and "Traceback" not in server.log()
