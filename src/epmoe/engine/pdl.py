"""Programmatic dependent launch (PDL, Hopper) for the engine's small per-layer kernels.

A decode step at batch 1 is some twenty kernels per decoder layer, most of them a few microseconds long; between
two dependent kernels the GPU idles while the second is launched and its programs are placed. Launched as a
programmatic dependent launch (``cudaLaunchAttributeProgrammaticStreamSerialization``; Triton's
``launch_pdl=True``), a kernel may start while the kernel before it is still running: its programs are placed and
wait (``griddepcontrol.wait``, ``tl.extra.cuda.gdc_wait``) until the kernel before it has completed and its writes
are visible, so the launch overlaps the previous kernel instead of following it. The engine's kernels that take
part wait at their very start, before any global read or write, and then allow their own dependents to launch
(``gdc_launch_dependents``): stream order is kept exactly, only the launch latency is hidden. CUDA graphs keep the
programmatic edges.

Only small launches take part: a dependent's programs hold SM slots while they wait, which would slow a large
primary (a prefill's thousands of programs).
"""

from __future__ import annotations

import functools

import torch

# launches of at most this many programs are programmatic dependent launches (see the module docstring)
PDL_MAX_PROGRAMS = 2048


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(x: torch.Tensor, programs: int) -> bool:
    """Whether a launch of ``programs`` programs over ``x``'s device is a programmatic dependent launch: a CUDA
    tensor (not the Triton interpreter's CPU tensors) on compute capability 9.0 or above, and a small grid."""
    return x.is_cuda and programs <= PDL_MAX_PROGRAMS and _hopper(x.device.index if x.device.index is not None
                                                                   else torch.cuda.current_device())
