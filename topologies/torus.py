"""``torus`` / ``torus:RxC``: a 2-D grid of R rows and C columns that wraps around in both directions.

Rank r*C + c sits at row r, column c and exchanges with its up/down/left/right neighbours: four peers
instead of the ring's two, and a spectral gap that shrinks like 1/n instead of 1/n^2 for square shapes
(Nedic, Olshevsky & Rabbat, "Network topology and communication-computation tradeoffs in
decentralized optimization", Proc. IEEE 2018).
"""

from __future__ import annotations

import math
import re

import numpy as np

from .base import Topology
from .errors import ConfigError
from .registry import register

_SHAPE = re.compile(r"(\d+)\s*x\s*(\d+)")


def squarest_shape(world_size: int) -> tuple[int, int]:
    """(R, C) with R * C = world_size, R <= C and R as large as possible; a prime gives (1, n), a ring."""
    rows = max(d for d in range(1, math.isqrt(world_size) + 1) if world_size % d == 0)
    return rows, world_size // rows


@register("torus")
class Torus(Topology):
    """Wrap-around grid. A dimension of size 2 gives one peer (up = down); of size 1, none."""

    def __init__(self, world_size: int, rows: int | None = None, cols: int | None = None) -> None:
        super().__init__(world_size)
        if rows is None and cols is None:
            rows, cols = squarest_shape(self.world_size)
        if not (isinstance(rows, int) and isinstance(cols, int) and rows >= 1 and rows * cols == self.world_size):
            raise ConfigError(self._shape_error(rows, cols))
        self.rows, self.cols = rows, cols

    @classmethod
    def from_spec(cls, args: str, world_size: int) -> Torus:
        if not args:
            return cls(world_size)
        shape = _SHAPE.fullmatch(args)
        if shape is None:
            raise ConfigError(f"torus takes a shape RxC such as torus:2x4, got 'torus:{args}'")
        return cls(world_size, int(shape[1]), int(shape[2]))

    @property
    def spec(self) -> str:
        return f"torus:{self.rows}x{self.cols}"

    def _shape_error(self, rows: int | None, cols: int | None) -> str:
        good_rows, good_cols = squarest_shape(self.world_size)
        examples = {f"torus:{good_rows}x{good_cols}", f"torus:{good_cols}x{good_rows}"}
        advice = (f"use a shape R x C with R*C = {self.world_size}, e.g. " + " or ".join(sorted(examples)))
        if not (isinstance(rows, int) and isinstance(cols, int)):
            return f"torus needs integer rows and cols, got rows={rows}, cols={cols}; {advice}"
        return f"torus:{rows}x{cols} has {rows * cols} cells but there are {self.world_size} nodes; {advice}"

    def _adjacency(self, round: int) -> np.ndarray:
        row, col = np.divmod(np.arange(self.world_size), self.cols)
        adjacency = np.zeros((self.world_size, self.world_size), dtype=bool)
        for row_step, col_step in ((-1, 0), (1, 0), (0, -1), (0, 1)):
            peer = ((row + row_step) % self.rows) * self.cols + (col + col_step) % self.cols
            adjacency[np.arange(self.world_size), peer] = True
        # A dimension of size 1 makes a rank its own neighbour; self-weight lives in W, not here.
        np.fill_diagonal(adjacency, False)
        return adjacency
