"""Files the commands write: output paths checked before any work (a command that will write a file says at
once when it cannot), and the one atomic write (temporary file + rename) every writer uses."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def check_output_path(field: str, value: str | Path, expected: str) -> Path:
    """The path a command will write (``atomic_path``: a new file renamed onto it), checked up front: not a
    directory, not an existing device, pipe or socket (the rename would put a regular file in its place:
    ``/dev/full`` or ``/dev/null`` replaced), a name the file system takes, in an existing writable directory.

    Args:
        field: the option or argument name for messages (e.g. ``--plot`` or ``out``).
        value: the path given.
        expected: what the path should name, for the message (e.g. ``a PNG file path``).

    Returns:
        ``value`` as a ``Path``.

    Raises:
        ValueError: the path is empty or a directory, exists and is not a regular file, has a name longer than its
            file system takes, or its directory does not exist, is not a directory or is not writable.
    """
    if not str(value):  # Path("") is "." (a directory): say what was given
        raise ValueError(f"{field} is empty; expected {expected}")
    path = Path(value)
    try:  # first: asking a file system about a name longer than it takes raises (ENAMETOOLONG)
        most = os.pathconf(path.parent, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):  # no such directory (named below), or no pathconf here
        most = 255
    if len(os.fsencode(path.name)) > most:
        raise ValueError(f"{field} ({str(value)!r}) cannot be written: its name is {len(os.fsencode(path.name))} "
                         f"bytes, longer than the {most} its file system takes")
    if path.is_dir():
        raise ValueError(f"{field} ({str(value)!r}) is a directory; expected {expected}")
    if path.exists() and not path.is_file():
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
    """Write ``path`` atomically: yield a new temporary file beside it (``.epmoe-partial-<random><suffix>``, made
    empty by ``tempfile.mkstemp``, so no file of the user's is overwritten, and short whatever ``path``'s name) to
    write, then rename it onto ``path``.

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
    fd, name = tempfile.mkstemp(prefix=".epmoe-partial-", suffix=path.suffix[:16], dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        tmp.chmod(0o644)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(field: str, path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through ``atomic_path`` (a failed write leaves no half file and an old file as it
    was).

    Args:
        field: the option named in the error (e.g. ``--json``).
        path: the file (checked by ``check_output_path`` before the work that made ``text``).
        text: the content, written as UTF-8.

    Raises:
        ValueError: the write failed (``write_failed``: ``field``, the path and the system's reason).
    """
    try:
        with atomic_path(path) as tmp:
            tmp.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise write_failed(field, path, exc) from exc
