"""The environment's off switches of fast paths, kept for measuring what each gains (``benchmarks/engine.py
--env-variants``): each path is on unless its variable is ``0``. They are the only settings epmoe reads from the
environment besides the launcher's (``RANK``, ``WORLD_SIZE``, ...) and the cache directory, so they are listed in one
place, read through ``enabled``, and named by ``epmoe run``'s summary and ``epmoe serve``'s start log whenever one is
off (``switched_off``): a run never differs from another for a variable nobody sees."""

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
    """
    if name not in SWITCHES:
        raise KeyError(f"{name!r} is not one of epmoe's switches {sorted(SWITCHES)}")
    return os.environ.get(name, "1") != "0"


def switched_off() -> list[str]:
    """``"VARIABLE=0 turns off <its fast path>"`` for each switch that is off, in ``SWITCHES``' order (empty: all
    on)."""
    return [f"{name}=0 turns off {what}" for name, what in SWITCHES.items() if not enabled(name)]
