"""The environment's off switches of fast paths, kept for measuring what each gains (``benchmarks/engine.py
--env-variants``): each path is on unless its variable is ``0`` (``1`` or unset: on; any other value is refused).
They are the only settings epmoe reads from the environment besides the launcher's (``RANK``, ``WORLD_SIZE``, ...)
and the cache directory, so they are listed in one place, read through ``enabled``, and named by ``epmoe run``'s
summary and ``epmoe serve``'s start log whenever one is off (``switched_off``): a run never differs from another for
a variable nobody sees."""

from __future__ import annotations

import os

SWITCHES = {
    "EPMOE_PDL": "the Triton kernels' programmatic dependent launches (Hopper)",
    "EPMOE_GEMV": "the Triton matrix-vector kernel of the projections at a few rows",
    "EPMOE_FOLD_NORM": "the norms folded into the kernels after them at one row",
    "EPMOE_SHARED_OVERLAP": "the shared experts on a side stream beside the routed ones",
}
"""``{variable: the fast path it turns off}``."""


def enabled(name: str) -> bool:
    """Whether the fast path of switch ``name`` (a key of ``SWITCHES``) is on: unless its variable is ``0``.

    Raises:
        KeyError: ``name`` is not a switch (the known ones listed).
        ValueError: its variable holds another value than ``0`` or ``1`` (``check_switches``).
    """
    if name not in SWITCHES:
        raise KeyError(f"{name!r} is not one of epmoe's switches {sorted(SWITCHES)}")
    value = os.environ.get(name, "1")
    if value not in ("0", "1"):
        raise ValueError(f"environment variable {name}={value!r}: epmoe's switches take 0 (turns off "
                         f"{SWITCHES[name]}) or 1 (on, the default)")
    return value == "1"


def check_switches() -> None:
    """Refuse a switch variable set to another value than ``0`` or ``1`` (``false`` would read as on): ``epmoe run``
    and ``epmoe serve`` call it before any rank starts.

    Raises:
        ValueError: the first such variable, named with its value.
    """
    for name in SWITCHES:
        enabled(name)


def switched_off() -> list[str]:
    """``"VARIABLE=0 turns off <its fast path>"`` for each switch that is off, in ``SWITCHES``' order (empty: all
    on)."""
    return [f"{name}=0 turns off {what}" for name, what in SWITCHES.items() if not enabled(name)]
