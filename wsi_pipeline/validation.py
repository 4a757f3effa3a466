"""Type checks of values read from JSON and TOML (model cards, config files).

Python's ``bool`` is an ``int``: a card's ``true`` must not pass where a
number is meant. The readers of cards, decoder parameters and configs check
types through these, so the rule is written once.
"""

from __future__ import annotations

from typing import Any


def is_instance(value: Any, kinds: type | tuple[type, ...]) -> bool:
    """``isinstance(value, kinds)``, except that a bool is not a number unless ``bool`` is among ``kinds``.

    >>> is_instance(True, int), is_instance(True, (int, bool)), is_instance(3, (int, float))
    (False, True, True)
    """
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if isinstance(value, bool) and bool not in kinds:
        return False
    return isinstance(value, kinds)


def is_int(value: Any) -> bool:
    """An int, not a bool."""
    return is_instance(value, int)


def is_number(value: Any) -> bool:
    """An int or a float, not a bool."""
    return is_instance(value, (int, float))


__all__ = ["is_instance", "is_int", "is_number"]
