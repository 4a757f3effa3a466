"""Stored tiles that decode with a decoder warning: pixels came back, but may be wrong.

A JPEG tile with a few damaged bytes usually still decodes (libjpeg-turbo
reports "Corrupt JPEG data" and goes on), giving wrong pixels. The reader
reports each such tile here once; ``policy`` says what follows: ``"warn"``
(the default) logs it and the run's summary lists it, ``"fail"`` raises
:class:`TileReadError` so the slide fails. A tile that does not decode at all
always raises :class:`TileReadError`.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ConfigError, TileReadError

# What a stored tile that decodes with a decoder warning (corrupt data) does to its slide.
DAMAGED_TILE_CHOICES = ("warn", "fail")

# Damaged tiles logged one by one per slide, and listed in a summary; past these, only counted.
LOGGED_TILES = 20
LISTED_TILES = 1000

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DamagedTile:
    """One stored tile decoded with a warning: its level, column and row, and level-0 origin."""

    level: int
    col: int
    row: int
    x0_level0: int
    y0_level0: int
    message: str


class DamageLog:
    """The damaged stored tiles of one slide, each recorded once (thread-safe)."""

    def __init__(self, path: str, policy: str = "warn"):
        self.path = path
        self.policy = policy
        self._lock = threading.Lock()
        self._tiles: dict[tuple[int, int, int], DamagedTile] = {}

    @property
    def policy(self) -> str:
        return self._policy

    @policy.setter
    def policy(self, value: str) -> None:
        if value not in DAMAGED_TILE_CHOICES:
            raise ConfigError(f"on_damaged_tile: expected one of {', '.join(DAMAGED_TILE_CHOICES)}, found {value!r}")
        self._policy = value

    def report(self, level: int, col: int, row: int, location_level0: tuple[int, int], message: str) -> None:
        """Record stored tile (col, row) of ``level`` as damaged; raises under the "fail" policy."""
        what = f"stored tile ({col}, {row}) of level {level} is damaged ({message}); its pixels may be wrong"
        if self._policy == "fail":
            raise TileReadError(self.path, what, location_level0, level)
        key = (level, col, row)
        with self._lock:
            if key in self._tiles:
                return
            self._tiles[key] = DamagedTile(level, col, row, int(location_level0[0]), int(location_level0[1]), message)
            n = len(self._tiles)
        if n <= LOGGED_TILES:
            log.warning("%s: %s, at level-0 (%d, %d)", self.path, what, *location_level0)
        if n == LOGGED_TILES:
            log.warning("%s: further damaged tiles are only counted in the summary", self.path)

    def tiles(self) -> list[DamagedTile]:
        with self._lock:
            return sorted(self._tiles.values(), key=lambda t: (t.level, t.row, t.col))

    def summary(self) -> dict[str, Any]:
        """The ``damaged_tiles`` entry of a run's summary."""
        tiles = self.tiles()
        return {"count": len(tiles), "policy": self._policy, "tiles": [asdict(t) for t in tiles[:LISTED_TILES]]}
