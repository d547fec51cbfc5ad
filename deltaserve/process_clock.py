"""Seconds since this process started, for the start-up log lines (Linux /proc; None elsewhere)."""

from __future__ import annotations

import os


def seconds_since_process_start() -> float | None:
    try:
        with open("/proc/self/stat") as f:
            # Fields after the parenthesised command name start at field 3; starttime is field 22.
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def since_start_note() -> str:
    """', N.N s after the process started' (empty where the start time is unknown)."""
    seconds = seconds_since_process_start()
    return "" if seconds is None else f", {seconds:.1f} s after the process started"
