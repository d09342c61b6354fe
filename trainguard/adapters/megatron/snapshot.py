"""In-memory snapshots of a Megatron rank, and the saves made from them:
asynchronous periodic saves and dying-gasp files that reuse the snapshot.
:mod:`trainguard.compat.mindio_ttp.megatron_ttp` turns them on.

A snapshot holds what Megatron-LM puts in ``model_optim_rng.pt``
(:func:`~.state.rank_state`: model, optimizer, scheduler, RNG states)
and, with megatron's distributed optimizer, this rank's shard of the
parameter state of each kind (:func:`~.kinds.shard_state`), copied into a slot of
the torch adapter's :class:`~trainguard.adapters.torch.snapshot.Snapshots`
ring: tensors by ``copy_``, containers and JSON scalars in the header (the
Python ``random`` state is a tuple of ints). Any other value -- a
TransformerEngine layer's extra state, a ``torch.Size``, a dict keyed by
tuples -- rides as its ``torch.save`` bytes in a ``uint8`` tensor and is
read back with ``torch.load(weights_only=True)``, as Megatron's ``.pt``
files are; an ``OrderedDict`` comes back a ``dict`` (``load_state_dict``
takes either).

Persisted, a snapshot is one safetensors file per saver in Megatron's
layout: ``iter_0000123/mp_rank_00/model_optim_rng.safetensors``, or with a
distributed optimizer ``distrib_optim_shard_NNN.safetensors``, one per
shard, each holding its saver's rank state too (with experts:
``mp_rank_TT_EEE/distrib_optim_shard_NNN_expert_shard_MMM.safetensors``,
named after the dense and the expert shard it holds; a rank loads its dense
shard from whichever expert-parallel rank's file holds it, :func:`~.snapfile.holding`).
:func:`~.checkpoint.load_found` reads these and the ``.pt`` files alike.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from trainguard.adapters.torch.snapshot import Snapshots, destinations, filled, read_payload_into
from trainguard.core import CheckpointError, CheckpointStore
from trainguard.core.checkpoint import FileInfo
from trainguard.core.rank.resume import resume
from trainguard.core.snapshot import SnapshotDir
from trainguard.core.snapshot.ring import load_verified

from . import checkpoint as ckpt
from .kinds import distributed, mains, shard_of, sharded_kinds
from .snapfile import contents, parts, snapshot_file
from .state import apply, chunks

__all__ = ["MegatronSnapshots"]

log = logging.getLogger("trainguard.megatron")


def _own_file(optimizer: Any) -> str:
    return snapshot_file(ckpt.parallel_rank_or_world().subdir, {k: shard_of(k)[0] for k in sharded_kinds(optimizer)})


# ------------------------------------------------------------------ values
def _places(model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    """The tensors a restarted rank already holds for a snapshot of
    :func:`~.snapfile.contents`, by path: its model chunks' and optimizers' (with a
    distributed optimizer, the main parameters of each shard too), to be
    filled in place (:func:`~trainguard.adapters.torch.snapshot.read_payload_into`)."""
    parts = chunks(model)
    rank: dict = {"model": parts[0].state_dict()} if len(parts) == 1 else \
        {f"model{i}": m.state_dict() for i, m in enumerate(parts)}
    if optimizer is not None and _has_state(optimizer):  # a restarted rank's has none: its state is copied out
        rank["optimizer"] = optimizer.state_dict()
    shards = [{"optimizers": [{"main": mains(o), "inner": o.optimizer.state_dict()} for o in distributed(optimizer, k)]}
              for k in sharded_kinds(optimizer)]
    return destinations({"state": {"rank": rank, "shards": shards}})


def _has_state(optimizer: Any) -> bool:
    """Whether every torch optimizer inside ``optimizer`` holds state (a
    megatron distributed optimizer without any cannot even give its
    ``state_dict``: it asserts one step count)."""
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return all(len(getattr(o, "optimizer", o).state) for o in inner)


# ------------------------------------------------------------------ ring
class MegatronSnapshots(Snapshots):
    """One Megatron rank's snapshots, persisted in Megatron's layout.

    Args:
        directory: the job's snapshot directory on this node.
        rank: the global rank.
        count: slots kept in memory.
        save_timeout_s: how long a save waits for a slot a persist still
            holds, and the finaliser for every shard's file.
    """

    def __init__(self, directory: SnapshotDir, rank: int, *, count: int = 2, save_timeout_s: float = 1800.0) -> None:
        super().__init__(directory, rank, count=count, naming="megatron")  # persisted as iter_0000123/
        self.save_timeout_s = save_timeout_s
        self.resumed_from: dict | None = None
        self.closed = False
        self.written: dict[tuple[str, int], FileInfo] = {}  # (root, step) -> the dying-gasp file written

    def take_rank(self, step: int, model: Any, optimizer: Any, scheduler: Any, history: dict, *,
                  wait: bool = False, rng: dict | None = None) -> int | None:
        """Copy the rank's state at ``step`` into a free slot; the slot index,
        or ``None`` when every slot is being persisted (with ``wait``, after
        waiting for one up to the save timeout)."""
        index = self.take(contents(step, model, optimizer, scheduler, history, rng), step)
        if index is None and wait:
            log.warning("rank %d: every snapshot slot is being persisted; waiting for one", self.rank)
            self.wait(self.save_timeout_s)
            index = self.take(contents(step, model, optimizer, scheduler, history, rng), step)
        return index

    def _take_now(self, step: int, objects: tuple, history: dict, rng: dict | None = None) -> int:
        index = self.take_rank(step, *objects, history, wait=True, rng=rng)
        if index is None:
            raise CheckpointError(f"rank {self.rank}: no snapshot slot came free for step {step}")
        return index

    def write_rank(self, store: CheckpointStore, step: int, model: Any, optimizer: Any, scheduler: Any, *,
                   kind: int, history: dict, rng: dict | None = None) -> list[FileInfo]:
        """The dying-gasp file of this rank (as :func:`~.checkpoint.write_rank`
        decides who writes what): the payload of the snapshot of ``step``,
        reused when memory holds it. A rank saving shards of both kinds
        writes it once."""
        if not any(ckpt.writes(ckpt.parallel_rank_or_world(), optimizer, kind)):
            return []  # with experts and a dense optimizer: the expert savers' files hold the dense state too
        key = (str(store.root), step)
        if key in self.written:
            return [self.written[key]]
        index = self.holding(step)
        if index is not None:
            self.reused.append(step)
            log.info("rank %d: the save of step %d reuses its snapshot in memory", self.rank, step)
        else:
            index = self._take_now(step, (model, optimizer, scheduler), history, rng)
        slot = self.slots[index]
        slot.lock(False, block=True)
        try:
            self.written[key] = store.write_buffer(step, _own_file(optimizer), slot.payload())
        finally:
            slot.unlock()
        return [self.written[key]]

    def save(self, store: CheckpointStore, step: int, model: Any, optimizer: Any, scheduler: Any, *,
             history: dict) -> None:
        """A periodic save from memory (every rank calls it): blocks for the
        snapshot of ``step`` (unless memory holds it) and one all-gather of
        the savers' file names; the persist workers write it, the first
        saver's worker finalises once every file is there."""
        index = self.holding(step)
        if index is None:
            index = self._take_now(step, (model, optimizer, scheduler), history)
        here, rank = ckpt.parallel_rank_or_world(), dist.get_rank() if dist.is_initialized() else 0
        sharded = sharded_kinds(optimizer)
        shards = [{"kind": k, "copies": c, "full": k not in sharded, "saved_by": rank, "files": [_own_file(optimizer)]}
                  for k, c in ckpt.saved_copies(here, optimizer) if c[0] == rank]
        everyone = [s for saver in ckpt.all_gather_objects(shards) for s in saver]
        if not shards:
            return
        finalize = None
        if rank == everyone[0]["saved_by"]:
            finalize = {"expected": sorted({f for s in everyone for f in s["files"]}), "timeout_s": self.save_timeout_s,
                        "keep": store.keep,
                        "layout": {"world_size": dist.get_world_size() if dist.is_initialized() else 1,
                                   "shards": everyone},
                        "meta": {"history": history, "finalised_by": rank}}
        self.persist(index, step, root=str(store.root), name=shards[0]["files"][0], finalize=finalize)

    def load(self, store: CheckpointStore, model: Any, optimizer: Any, scheduler: Any, *,
             device: Any = "cpu") -> tuple[int, dict]:
        """Load the newest step every rank can load -- from this node's
        memory where a sealed snapshot of this rank holds it and passes its
        checksum, else the newest complete checkpoint on storage -- into the
        objects (a collective); a snapshot is copied into the objects' own
        tensors once its checksum matched (:func:`_places`). Returns
        ``(iteration, history)``, ``(0, {})`` when there is nothing to load.

        Raises:
            CheckpointError: the ranks share no step, or it does not fit.
        """
        found = None
        loaded: dict = {}

        def newest(dropped: set[int]):
            nonlocal found
            found = store.latest(exclude=dropped)
            return found

        def from_memory(step: int, slot, source: str) -> None:
            into = _places(model, optimizer)  # filled once the checksum passed: no second copy of the model
            _, held = load_verified(slot, lambda payload: read_payload_into(payload, device, into), filled)
            apply(*parts(held["state"]), model, optimizer, scheduler, where=slot.path)
            # A dying-gasp checkpoint of the same step knows of the fault that stopped the job.
            stored = found.manifest.get("meta", {}).get("history") if found is not None and found.step == step \
                else None
            loaded.update(history=stored or held["history"], source=source, where=slot.path)

        def from_storage(stored) -> None:
            ckpt.load_found(stored, model, optimizer, scheduler, device=device)
            loaded.update(history=stored.manifest.get("meta", {}).get("history", {}), source="storage",
                          where=stored.path)

        step = resume(self.available(verify=False), newest, gather=ckpt.all_gather_objects,
                      outcomes=ckpt.all_gather_objects, rank=self.rank, load_memory=from_memory,
                      load_stored=from_storage)
        if not step:
            return 0, {}
        self.resumed_from = {"step": step, "source": loaded["source"]}
        log.info("rank %d resumed from %s at step %d (%s)", self.rank, loaded["source"], step, loaded["where"])
        return step, loaded["history"]

    def shutdown(self, wait_s: float) -> None:
        if not self.closed:
            self.closed = True
            super().shutdown(wait_s)
