"""Output paths checked before any work: a command that will write a file says at once when it cannot."""

from __future__ import annotations

import os
from pathlib import Path


def check_output_path(field: str, value: str | Path, expected: str) -> Path:
    """The path a command will write, checked up front: not a directory, in an existing writable directory.

    Args:
        field: the option or argument name for messages (e.g. ``--plot`` or ``out``).
        value: the path given.
        expected: what the path should name, for the message (e.g. ``a PNG file path``).

    Returns:
        ``value`` as a ``Path``.

    Raises:
        ValueError: the path is a directory, or its directory does not exist or is not writable.
    """
    path = Path(value)
    if path.is_dir():
        raise ValueError(f"{field} ({str(value)!r}) is a directory; expected {expected}")
    parent = path.parent
    if not parent.is_dir():
        raise ValueError(f"{field} ({str(value)!r}) cannot be written: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{field} ({str(value)!r}) cannot be written: directory {str(parent)!r} is not writable")
    return path
