"""`kill -USR1 <pid>` prints every thread's Python stack of a deltaserve process (the API server, the
engine, a tensor-parallel rank) to its stderr, which is the server log, and the process runs on. The
way to see where a process that looks stuck is waiting, with no debugger on the machine."""

from __future__ import annotations

import faulthandler
import signal
import sys


def dump_stacks_on_sigusr1() -> None:
    """Installs the dump for this process, onto stderr (the process's own file descriptor 2 where
    sys.stderr has been replaced by an object without one); a no-op where SIGUSR1 does not exist."""
    if not hasattr(signal, "SIGUSR1"):
        return
    for stream in (sys.stderr, sys.__stderr__):
        try:
            faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
            return
        except (AttributeError, ValueError, OSError):  # no file descriptor behind this stream
            continue
