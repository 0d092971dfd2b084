"""Files the commands write: output paths checked before any work (a command that will write a file says at
once when it cannot), and the one atomic write (temporary file + rename) every writer uses."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def check_output_path(field: str, value: str | Path, expected: str, *, replaces: bool = True) -> Path:
    """The path a command will write, checked up front: not a directory, in an existing writable directory, and,
    where the writer replaces the file (``atomic_path``'s rename), not an existing device, pipe or socket (a rename
    would put a regular file in its place: ``/dev/full`` or ``/dev/null`` replaced).

    Args:
        field: the option or argument name for messages (e.g. ``--plot`` or ``out``).
        value: the path given.
        expected: what the path should name, for the message (e.g. ``a PNG file path``).
        replaces: the writer renames a new file onto the path (``atomic_path``); ``False`` for one that opens and
            writes the path itself (``/dev/stdout`` then works).

    Returns:
        ``value`` as a ``Path``.

    Raises:
        ValueError: the path is empty or a directory, or (``replaces``) exists and is not a regular file, or its
            directory does not exist, is not a directory or is not writable.
    """
    if not str(value):  # Path("") is "." (a directory): say what was given
        raise ValueError(f"{field} is empty; expected {expected}")
    path = Path(value)
    if path.is_dir():
        raise ValueError(f"{field} ({str(value)!r}) is a directory; expected {expected}")
    if replaces and path.exists() and not path.is_file():
        raise ValueError(f"{field} ({str(value)!r}) is not a regular file (a device, pipe or socket), which writing "
                         f"it would replace; expected {expected}")
    parent = path.parent
    if parent.exists() and not parent.is_dir():
        raise ValueError(f"{field} ({str(value)!r}) cannot be written: {str(parent)!r} is not a directory")
    if not parent.is_dir():
        raise ValueError(f"{field} ({str(value)!r}) cannot be written: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{field} ({str(value)!r}) cannot be written: directory {str(parent)!r} is not writable")
    return path


def write_failed(field: str, path: str | Path, exc: OSError) -> ValueError:
    """The error for a write the file system refused after ``check_output_path`` passed (a full or read-only one).

    Raise it ``from exc``: ``raise write_failed("--plot", path, exc) from exc``.

    Args:
        field: the option or argument name for the message (e.g. ``--plot`` or ``out``).
        path: the path the user gave (not a temporary name beside it).
        exc: the ``OSError`` of the write.

    Returns:
        A ``ValueError`` naming ``field``, the path and the system's reason (``strerror``, else the error itself).
    """
    return ValueError(f"{field} ({str(path)!r}) cannot be written: {exc.strerror or exc}")


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Write ``path`` atomically: yield a new temporary file beside it (``.<name>.<random>.epmoe-partial<suffix>``,
    made empty by ``tempfile.mkstemp``, so no file of the user's is overwritten) to write, then rename it onto
    ``path``.

    The file is made readable by all (``0o644``; the safetensors writer creates owner-only files). If the
    body raises, the temporary file is removed and ``path`` is untouched, so a failed write leaves no half file.

    Args:
        path: the file to write.

    Yields:
        The temporary path beside ``path``.

    Raises:
        OSError: the temporary file cannot be made in ``path``'s directory, or the write or rename fails.
    """
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".epmoe-partial{path.suffix}", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        tmp.chmod(0o644)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
