"""DELTASERVE_ITL_DEBUG=1: the latency log, read once at import.

The engine logs one ITL_STEP line per scheduler step (deltaserve/engine/scheduler/telemetry.py) and the
API server one ITL_REQ line per request at its first token (deltaserve/server/metrics.py), both on the
"deltaserve.itl" logger with times on the host's monotonic clock, which the two processes share:
`deltaserve bench steps` puts a request's time to first token beside the steps that made it.
"""

from __future__ import annotations

import logging
import os

ITL_DEBUG = os.environ.get("DELTASERVE_ITL_DEBUG", "") not in ("", "0", "false")

logger = logging.getLogger("deltaserve.itl")
