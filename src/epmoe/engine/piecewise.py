"""Piecewise CUDA graphs: a step's forward captured as graphs between its attention calls, attention eager between
the replays (vLLM's piecewise CUDA graphs; SGLang's ``--enable-piecewise-cuda-graph``).

A step with a prompt chunk too long for the row-wise graph steps ran eagerly: some thirty launches per decoder
layer from Python, so a prefill on a fast GPU waits for the host (each launch costs several microseconds of
Python and driver time, more than a layer's kernels take at a thousand tokens). Every op of a decoder layer but
attention works row by row, so the forward of a step of ``T`` rows padded to a bucket of ``B`` rows can be
captured once per ``B`` and replayed for any mix of prompt chunks and decodes of up to ``B`` rows. Attention,
whose work depends on which rows belong to which sequence, is the cut: the captured forward stops before each
layer's attention, the attention runs eagerly on the step's real ``AttnBatch``, and the next graph resumes
after it. A replay of ``L`` layers is ``L + 1`` graph launches and ``L`` eager attentions.

Staging. The piece before a cut copies the attention's inputs (rows ``[0, B)``) into staging buffers, and the
piece after it reads the attention's output from an output buffer; the buffers are shared by every layer and
every bucket (sized to the largest bucket, allocated by the first, uncaptured, warm-up forward), so a bucket's
graphs hold no per-layer activations. Sharing is safe because pieces and attentions run in stream order: piece
``i + 1`` has read layer ``i``'s output before attention ``i + 1`` writes the buffer again. The eager attention
reads only the step's real rows and writes only those; the padding rows of the output keep finite values (zeros,
or a previous step's rows), so the padding rows' experts never see NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

AttentionFn = Callable[..., torch.Tensor]


def piece_buckets(low: int, high: int) -> list[int]:
    """Token counts of the piecewise graphs from ``low`` to ``high``: 64 and 128, every multiple of 256 up to 2048,
    of 512 up to 4096, of 1024 above (a padded step wastes at most a fifth of its rows past 1024), and ``high``
    itself; only the ones in ``[low, high]`` (empty when ``high < low`` or ``high == 0``)."""
    sizes = {64, 128, high}
    for start, stop, step in ((256, 2048, 256), (2560, 4096, 512), (5120, high, 1024)):
        sizes |= set(range(start, min(high, stop) + 1, step))
    return sorted(s for s in sizes if low <= s <= high and s > 0)


@dataclass
class Cut:
    """One eager attention of a captured forward: ``fn(batch, *inputs[:rows])`` into ``out[:rows]``.

    Attributes:
        fn: the attention, ``fn(batch, *inputs) -> [rows, ...]``.
        inputs: its staged inputs, ``[B, ...]`` views of the shared staging buffers.
        out: ``[B, ...]`` view of the shared output buffer the next piece reads.
    """

    fn: AttentionFn
    inputs: tuple[torch.Tensor, ...]
    out: torch.Tensor

    def run(self, batch, rows: int) -> None:
        """The attention of the step's ``rows`` real rows over ``batch`` (its ``AttnBatch``), into ``out``."""
        if rows:
            self.out[:rows].copy_(self.fn(batch, *(x[:rows] for x in self.inputs)))


class Pieces:
    """The cuts of the piecewise forward being recorded or run, and the staging buffers they share.

    A model's attention calls ``cut(fn, out_tail, out_dtype, *inputs)`` (``attention.attend``,
    ``mla.MLAAttention.forward``) when its ``AttnBatch`` carries this object. Two modes:

    * recording (``record``): the inputs are staged, the output buffer view is returned unread and the cut is kept;
      ``on_cut`` (the runner's: end the running graph capture, begin the next) is called after the staging
      copies. Without ``on_cut`` (the warm-up forwards) nothing is captured.
    * running (``batch`` set, not recording): the cut runs at once, on ``batch`` (the graph path without graphs, on
      CPU).

    Args:
        max_rows: rows of the staging buffers (the largest bucket).
    """

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.batch = None
        self.rows = 0
        self._recording = False
        self._on_cut: Callable[[], None] | None = None
        self._cuts: list[Cut] = []
        self._buffers: dict[tuple, torch.Tensor] = {}

    def record(self, on_cut: Callable[[], None] | None) -> None:
        """Start recording a forward's cuts (``on_cut`` after each one's staging copies)."""
        self._recording, self._on_cut, self._cuts = True, on_cut, []

    def stop(self) -> list[Cut]:
        """Stop recording; the cuts recorded, in order."""
        cuts, self._cuts = self._cuts, []
        self._recording, self._on_cut = False, None
        return cuts

    def set_batch(self, batch, rows: int) -> None:
        """The step's real ``AttnBatch`` and row count, for cuts that run at once."""
        self.batch, self.rows = batch, rows

    def _buffer(self, role: tuple, tail: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The shared ``[max_rows, *tail]`` buffer of ``role`` (an input's position, or the output) and dtype."""
        key = (role, tail, dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.zeros((self.max_rows, *tail), dtype=dtype, device=device)
        return buf

    def cut(self, fn: AttentionFn, out_tail: tuple[int, ...], out_dtype: torch.dtype,
            *inputs: torch.Tensor) -> torch.Tensor:
        """An attention call of the forward: see the class docstring.

        Args:
            fn: ``fn(batch, *inputs) -> [rows, *out_tail]`` in ``out_dtype``.
            out_tail: the output's shape after its row dimension.
            out_dtype: its dtype.
            inputs: ``[B, ...]`` tensors, ``B`` the forward's rows.

        Returns:
            ``[B, *out_tail]``, a view of the shared output buffer.

        Raises:
            ValueError: more rows than the staging buffers hold.
        """
        rows = inputs[0].shape[0]
        if rows > self.max_rows:
            raise ValueError(f"a piecewise forward of {rows} rows; the staging buffers hold {self.max_rows}")
        staged = []
        for j, x in enumerate(inputs):
            buf = self._buffer(("in", j), tuple(x.shape[1:]), x.dtype, x.device)[:rows]
            buf.copy_(x)
            staged.append(buf)
        out = self._buffer(("out",), tuple(out_tail), out_dtype, inputs[0].device)[:rows]
        cut = Cut(fn, tuple(staged), out)
        if self._recording:
            self._cuts.append(cut)
            if self._on_cut is not None:
                self._on_cut()
        else:
            cut.run(self.batch, self.rows)
        return out
