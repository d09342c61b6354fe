"""What a checkpoint is made of, as plain data: the record of each file
(:class:`FileInfo`), the shards saved (:class:`SavedShard`, named by
:func:`shard_file`) and how each framework names its checkpoint
directories and tracker file (:class:`Naming`: :data:`TORCH`,
:data:`MEGATRON`, :data:`MINDSPORE`).

Nothing here touches storage: :mod:`.checkpoint` writes, finalises and
verifies checkpoints with these; the adapters and the recovery protocol
pass them around.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

__all__ = ["MEGATRON", "MINDSPORE", "TORCH", "FileInfo", "Naming", "SavedShard", "shard_file"]


@dataclass(frozen=True)
class FileInfo:
    """One file of a checkpoint: its size and checksum (SHA-256, or, for a
    file copied from a sealed in-memory snapshot, the snapshot's XXH3-64)."""

    name: str
    bytes: int
    sha256: str
    xxh3: int | None = None

    def record(self) -> dict:
        return {"bytes": self.bytes, **({"sha256": self.sha256} if self.sha256 else {"xxh3": self.xxh3})}


@dataclass(frozen=True, kw_only=True)
class SavedShard:
    """One shard of a checkpoint: which state kind, which ranks hold copies
    of it (every rank of the replica group when ``full``), who saved it."""

    kind: int
    copies: tuple[int, ...]
    full: bool
    rank: int
    files: tuple[FileInfo, ...]

    def describe(self) -> dict:
        return {"kind": self.kind, "copies": list(self.copies), "full": self.full, "saved_by": self.rank,
                "files": [f.name for f in self.files]}


def shard_file(kind: int, copies: Sequence[int], suffix: str) -> str:
    """The file name of a shard, derivable by every rank holding a copy."""
    return f"shard_k{kind}_r{min(copies)}{suffix}"


@dataclass(frozen=True)
class Naming:
    """How a framework names checkpoint directories and its tracker file."""

    pattern: str  # str.format pattern with one integer field
    tracker: str
    regex: str

    def dirname(self, step: int) -> str:
        return self.pattern.format(step)

    def step_of(self, name: str) -> int | None:
        m = re.fullmatch(self.regex, name)
        return int(m.group(1)) if m else None


TORCH = Naming("step_{:08d}", "latest_step.txt", r"step_(\d{8,})")
MEGATRON = Naming("iter_{:07d}", "latest_checkpointed_iteration.txt", r"iter_(\d{7,})")
#: MindSpore 2.10 TFT's dying-gasp directories (``ttp_saved_checkpoints-step_{n}``;
#: the ``tft_saved_...`` of older releases, and of trainguard before, are still read).
#: MindSpore itself keeps no tracker, trainguard writes one beside them.
MINDSPORE = Naming("ttp_saved_checkpoints-step_{}", "latest_tft_step.txt", r"(?:ttp|tft)_saved_checkpoints-step_(\d+)")
