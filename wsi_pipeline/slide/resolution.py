"""Pixel size from TIFF resolution tags and from an Aperio ImageDescription."""

from __future__ import annotations

import math
import re
import sys
from fractions import Fraction

from .. import slide_warnings


def _pixels_per_unit(value) -> float:
    """A RATIONAL (numerator, denominator) or plain number as a float; 0 where undefined."""
    n, d = value if isinstance(value, tuple) and len(value) == 2 else (value, 1)
    n, d = float(n), float(d)
    return n / d if d else 0.0


def tiff_page_mpp(page) -> tuple[float, float] | None:
    """(x, y) micrometres per pixel from a tifffile page's resolution tags.

    Only inch and centimetre units carry a physical size; a missing
    ResolutionUnit means inches (TIFF's default, as OpenSlide reads it); a
    missing resolution or the unit "none" gives None, and so does a
    malformed one (with a warning naming the file). Plausibility is checked
    by the caller.
    """
    tags = page.tags
    unit, xr, yr = tags.get("ResolutionUnit"), tags.get("XResolution"), tags.get("YResolution")
    if xr is None or yr is None:
        return None
    try:
        um_per_unit = {2: 25400.0, 3: 10000.0}.get(2 if unit is None else int(unit.value))
        if um_per_unit is None:
            return None
        rx, ry = _pixels_per_unit(xr.value), _pixels_per_unit(yr.value)
    except (TypeError, ValueError, OverflowError):
        slide_warnings.warn(
            f"{page.parent.filehandle.path}: malformed resolution tags ({getattr(unit, 'value', None)!r}, "
            f"{xr.value!r}, {yr.value!r}); treating mpp as unknown",
            stacklevel=2,
        )
        return None
    if not (rx > 0 and ry > 0 and math.isfinite(rx) and math.isfinite(ry)):
        return None
    return (um_per_unit / rx, um_per_unit / ry)


# GLib's g_strstrip removes these (not \v), as OpenSlide strips an Aperio field's name and value.
_GLIB_STRIPPED = " \t\n\f\r"
# What g_ascii_strtod reads whole (after OpenSlide turns commas into points): a decimal or a
# hexadecimal float, or infinity. Python's float() would also take "1_0" and fromhex "1p-2".
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)
_HEX = re.compile(r"[+-]?0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][+-]?[0-9]+)?", re.ASCII)
_INFINITY = re.compile(r"[+-]?inf(?:inity)?", re.ASCII | re.IGNORECASE)


def openslide_double(text: str) -> float | None:
    """``text`` read as a number as OpenSlide reads a property (``_openslide_parse_double``):
    commas become decimal points, then ``g_ascii_strtod`` must read the whole text; NaN, an
    overflow or an underflow (``ERANGE``) is no number. ``"0,25"`` and ``"0x1p-2"`` are 0.25;
    ``"True"``, ``""`` and ``"1_0"`` are None."""
    canonical = text.replace(",", ".").lstrip(" \t\n\v\f\r")  # strtod skips C-locale white space
    hexadecimal = _HEX.fullmatch(canonical) is not None
    try:
        if _DECIMAL.fullmatch(canonical):
            value = float(canonical)
        elif hexadecimal:
            value = float.fromhex(canonical)
        elif _INFINITY.fullmatch(canonical):
            return float(canonical)
        else:
            return None
    except OverflowError:  # a hexadecimal exponent past the range
        return None
    # strtod's ERANGE: past the largest double, or below the smallest normal one and rounded. The
    # exact value is made only for a subnormal result, whose text's exponent is then bounded.
    if math.isinf(value):
        return None
    if value == 0:
        mantissa = re.split("[pP]" if hexadecimal else "[eE]", canonical.lstrip("+-"))[0]
        return value if not mantissa.removeprefix("0x").removeprefix("0X").strip("0.") else None
    if abs(value) < sys.float_info.min:
        exact = _hex_fraction(canonical) if hexadecimal else Fraction(canonical)
        return value if Fraction(value) == exact else None
    return value


def _hex_fraction(text: str) -> Fraction:
    """The exact value of a hexadecimal float's text (as :data:`_HEX` matches it)."""
    sign = -1 if text.startswith("-") else 1
    digits, _, exponent = text.lstrip("+-")[2:].replace("P", "p").partition("p")
    whole, _, fraction = digits.partition(".")
    mantissa = int(whole + fraction or "0", 16)
    return sign * Fraction(mantissa) * Fraction(2) ** (int(exponent or "0") - 4 * len(fraction))


def aperio_field(description: str, name: str) -> str | None:
    """The text of field ``name`` of an Aperio ImageDescription as OpenSlide reads it: the fields
    after the first ``|``, each ``name = value`` split at its first ``=``, both stripped; the last
    of a repeated name; None where there is none."""
    value = None
    for field in description.split("|")[1:]:
        key, sep, text = field.partition("=")
        if sep and key.strip(_GLIB_STRIPPED) == name:
            value = text.strip(_GLIB_STRIPPED)
    return value


def aperio_mpp(path: str, description: str) -> float | None:
    """The ``MPP`` of an Aperio ImageDescription as OpenSlide reads it (:func:`openslide_double`);
    None where it has none, or with a warning naming the file where it is not a number."""
    text = aperio_field(description, "MPP")
    if text is None:
        return None
    value = openslide_double(text)
    if value is None:
        slide_warnings.warn(f"{path}: Aperio MPP {text!r} is not a number; treating mpp as unknown", stacklevel=3)
    return value
