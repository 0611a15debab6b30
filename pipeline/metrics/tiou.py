"""Temporal IoU exactly as the public dense-captioning evaluators compute it.

    tIoU(a, b) = intersection / (min(hull, len_a + len_b) + 1e-8)

`min(hull, len_a + len_b)` is the union for overlapping intervals and the sum of
lengths for disjoint ones (where the intersection is 0 anyway). The 1e-8 keeps
zero-length intervals finite and makes every tIoU a hair below the exact ratio,
so `tIoU >= 0.5` is false for two intervals that overlap by exactly half.

`tiou_matrix` is the vectorised form; it performs the same IEEE float64
operations in the same order as `tiou`, so both give bit-identical values.

    >>> tiou((0.0, 10.0), (5.0, 15.0))
    0.3333333331111111
    >>> tiou((0.0, 2.0), (1.0, 2.0)) >= 0.5     # exactly half is not half
    False
    >>> tiou_matrix(np.array([[0.0, 10.0], [0.0, 2.0]]), np.array([[5.0, 15.0]])).tolist()
    [[0.3333333331111111], [0.0]]

Pure numpy, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TIOU_EPS = 1e-8


def tiou(a: Sequence[float], b: Sequence[float]) -> float:
    """tIoU of two [start, end] intervals (seconds)."""
    a0, a1, b0, b1 = float(a[0]), float(a[1]), float(b[0]), float(b[1])
    inter = max(0.0, min(a1, b1) - max(a0, b0))
    union = min(max(a1, b1) - min(a0, b0), (a1 - a0) + (b1 - b0))
    return inter / (union + TIOU_EPS)


def tiou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """tIoU of every pair: a [M, 2], b [N, 2] (seconds) -> float64 [M, N]."""
    a = np.asarray(a, dtype=np.float64).reshape(-1, 2)
    b = np.asarray(b, dtype=np.float64).reshape(-1, 2)
    a0, a1 = a[:, 0:1], a[:, 1:2]  # [M, 1]
    b0, b1 = b[None, :, 0], b[None, :, 1]  # [1, N]
    inter = np.maximum(0.0, np.minimum(a1, b1) - np.maximum(a0, b0))
    union = np.minimum(np.maximum(a1, b1) - np.minimum(a0, b0), (a1 - a0) + (b1 - b0))
    return inter / (union + TIOU_EPS)
