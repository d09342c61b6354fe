"""Synthetic training data for the MindSpore example, in numpy only.

The counterpart of ``data.py``'s :class:`SyntheticImages`: each class has a
smooth colour pattern (random 4x4 values upsampled bilinearly) and an image
is its class's pattern plus unit Gaussian noise. The batch of step ``s`` on
rank ``r`` is a pure function of ``(seed, s, r)`` and the shapes, so a
rolled-back or resumed step sees the batch it saw the first time. The values
differ from the torch example's (different RNGs); the recipe is the same.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np

__all__ = ["SyntheticImages", "mix_seed", "synthetic_batch"]


def mix_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (stable across processes and runs,
    unlike ``hash()``); the same function as ``data.mix_seed``, which cannot be
    imported here because ``data.py`` imports torch."""
    digest = hashlib.sha256("/".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _bilinear_matrix(size_in: int, size_out: int) -> np.ndarray:
    """``(size_out, size_in)`` weights of 1-D bilinear resizing with half-pixel
    centres (torch's ``align_corners=False``)."""
    src = np.maximum((np.arange(size_out) + 0.5) * (size_in / size_out) - 0.5, 0.0)
    lo = np.minimum(np.floor(src).astype(np.int64), size_in - 1)
    hi = np.minimum(lo + 1, size_in - 1)
    frac = src - lo
    m = np.zeros((size_out, size_in))
    np.add.at(m, (np.arange(size_out), lo), 1.0 - frac)
    np.add.at(m, (np.arange(size_out), hi), frac)
    return m


@functools.lru_cache(maxsize=8)
def _class_patterns(seed: int, num_classes: int, image_size: int) -> np.ndarray:
    coarse = np.random.default_rng(mix_seed(seed, -1)).standard_normal((num_classes, 3, 4, 4))
    m = _bilinear_matrix(4, image_size)
    patterns = (m @ coarse @ m.T).astype(np.float32)  # (C, 3, S, S)
    patterns.setflags(write=False)  # cached and shared between calls
    return patterns


def synthetic_batch(seed: int, step: int, rank: int, batch_size: int, image_size: int,
                    num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch of ``step`` on ``rank``.

    Returns:
        Images ``(batch_size, 3, image_size, image_size)`` float32 and labels
        ``(batch_size,)`` int32 in ``[0, num_classes)``; fresh arrays each call.
    """
    g = np.random.default_rng(mix_seed(seed, step, rank))
    y = g.integers(0, num_classes, batch_size).astype(np.int32)
    noise = g.standard_normal((batch_size, 3, image_size, image_size), dtype=np.float32)
    return _class_patterns(seed, num_classes, image_size)[y] + noise, y


class SyntheticImages:
    """:func:`synthetic_batch` with the shapes fixed: the same interface as
    ``data.SyntheticImages``, returning numpy arrays.

    Args:
        seed: picks the class patterns and, with step and rank, every batch.
        num_classes, batch_size, image_size: shapes.
    """

    def __init__(self, seed: int, num_classes: int, batch_size: int, image_size: int) -> None:
        self.seed, self.num_classes = seed, num_classes
        self.batch_size, self.image_size = batch_size, image_size

    def batch(self, step: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """The batch of ``step`` on ``rank``: images ``(B, 3, S, S)`` float32, labels ``(B,)`` int32."""
        return synthetic_batch(self.seed, step, rank, self.batch_size, self.image_size, self.num_classes)
