"""The parts of an OME-XML document the project reads: the first image's pixel size, channel
names and map annotations. One parser (ElementTree) for slides and for heatmap files."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

# Micrometres per unit of OME's PhysicalSize*Unit.
_UNIT_UM = {"µm": 1.0, "um": 1.0, "nm": 1e-3, "mm": 1e3, "cm": 1e4, "m": 1e6}


@dataclass
class OmePixels:
    """What an OME-XML document says of its first image.

    ``physical_size``: (x, y) as written, strings, or None; ``unit_um``:
    micrometres per unit (None: a unit this reader does not know);
    ``channel_names``; ``annotations``: the ``<M K="...">`` values of map annotations.
    """

    physical_size: tuple[str, str] | None = None
    unit_um: float | None = 1.0
    channel_names: list[str] = field(default_factory=list)
    annotations: dict[str, str] = field(default_factory=dict)

    def physical_size_um(self) -> tuple[float, float] | None:
        """(x, y) micrometres per pixel; None where missing or in an unknown unit. ValueError if not numbers."""
        if self.physical_size is None or self.unit_um is None:
            return None
        return (float(self.physical_size[0]) * self.unit_um, float(self.physical_size[1]) * self.unit_um)


def read_ome_pixels(xml: str) -> OmePixels:
    """Parse ``xml`` (OME-XML text); ValueError where it is not well-formed XML."""
    try:
        root = ET.fromstring(xml)
    except ET.ParseError as exc:
        raise ValueError(f"not well-formed OME-XML: {exc}") from None
    out = OmePixels()
    pixels = next((el for el in root.iter() if el.tag.endswith("}Pixels") or el.tag == "Pixels"), None)
    if pixels is not None:
        px, py = pixels.get("PhysicalSizeX"), pixels.get("PhysicalSizeY")
        if px and py:
            out.physical_size = (px, py)
            out.unit_um = _UNIT_UM.get(pixels.get("PhysicalSizeXUnit", "µm"))
        out.channel_names = [ch.get("Name", "") for ch in pixels if ch.tag.endswith("}Channel") or ch.tag == "Channel"]
    for el in root.iter():
        if (el.tag.endswith("}M") or el.tag == "M") and el.get("K") is not None:
            out.annotations[el.get("K")] = el.text or ""
    return out


__all__ = ["OmePixels", "read_ome_pixels"]
