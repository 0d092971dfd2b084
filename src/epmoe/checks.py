"""Argument checks shared by every module: one implementation of "an integer of at least ``minimum``"."""

from __future__ import annotations

import numbers


def is_int(value: object) -> bool:
    """True for an integer (Python or numpy), False for ``bool`` and everything else."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value: object, minimum: int, *, wording: str = "") -> int:
    """Return ``value`` as an ``int`` if it is an integer ``>= minimum``.

    Args:
        name: the field named in the message.
        value: what was given.
        minimum: the smallest accepted value.
        wording: what is expected, said in the message (default ``"an integer >= {minimum}"``).

    Raises:
        ValueError: ``"{name} must be {wording}, got {value!r}"`` for a bool, a non-integer or a smaller value.
    """
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be {wording or f'an integer >= {minimum}'}, got {value!r}")
    return int(value)


def check_positive_int(name: str, value: object) -> int:
    """``check_int(name, value, 1)`` with the message ``"{name} must be a positive integer, got {value!r}"``."""
    return check_int(name, value, 1, wording="a positive integer")
