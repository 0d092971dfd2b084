"""The figure files ``epmoe plan --plot`` and ``epmoe balance --plot`` write: the path checked and its format read
from its suffix before any work, so a name matplotlib cannot write is refused at once, not after the planning or
balancing (nor written as a PNG under a name that says otherwise)."""

from __future__ import annotations

import shutil
from pathlib import Path

from epmoe.files import check_output_path

DEFAULT_PLOT_FORMAT = "png"  # of a path without a suffix


def plot_formats() -> dict[str, str]:
    """The figure formats matplotlib writes here: ``{suffix without the dot: description}``, sorted by suffix.

    matplotlib's own list (``Figure().canvas.get_supported_filetypes()``), less ``pgf`` when the TeX system it runs
    (``rcParams["pgf.texsystem"]``, ``xelatex`` by default) is not on ``PATH``.
    """
    import matplotlib
    from matplotlib.figure import Figure

    formats = dict(Figure().canvas.get_supported_filetypes())
    if shutil.which(matplotlib.rcParams["pgf.texsystem"]) is None:
        formats.pop("pgf", None)
    return dict(sorted(formats.items()))


def check_plot_path(field: str, value: str | Path) -> tuple[Path, str]:
    """A figure's path and format, checked up front: the path as ``files.check_output_path`` checks it, the format
    its suffix (case ignored; no suffix: PNG).

    Args:
        field: the option or argument name for messages (``--plot``, ``plot``).
        value: the path given.

    Returns:
        ``(path, format)``: ``value`` as a ``Path`` and the matplotlib format name (``png``, ``pdf``, ``svg``, ...).

    Raises:
        ValueError: the path cannot be written (``check_output_path``), or its suffix names no format matplotlib
            writes here (the message names ``field``, the value and the suffixes it writes).
    """
    path = check_output_path(field, value, "a figure file path (.png, .pdf, .svg, ...)")
    suffix = path.suffix[1:].lower()
    if not suffix:
        return path, DEFAULT_PLOT_FORMAT
    formats = plot_formats()
    if suffix not in formats:
        import matplotlib

        known = ", ".join(f".{s}" for s in formats)
        why = (f"'.pgf' needs {matplotlib.rcParams['pgf.texsystem']} (matplotlib's pgf.texsystem), which is not on "
               "PATH" if suffix == "pgf" else f"matplotlib writes no '.{suffix}' files")
        raise ValueError(f"{field} ({str(value)!r}): {why}; supported: {known} (no suffix: PNG)")
    return path, suffix
