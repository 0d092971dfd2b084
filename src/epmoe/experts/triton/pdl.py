"""Programmatic dependent launch (PDL, Hopper and later): whether a launch may use it.

A kernel launched as a programmatic dependent (Triton: ``launch_pdl=True``) is placed on the SMs as soon as every
program of the kernel before it in the stream has executed ``griddepcontrol.launch_dependents``
(``tl.extra.cuda.gdc_launch_dependents()``), instead of after that kernel has ended; it must execute
``griddepcontrol.wait`` (``tl.extra.cuda.gdc_wait()``) before it reads anything the kernel before it (or any kernel
before that) writes, and before it writes anything. Between its start and the wait it may only read what no kernel
still running can write: weights, so its first weight tiles are on their way while the kernel before it finishes,
and what was complete when its chain of dependent launches began (the expert down kernels read the routing's slots
so: the bf16 gate/up launch waits for the router, then allows them; the INT4 chain starts with an ordinary launch
after the router). Every program of a dependent launch executes the wait, also one with nothing to do, so that a
launch ends only after the launches before it have. At a decode step of a few rows, where every kernel is short,
this hides most of the gap between dependent launches (CUDA Programming Guide, "Programmatic Dependent Launch and
Synchronization").

``EPMOE_PDL=0`` in the environment turns it off everywhere (for measuring what it gains; ``epmoe.experts.switches``).
"""

from __future__ import annotations

import functools

import torch

from epmoe.experts.switches import enabled


@functools.cache
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_launch(t: torch.Tensor) -> bool:
    """Whether kernels working on ``t``'s device launch as programmatic dependents: a CUDA device of compute
    capability 9.0 or later (PDL's ``griddepcontrol`` instructions), unless ``EPMOE_PDL=0``."""
    return t.is_cuda and enabled("EPMOE_PDL") and _capable(t.device.index or 0)

