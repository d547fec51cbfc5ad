"""kill -USR1 prints a deltaserve process's thread stacks to its stderr and the process runs on."""

from __future__ import annotations

import faulthandler
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")

WAITER = """
import sys, time
from deltaserve.stack_dumps import dump_stacks_on_sigusr1
dump_stacks_on_sigusr1()
def waiting_here():
    print("ready", flush=True)
    time.sleep(60)
waiting_here()
"""


def test_sigusr1_dumps_every_threads_stack_and_the_process_runs_on() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", WAITER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        assert proc.poll() is None  # still running: the dump does not end the process
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM
    assert "most recent call first" in err and "waiting_here" in err, err


def test_the_server_the_engine_and_each_rank_install_the_dump() -> None:
    import inspect

    from deltaserve import cli
    from deltaserve.engine import process, tp

    for entry in (cli._cmd_serve, process.run_engine_process, tp.run_rank):
        assert "dump_stacks_on_sigusr1()" in inspect.getsource(entry), entry.__qualname__


def test_the_dump_installs_where_sys_stderr_has_no_file_descriptor(capsys) -> None:
    """Under a replaced sys.stderr (pytest's capture, a logging shim) it writes to file descriptor 2."""
    from deltaserve.stack_dumps import dump_stacks_on_sigusr1

    dump_stacks_on_sigusr1()  # pytest's capture: sys.stderr has no fileno()
    assert faulthandler.unregister(signal.SIGUSR1)  # it was registered
