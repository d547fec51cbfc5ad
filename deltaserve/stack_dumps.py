"""`kill -USR1 <pid>` prints every thread's Python stack of a deltaserve process (the API server, the
engine, a tensor-parallel rank) to its stderr, which is the server log, and the process runs on. The
way to see where a process that looks stuck is waiting, with no debugger on the machine."""

from __future__ import annotations

import faulthandler
import signal


def dump_stacks_on_sigusr1() -> None:
    """Installs the dump for this process (POSIX; a no-op where SIGUSR1 does not exist)."""
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
