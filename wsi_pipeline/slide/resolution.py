"""Pixel size from TIFF resolution tags."""

from __future__ import annotations

import math

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
