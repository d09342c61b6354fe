"""Training data for the example, without torchvision.

* :class:`SyntheticImages`: the batch of step ``s`` on rank ``r`` is a pure
  function of ``(seed, s, r)``, so a rolled-back or resumed step sees exactly
  the batch it saw the first time, and no data position needs saving.
* :class:`ImageFolder` + :class:`ResumableLoader`: images under
  ``root/<class>/...`` split across ranks by a seeded ``DistributedSampler``;
  the loader's position (epoch, batch) is its ``state_dict``, which the
  Guard snapshots at every step, checkpoints and restores, so the batch of a
  step is the same after a rollback or a relaunch.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

__all__ = ["IMAGE_EXTENSIONS", "ImageFolder", "ResumableLoader", "SyntheticImages", "mix_seed"]

#: Loaded with Pillow (needs ``pip install pillow``); ``.npy`` needs only numpy.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def mix_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (stable across processes and runs,
    unlike ``hash()``)."""
    digest = hashlib.sha256("/".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class SyntheticImages:
    """Random images with a learnable signal: each class has a smooth colour
    pattern, and an image is its class's pattern plus noise.

    Args:
        seed: picks the class patterns and, with step and rank, every batch.
        num_classes, batch_size, image_size: shapes.
    """

    def __init__(self, seed: int, num_classes: int, batch_size: int, image_size: int) -> None:
        self.seed, self.num_classes = seed, num_classes
        self.batch_size, self.image_size = batch_size, image_size
        g = torch.Generator().manual_seed(mix_seed(seed, -1))
        coarse = torch.randn(num_classes, 3, 4, 4, generator=g)
        self.patterns = F.interpolate(coarse, size=(image_size, image_size), mode="bilinear", align_corners=False)

    def batch(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of ``step`` on ``rank``: images ``(B, 3, S, S)``, labels ``(B,)``."""
        g = torch.Generator().manual_seed(mix_seed(self.seed, step, rank))
        y = torch.randint(0, self.num_classes, (self.batch_size,), generator=g)
        noise = torch.randn(self.batch_size, 3, self.image_size, self.image_size, generator=g)
        return self.patterns[y] + noise, y


class ImageFolder:
    """``root/<class>/**/<image>``: classes are the sorted subdirectory names.

    Images are ``.npy`` arrays (``HxWx3``/``HxW`` uint8 in 0..255, or
    ``3xHxW``/``HxWx3`` float in 0..1) or, with Pillow installed, the usual
    image formats. Each is resized to ``image_size x image_size`` (bilinear)
    and normalised with ``mean``/``std``.

    Raises:
        FileNotFoundError: ``root`` is missing, holds no class folders, or
            a class folder holds no images.
        ImportError: there are image files but Pillow is not installed.
    """

    def __init__(self, root: str | Path, image_size: int, mean: Sequence[float] = (0.0, 0.0, 0.0),
                 std: Sequence[float] = (1.0, 1.0, 1.0)) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"data.path {str(self.root)!r} is not a directory")
        self.classes = sorted(d.name for d in self.root.iterdir() if d.is_dir() and not d.name.startswith("."))
        if not self.classes:
            raise FileNotFoundError(f"{self.root} holds no class folders (expected {self.root}/<class>/<image>)")
        known = IMAGE_EXTENSIONS + (".npy",)
        self.samples = [(p, label) for label, name in enumerate(self.classes)
                        for p in sorted((self.root / name).rglob("*"))
                        if p.is_file() and p.suffix.lower() in known]
        empty = sorted(set(self.classes) - {self.classes[label] for _, label in self.samples})
        if empty:
            raise FileNotFoundError(f"no images ({', '.join(known)}) in class folder(s) {', '.join(empty)} "
                                    f"under {self.root}")
        if importlib.util.find_spec("PIL") is None:
            pictures = [p for p, _ in self.samples if p.suffix.lower() != ".npy"]
            if pictures:
                raise ImportError(f"{len(pictures)} image files under {self.root} (e.g. {pictures[0]}) need Pillow "
                                  f"to load: pip install pillow (or convert them to .npy arrays)")
        self.image_size = image_size
        self.mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        x = _load(path)
        if x.shape[-2:] != (self.image_size, self.image_size):
            x = F.interpolate(x[None], size=(self.image_size, self.image_size), mode="bilinear",
                              align_corners=False, antialias=True)[0]
        return (x - self.mean) / self.std, label


def _load(path: Path) -> torch.Tensor:
    """An image as a float ``3xHxW`` tensor in [0, 1]."""
    if path.suffix.lower() == ".npy":
        import numpy as np

        array = np.load(path)
        x = torch.from_numpy(np.ascontiguousarray(array))
    else:
        from PIL import Image

        with Image.open(path) as img:
            img = img.convert("RGB")
            x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(img.height, img.width, 3)
    if x.dim() == 2:
        x = x[:, :, None]
    if x.dim() != 3:
        raise ValueError(f"{path}: expected an HxW, HxWxC or CxHxW image, got shape {tuple(x.shape)}")
    if x.shape[0] in (1, 3) and x.shape[-1] not in (1, 3):
        x = x.permute(1, 2, 0)  # CxHxW -> HxWxC
    if x.shape[-1] not in (1, 3):
        raise ValueError(f"{path}: expected 1 or 3 channels, got shape {tuple(x.shape)}")
    x = x.permute(2, 0, 1)
    x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
    return x.expand(3, -1, -1).contiguous() if x.shape[0] == 1 else x


class ResumableLoader:
    """Batches of ``dataset`` for one rank, in a seeded ``DistributedSampler``
    order that changes every epoch; incomplete batches are dropped.

    The position (``{"epoch", "batch"}``: the next batch to load) is the
    ``state_dict``: give the loader to the Guard as ``data=`` and a rolled-back
    or resumed step loads the batch it loaded before.
    """

    def __init__(self, dataset: ImageFolder, batch_size: int, rank: int, world_size: int, seed: int) -> None:
        self.dataset, self.batch_size = dataset, batch_size
        self.sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                          drop_last=True)
        self.batches_per_epoch = len(self.sampler) // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(f"{len(dataset)} images are too few for {world_size} ranks x batch_size {batch_size}")
        self.epoch, self.batch = 0, 0
        self._order: tuple[int, list[int]] | None = None

    def _indices(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            self.sampler.set_epoch(epoch)
            self._order = (epoch, list(iter(self.sampler)))
        return self._order[1]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Load the batch at the current position and advance past it."""
        if self.batch >= self.batches_per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0
        start = self.batch * self.batch_size
        items = [self.dataset[i] for i in self._indices(self.epoch)[start:start + self.batch_size]]
        self.batch += 1
        return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items], dtype=torch.long)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
