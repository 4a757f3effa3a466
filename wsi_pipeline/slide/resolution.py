"""Pixel size from TIFF resolution tags."""

from __future__ import annotations


def tiff_page_mpp(page) -> tuple[float, float] | None:
    """(x, y) micrometres per pixel from a tifffile page's resolution tags.

    Only inch and centimetre units carry a physical size; a missing tag or
    the unit "none" gives None. Plausibility is checked by the caller.
    """
    tags = page.tags
    unit, xr, yr = tags.get("ResolutionUnit"), tags.get("XResolution"), tags.get("YResolution")
    if unit is None or xr is None or yr is None:
        return None
    um_per_unit = {2: 25400.0, 3: 10000.0}.get(int(unit.value))
    if um_per_unit is None:
        return None

    def pixels_per_unit(tag) -> float:
        v = tag.value
        n, d = v if isinstance(v, tuple) else (v, 1)
        return n / d if d else 0.0

    rx, ry = pixels_per_unit(xr), pixels_per_unit(yr)
    if rx <= 0 or ry <= 0:
        return None
    return (um_per_unit / rx, um_per_unit / ry)
