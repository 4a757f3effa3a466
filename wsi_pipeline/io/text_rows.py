"""Rows of text built as byte arrays: numbers and fields of many rows at once, without Python per row.

A slide's detection files hold 10^5-10^6 rows; formatting each number with
``repr`` or ``%`` costs about a microsecond, seconds per slide in all. Here a
column of rows is an ``N x W`` uint8 array of ASCII, padded with NUL bytes
(which no JSON or CSV text contains); :func:`join_rows` lays the columns and
the constant text between them side by side and drops the padding, giving
the rows' bytes back to back.

>>> v = np.array([3.0, 12.5, 0.129, 1234.567])
>>> join_rows([b"[", decimal_column(v, 2, shortest=True), b"]", b"\\n"]).decode()
'[3.0]\\n[12.5]\\n[0.13]\\n[1234.57]\\n'
>>> join_rows([decimal_column(v, 2, shortest=False), b";"]).decode()
'3.00;12.50;0.13;1234.57;'
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_ZERO = ord("0")


_DIGITS = np.frombuffer(b"0123456789abcdef", np.uint8)


def _digits(values: np.ndarray, width: int, base: int = 10) -> np.ndarray:
    """``N x width`` ASCII digits (lower-case beyond 9) of non-negative int64 ``values`` in ``base``
    (at most 16), leading zeros kept."""
    out = np.empty((len(values), width), np.uint8)
    rest = values.copy()
    for k in range(width - 1, -1, -1):
        out[:, k] = _DIGITS[rest % base]
        rest //= base
    return out


def decimal_column(values: np.ndarray, decimals: int, shortest: bool) -> np.ndarray:
    """``values`` (float) rounded to ``decimals`` places (numpy's rounding) as decimal text, one
    row each: an ``N x W`` uint8 array, NUL-padded.

    ``shortest=False``: every row with ``decimals`` digits after the point; for float32 values
    this is ``"%.{decimals}f"`` exactly. ``shortest=True``: trailing zeros of the fraction
    dropped, keeping one digit: Python's ``repr`` of the rounded float (its shortest round-trip
    form) for magnitudes from 1e-4 up, where ``repr`` uses no exponent; smaller ones are plain
    decimals that parse to the same float. Values of ``10**(15 - decimals)`` or more, and those
    that are not finite, are written by Python (``repr`` or ``%``) instead: beyond that the
    digits of a double are not all exact.
    """
    if decimals < 1:
        raise ValueError(f"decimals: expected at least 1, found {decimals}")
    rounded = np.round(np.asarray(values, np.float64), decimals)
    with np.errstate(invalid="ignore"):
        odd = ~(np.abs(rounded) < 10.0 ** (15 - decimals))  # NaN too
    if odd.any():
        out = decimal_column(np.where(odd, 0.0, rounded), decimals, shortest)
        texts = [
            (repr(x) if shortest else f"{x:.{decimals}f}").encode()
            for x in (rounded if shortest else np.asarray(values, np.float64))[odd].tolist()
        ]
        special = choice_column(np.arange(len(texts)), texts)
        if special.shape[1] > out.shape[1]:
            out = np.concatenate([out, np.zeros((len(out), special.shape[1] - out.shape[1]), np.uint8)], axis=1)
        rows = np.flatnonzero(odd)
        out[rows] = 0
        out[rows[:, None], np.arange(special.shape[1])] = special
        return out
    n = len(rounded)
    scale = 10**decimals
    scaled = np.rint(np.abs(rounded) * scale).astype(np.int64)
    whole, frac = np.divmod(scaled, scale)
    width = len(str(int(whole.max()))) if n else 1
    int_digits = _digits(whole, width)
    # Leading zeros of the whole part become padding; its last digit stays.
    leading = np.cumsum(int_digits != _ZERO, axis=1) == 0
    leading[:, -1] = False
    int_digits[leading] = 0
    frac_digits = _digits(frac, decimals)
    if shortest:
        trailing = np.cumsum((frac_digits != _ZERO)[:, ::-1], axis=1)[:, ::-1] == 0
        trailing[:, 0] = False
        frac_digits[trailing] = 0
    sign = np.where(np.signbit(rounded), ord("-"), 0).astype(np.uint8)[:, None]
    point = np.full((n, 1), ord("."), np.uint8)
    return np.concatenate([sign, int_digits, point, frac_digits], axis=1)


def hex_column(values: np.ndarray, width: int) -> np.ndarray:
    """Non-negative integers as ``width`` lower-case hex digits each (``"%0{width}x"``), ``N x width``."""
    values = np.asarray(values, np.int64)
    if len(values) and (values.min() < 0 or values.max() >= 16**width):
        raise ValueError(f"hex_column: values must lie in [0, 16**{width})")
    return _digits(values, width, 16)


def choice_column(index: np.ndarray, texts: Sequence[bytes]) -> np.ndarray:
    """Row ``i`` is ``texts[index[i]]``: an ``N x W`` uint8 array, NUL-padded."""
    if any(b"\0" in t for t in texts):
        raise ValueError("choice_column: texts may not hold NUL bytes")
    width = max((len(t) for t in texts), default=0)
    table = np.zeros((max(len(texts), 1), width), np.uint8)
    for i, t in enumerate(texts):
        table[i, : len(t)] = np.frombuffer(t, np.uint8)
    return table[np.asarray(index, np.int64)]


def join_rows(columns: Sequence[np.ndarray | bytes]) -> bytes:
    """The rows' text back to back: each row is its cells in order (``N x W`` arrays from this
    module, or constant ``bytes`` repeated on every row), NUL padding dropped."""
    n = next((len(c) for c in columns if isinstance(c, np.ndarray)), None)
    if n is None:
        raise ValueError("join_rows: expected at least one column array")
    widths = []
    for c in columns:
        if isinstance(c, np.ndarray):
            if c.ndim != 2 or len(c) != n:
                raise ValueError(f"join_rows: expected {n} x W columns, found shape {c.shape}")
            widths.append(c.shape[1])
        else:
            if b"\0" in c:
                raise ValueError("join_rows: constant text may not hold NUL bytes")
            widths.append(len(c))
    if n == 0:
        return b""
    # One row's layout with the constant text in place, copied to every row; then the columns.
    starts = np.cumsum([0, *widths]).tolist()
    template = np.zeros(starts[-1], np.uint8)
    for c, a, b in zip(columns, starts[:-1], starts[1:], strict=True):
        if not isinstance(c, np.ndarray) and c:
            template[a:b] = np.frombuffer(c, np.uint8)
    rows = np.empty((n, starts[-1]), np.uint8)
    rows[:] = template
    for c, a, b in zip(columns, starts[:-1], starts[1:], strict=True):
        if isinstance(c, np.ndarray):
            rows[:, a:b] = c
    flat = rows.ravel()
    return flat[flat != 0].tobytes()
