"""Host-to-device copies of a step's small host data that do not make the host wait for the GPU.

torch's blocking host-to-device copy (``tensor.to("cuda")``, ``torch.tensor(values, device="cuda")``) synchronises
the stream after the copy, so the host waits for every kernel already queued before it goes on: one such copy in a
step ends the overlap of the host's work with the GPU's (the engine's overlap schedule prepares step ``n + 1``
while step ``n`` runs). ``to_device`` stages the data in pinned memory and copies it asynchronously instead; the
copy is ordered on the stream before the kernels that read it, and torch's caching host allocator keeps the pinned
block until the copy is done.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(data: torch.Tensor | np.ndarray | Sequence, device: torch.device,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """``data`` (a CPU tensor, a NumPy array or a sequence of numbers) as a tensor on ``device``.

    On CUDA the copy goes through pinned memory and is asynchronous (no host synchronisation); elsewhere it is an
    ordinary copy (on the CPU, the tensor itself when the dtype already matches).

    Args:
        data: the values, any shape.
        device: where the tensor goes.
        dtype: its dtype (``None``: ``data``'s, or torch's default for a sequence).

    Returns:
        The tensor on ``device``, of ``data``'s shape.
    """
    t = data if isinstance(data, torch.Tensor) else torch.as_tensor(data)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
