"""On/off environment settings of the kernels, read strictly: a typo names the variable instead of
silently meaning off."""

from __future__ import annotations


def parse_switch(variable: str, text: str) -> bool:
    """`text` as the value of `variable`: "1" on, "0" off (surrounding spaces allowed); ValueError naming
    the variable and the value otherwise."""
    value = text.strip()
    if value not in ("0", "1"):
        raise ValueError(f"{variable} must be 0 or 1, got {text!r}")
    return value == "1"
