"""The Guard's checkpoints: periodic saves, the newest one loaded at start,
and the job's history (recoveries, PIDs per rank) carried inside them.

A mix-in of :class:`~.guard.Guard` (it uses the Guard's state, store,
groups and process group). The dying-gasp save goes through the same
:meth:`Checkpoints.write_shard` and :meth:`Checkpoints.finalize_checkpoint`,
called by the recovery handlers.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from trainguard.core import CheckpointError
from trainguard.core.checkpoint import FileInfo, SavedShard
from trainguard.core.history import JobHistory

from .handlers import read_shard, shard_name

__all__ = ["Checkpoints"]

log = logging.getLogger("trainguard.torch")


class Checkpoints(JobHistory):
    """Saving and loading checkpoints for a :class:`~.guard.Guard` (a mix-in)."""

    def write_shard(self, step: int):
        """Write this rank's committed dense state at ``step`` (temporary name)."""
        state = self.state.committed_state_dict()
        state["step"] = step
        return self.store.write(step, shard_name(self.groups[0].copies(self.rank)),
                                lambda f: torch.save(state, f))

    def finalize_checkpoint(self, step: int, shards: Sequence[SavedShard], history: dict) -> None:
        self.store.finalize(
            step, [f for s in shards for f in s.files],
            layout={"world_size": self.world_size, "shards": [s.describe() for s in shards]},
            meta={"history": history, "finalised_by": self.rank})

    def save(self) -> None:
        """Save a checkpoint at the current step (every rank calls this).

        The lowest rank holding each shard writes it; rank 0 finalises.
        """
        if self.store is None:
            raise CheckpointError("no checkpoint_dir was given to the Guard")
        with self.section("checkpoint"):
            self.injector.strike("save", self._step)
            self._save()

    def _save(self) -> None:
        step, group = self._step, self.groups[0]
        members = self.process_group.members  # fewer than the world while elastic training dropped ranks
        copies = group.copies(self.rank)
        mine = None
        if self.rank == min(c for c in copies if c in members):
            info = self.write_shard(step)
            mine = {"copies": copies, "full": group.replica_cnt == len(group.rank_list),
                    "file": [info.name, info.bytes, info.sha256]}
        shards = [s for s in self.process_group.all_gather_json(mine, self.device.torch_device) if s]
        if self.rank == members[0]:
            saved = [SavedShard(kind=0, copies=tuple(s["copies"]), full=s["full"], rank=min(s["copies"]),
                                files=(FileInfo(*s["file"]),)) for s in shards]
            self.finalize_checkpoint(step, saved, self.merged_history({}))

    def _load(self) -> int:
        """Load the newest complete checkpoint, if any; return its step."""
        found = self.store.latest() if self.store is not None else None
        step = found.step if found is not None else 0
        steps = self.process_group.all_gather_json(step, self.device.torch_device)
        if len(set(steps)) != 1:
            raise CheckpointError(f"ranks disagree on the newest complete checkpoint: {steps}")
        if found is None:
            return 0
        shards = found.manifest.get("layout", {}).get("shards", [])
        mine = next((s for s in shards if s["kind"] == 0 and (s["full"] or self.rank in s["copies"])), None)
        if mine is None:
            raise CheckpointError(f"{found.path} holds no dense shard for rank {self.rank} "
                                  f"(saved with world size {found.manifest.get('layout', {}).get('world_size')})")
        state = read_shard(found.file(mine["files"][0]), self.device.torch_device)
        self.state.load_state_dict(state)
        self.history = found.manifest.get("meta", {}).get("history", self.history)
        if self.rank == 0:
            log.info("resumed from %s at step %d", found.path, found.step)
        return found.step
