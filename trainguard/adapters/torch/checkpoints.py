"""The Guard's checkpoints: periodic saves, in-memory snapshots, the newest
state loaded at start, and the job's history (recoveries, PIDs per rank)
carried inside them.

A mix-in of :class:`~.guard.Guard` (it uses the Guard's state, store,
groups and process group). The dying-gasp save goes through the same
:meth:`Checkpoints.write_shard` and :meth:`Checkpoints.finalize_checkpoint`,
called by the recovery handlers.

With ``snapshot_every`` set, the state is copied into shared memory every
that many steps (:mod:`.snapshot`; beside the next step, settled before its
update) and periodic saves become asynchronous: the persist worker writes
the snapshot of a save step while training goes on. At start, every rank
lists the steps it can load (its verified snapshots in this node's memory,
the newest complete checkpoint on storage); all resume at the newest step
every rank has, from memory where they can (:mod:`trainguard.core.rank.resume`:
a rank that cannot load stops every rank). Each rank's own part -- random
streams and data position, which replicas do not share -- travels with its
snapshot and, in every checkpoint, as ``own_r<rank>.bin``; it is also
recorded in the node agent's memory at every update, so a dying gasp
carries a lost rank's and a restarted process takes its own back
(:mod:`.own`, :mod:`trainguard.core.snapshot.own`). With ``snapshot_shared``, the
replicas on a node share one snapshot of their state
(:mod:`trainguard.core.snapshot.shared`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Sequence

import torch

from trainguard.core import CheckpointError, ConfigError
from trainguard.core.checkpoint import FileInfo, SavedShard, Verified, shard_file
from trainguard.core.rank.history import JobHistory
from trainguard.core.snapshot.health import PersistHealth
from trainguard.core.snapshot.ring import check_settings, directory_for, load_verified
from trainguard.core.snapshot.own import OwnRecords, read_own
from trainguard.core.snapshot.shared import Sharing, local_ranks

from .handlers import read_shard, shard_name
from .own import own_file, pack, unpack
from .comm import job_namespace
from . import fsdp
from .snapshot import Snapshots, destinations, filled, on_device, read_payload_into

__all__ = ["Checkpoints"]

log = logging.getLogger("trainguard.torch")


class Checkpoints(JobHistory):
    """Saving and loading checkpoints for a :class:`~.guard.Guard` (a mix-in)."""

    # ------------------------------------------------------------ snapshots
    def _setup_snapshots(self, every: int, count: int, peer: bool, shared: bool = False) -> None:
        """Snapshots every ``every`` steps in ``count`` slots (0: none), with a
        copy on the next node when ``peer``, one per node for the replicas
        there when ``shared``.

        Raises:
            ConfigError: see :func:`~trainguard.core.snapshot.ring.check_settings`;
                ``shared`` with ``peer``.
        """
        check_settings(every, count, self.save_every)
        if shared and peer:
            raise ConfigError("snapshot_shared with snapshot_peer is not supported: a lost node's replicas would "
                              "each need their holder's copy from the peer; choose one")
        self.snapshot_overlap = self.settings.snapshot_overlap
        self.snapshot_every, self.snapshots, self.resumed_from = every, None, None
        self.sharing = Sharing(self.rank, every, shared, local_ranks())
        self._save_health = PersistHealth(self.rank)  # synchronous saves' (the ring has its own)
        if not every:
            return
        address = self.settings.snapshot_peer if peer else None
        if peer and not address:
            log.warning("snapshot_peer: no peer node (one node, or not launched by `trainguard run`); "
                        "snapshots stay on this node only")
        directory = directory_for(f"{job_namespace(self.settings)}-r{self.rank}-{os.getpid()}",
                                  node_dir=self.settings.node_dir, root=self.settings.snapshot_root)
        self.snapshots = Snapshots(directory, self.rank, count=count, peer=address, token=self.settings.token)

    def _snapshot_state(self, step: int, holder: int | None = None) -> dict:
        """The snapshot of ``step``: the committed state, or with a
        ``holder`` other than this rank only this rank's own part."""
        if holder is not None and holder != self.rank:
            return {"state": {**self.state.committed_own(), "step": step}, "history": self.merged_history({})}
        state = self.state.committed_state_dict()
        state["step"] = step
        return {"state": state, "history": self.merged_history({})}

    def take_snapshot(self, step: int, *, wait_s: float = 0.0, background: bool = False,
                      whole: bool = False) -> int | None:
        """Copy the committed state at ``step`` into memory; with ``wait_s``,
        wait that long for a slot a persist still holds; with ``background``,
        host state is copied while training goes on (:meth:`_settle_snapshot`
        before the next update); with ``whole``, the whole state even where
        a replica's snapshot on this node holds it."""
        background = background and self.snapshot_overlap
        holder = self.rank if whole else self.snapshot_holder()
        meta = self.sharing.meta(holder)
        index = self.snapshots.take(self._snapshot_state(step, holder), step, background=background, meta=meta)
        if index is None and wait_s:
            log.warning("rank %d: every snapshot slot is being persisted; waiting for one", self.rank)
            self.snapshots.wait(wait_s)
            index = self.snapshots.take(self._snapshot_state(step, holder), step, background=background, meta=meta)
        if index is not None:
            self.sharing.taken(step, holder, len(self.snapshots.slots))
        return index

    def snapshot_holder(self) -> int:
        """The rank whose snapshots hold this rank's state on this node: the
        lowest replica here with ``snapshot_shared`` (while its snapshots
        keep up), else this rank."""
        return self.sharing.holder(self.groups[0].copies(self.rank), self.process_group.members,
                                   self.snapshots.directory.slots_of)

    def _settle_snapshot(self) -> None:
        """Wait for a snapshot copy still running (before the state changes)."""
        if self.snapshots is not None:
            self.snapshots.settle()

    # ------------------------------------------------------------ own part
    def _setup_own_records(self) -> None:
        """Record this rank's own part in the node agent's memory at every
        update (:mod:`trainguard.core.snapshot.own`); none without an agent."""
        self._node_dir = self.settings.node_dir
        self.own_records = OwnRecords(self._node_dir, self.rank) if self._node_dir else None
        self._sent_own: bytes | None = None  # packed when this step's first gradient bucket left
        self._record_when_sent: bool | None = None  # None: not known yet whether the script draws in between

    def _record_own(self, step: int, own: dict) -> None:
        if self.own_records is not None:
            self.own_records.write(step, pack(own))

    def _record_own_before_sending(self) -> None:
        """(DDP's comm hook, at the step's first gradient bucket.) Once this
        rank's gradients reached every peer, the peers can commit the step
        while this process dies before it began its update: the dump then
        saves that step, and needs this rank's own part of it. So it is
        recorded now, as it will be at the update -- unless this script
        draws random numbers or takes a batch between its backward pass and
        its update: not until a step showed it does not, and never once one
        showed it does (a rank lost there then has no record of the step,
        and its relaunch says so)."""
        if self.own_records is None or self._record_when_sent is False:
            return
        try:
            self._sent_own = pack(self.state.own_part())
            if self._record_when_sent:
                self.own_records.write(self._step + 1, self._sent_own)
        except Exception as e:  # noqa: BLE001 - inside DDP's hook: the update's record raises it on this thread
            log.debug("rank %d: no record of its own part when its gradients left: %s", self.rank, e)
            self._sent_own, self._record_when_sent = None, False

    def _record_own_at_update(self) -> None:
        """The update begins: the step drew its random numbers and batch."""
        if self.own_records is None:
            return
        own, sent, self._sent_own = pack(self.state.own_part()), self._sent_own, None
        if sent is not None and self._record_when_sent is not False:
            if own == sent:
                self._record_when_sent = True
            else:
                self._record_when_sent = False
                log.info("rank %d: the script draws random numbers or takes data between its backward pass and its "
                         "update, so its own part is recorded at the update only", self.rank)
        if not (sent == own and self.own_records.written == self._step + 1):
            self.own_records.write(self._step + 1, own)

    def recorded_own(self, rank: int, step: int) -> bytes | None:
        """``rank``'s own part at ``step`` as recorded on this node, or ``None``."""
        return read_own(self._node_dir, rank, step) if self._node_dir else None

    def write_own(self, step: int, rank: int, data: bytes) -> FileInfo:
        """``rank``'s own part (packed) as a file of ``step``'s checkpoint."""
        return self.store.write(step, own_file(rank), lambda f: f.write(data))

    # ------------------------------------------------------------ saves
    def write_shard(self, step: int) -> list[FileInfo]:
        """Write this rank's committed dense state at ``step`` (temporary
        name); with snapshots, the payload of the snapshot of ``step`` (taken
        now unless memory already holds it); a sharded model's, its part in
        DCP's format (:mod:`.fsdp`)."""
        if self.sharding is not None:
            return fsdp.write_part(self.store, step, self.state, self.rank)
        copies = self.groups[0].copies(self.rank)
        if self.snapshots is not None:
            index = self.snapshots.holding(step) if self.sharing.whole(step) else None
            if index is not None:
                self.snapshots.reused.append(step)
                log.info("rank %d: the save of step %d reuses its snapshot in memory", self.rank, step)
            else:
                index = self.take_snapshot(step, wait_s=self.save_timeout_s, whole=True)
                if index is None:
                    raise CheckpointError(f"rank {self.rank}: no snapshot slot came free for step {step}")
            slot = self.snapshots.slots[index]
            slot.lock(False, block=True)
            try:
                return [self.store.write_buffer(step, shard_file(0, copies, ".safetensors"), slot.payload())]
            finally:
                slot.unlock()
        state = self.state.committed_state_dict()
        state["step"] = step
        return [self.store.write(step, shard_name(copies), lambda f: torch.save(state, f))]

    def finalize_checkpoint(self, step: int, shards: Sequence[SavedShard], history: dict,
                            extra: Sequence[FileInfo] = ()) -> None:
        if self.sharding is not None:
            return fsdp.finalize(self.store, step, shards, extra, world_size=self.world_size,
                                 meta={"history": history, "finalised_by": self.rank})
        self.store.finalize(
            step, [f for s in shards for f in s.files] + list(extra),
            layout={"world_size": self.world_size, "shards": [s.describe() for s in shards]},
            meta={"history": history, "finalised_by": self.rank})

    def save(self) -> None:
        """Save a checkpoint at the current step (every rank calls this).

        The lowest rank holding each shard writes it; rank 0 finalises.
        """
        if self.store is None:
            raise CheckpointError("no checkpoint_dir was given to the Guard")
        # A store that fails does not stop training: the save tells `health` (one warning per streak of
        # failed saves; the controller hears of it, for `trainguard status`) and the next save is the retry.
        health = self.snapshots.health if self.snapshots is not None else self._save_health
        health.tell = self.processor.report_persist
        if self.rehearsal is not None:
            self.rehearsal.saved(self._step)
        with self.section("checkpoint"):
            self.injector.strike("save", self._step)
            if self.snapshots is not None and self.sharding is None:  # a sharded model's: DCP, now
                self._save_async()
            else:
                self._save(health)

    def _save_async(self) -> None:
        """Snapshot (unless memory holds this step already) and let the
        persist worker write it; its finaliser waits for every shard."""
        step, group, members = self._step, self.groups[0], self.process_group.members
        shards = sorted({tuple(c for c in group.copies(r)) for r in members})
        savers = {min(c for c in copies if c in members): copies for copies in shards}
        saver = self.rank in savers
        index = self.snapshots.holding(step) if not saver or self.sharing.whole(step) else None
        if index is None:  # the persist is sent when the copy has landed
            index = self.take_snapshot(step, wait_s=self.save_timeout_s, background=True, whole=saver)
        if index is None:
            raise CheckpointError(f"rank {self.rank}: no snapshot slot came free to save step {step}")
        # every rank's own part (random streams, data position): the shard holds its saver's only
        self.snapshots.write_beside(self.store, step, own_file(self.rank),
                                    lambda: self.write_own(step, self.rank, pack(self.state.committed_own())),
                                    whole=not saver)
        if not saver:
            return
        finalize = None
        if self.rank == members[0]:
            finalize = {"expected": [shard_file(0, c, ".safetensors") for c in savers.values()] +
                                    [own_file(r) for r in members],
                        "timeout_s": self.save_timeout_s, "keep": self.store.keep,
                        "layout": {"world_size": self.world_size, "shards": [
                            {"kind": 0, "copies": list(c), "full": group.replica_cnt == len(group.rank_list),
                             "saved_by": r, "files": [shard_file(0, c, ".safetensors")]}
                            for r, c in sorted(savers.items())]},
                        "meta": {"history": self.merged_history({}), "finalised_by": self.rank}}
        self.snapshots.persist(index, step, root=str(self.store.root),
                               name=shard_file(0, savers[self.rank], ".safetensors"), finalize=finalize)

    def _save(self, health: PersistHealth) -> None:
        """Every rank writes its part and all learn, in one all-gather, whether
        each did; rank 0 finalises. A failed save is told to ``health`` and
        rank 0 removes its temporary directory; training goes on."""
        step, group = self._step, self.groups[0]
        members = self.process_group.members  # fewer than the world while elastic training dropped ranks
        copies = group.copies(self.rank)
        try:
            own = self.write_own(step, self.rank, pack(self.state.committed_own()))
            mine = {"own": [own.name, own.bytes, own.sha256]}
            if self.rank == min(c for c in copies if c in members):
                mine.update(copies=copies, full=group.replica_cnt == len(group.rank_list), saver=self.rank,
                            files=[[i.name, i.bytes, i.sha256] for i in self.write_shard(step)])
        except CheckpointError as e:  # into the all-gather: a rank that left it would stall the others
            mine = {"failed": str(e)}
        every = self.process_group.all_gather_json(mine, self.device.torch_device)
        failed = [s["failed"] for s in every if "failed" in s]
        if self.rank == members[0] and not failed:
            saved = [SavedShard(kind=0, copies=tuple(s["copies"]), full=s["full"], rank=s["saver"],
                                files=tuple(FileInfo(*f) for f in s["files"])) for s in every if "files" in s]
            try:
                self.finalize_checkpoint(step, saved, self.merged_history({}),
                                         extra=[FileInfo(*s["own"]) for s in every])
            except CheckpointError as e:
                failed = [str(e)]
        if not failed:
            health.saved(step, final=self.rank == members[0])
            return
        if self.rank == members[0]:  # every rank is past its writes: nothing of this step is needed
            shutil.rmtree(self.store.tmp_path(step), ignore_errors=True)
        health.failed(step, mine.get("failed", failed[0]),
                      self.store.tracked_step() if health.failing is None else None)

    # ------------------------------------------------------------ loads (RankRuntime._load)
    def _gather_steps(self, steps: list[int]) -> list[list[int]]:
        return self.process_group.all_gather_json(steps, self.device.torch_device)

    def _gather_outcomes(self, code: int) -> list[int]:
        return self.process_group.all_gather_json(code, self.device.torch_device)

    def _load_memory(self, step: int, slot, source: str, found: Verified | None, holder) -> None:
        # Straight into the parameters and whatever optimizer state exists, once the checksum passed.
        into = destinations({"state": self.state.state_dict()})
        read = lambda payload: read_payload_into(payload, self.device.torch_device, into)  # noqa: E731
        held = load_verified(slot, read, filled)[1]
        state, own = held["state"], None
        if holder is not None:  # this rank's own part: the rest is in its holder's snapshot of the step
            state, own = load_verified(holder, read, filled)[1]["state"], state
        self.state.load_state_dict(state)
        if own is not None:
            self.state.load_own(own)
        # A dying-gasp checkpoint of the same step knows of the fault
        # that stopped the job; the snapshot was taken before it.
        stored = found.manifest.get("meta", {}).get("history") if found is not None and found.step == step \
            else None
        self.history = stored or held["history"]
        self.resumed_from = {"step": step, "source": source, **({"state_of": holder.path.name} if holder else {})}
        log.info("rank %d resumed from %s at step %d (%s%s)", self.rank, source, step, slot.path,
                 f" and {holder.path.name}" if holder else "")

    def _load_stored(self, found: Verified) -> int:
        if fsdp.is_dcp(found):  # a sharded model's checkpoint: loads into any layout
            fsdp.load(found, self.state)
            return self._resumed_from_storage(found)
        if self.sharding is not None:
            raise CheckpointError(f"{found.path} is not in DCP's format (a checkpoint of a data-parallel job): this "
                                  f"{self.sharding.kind} model cannot load it")
        shards = found.manifest.get("layout", {}).get("shards", [])
        mine = next((s for s in shards if s["kind"] == 0 and (s["full"] or self.rank in s["copies"])), None)
        if mine is None:
            raise CheckpointError(f"{found.path} holds no dense shard for rank {self.rank} "
                                  f"(saved with world size {found.manifest.get('layout', {}).get('world_size')})")
        with found.open(mine["files"][0]) as path:  # the bytes verified, whatever is at the name now
            state = read_stored_snapshot(path, self.device.torch_device) if path.suffix == ".safetensors" else \
                read_shard(path)
        files, own = found.manifest.get("files", {}), None
        if own_file(self.rank) in files:  # this rank's streams and data position (the shard holds its saver's)
            with found.open(own_file(self.rank)) as path:
                own = unpack(path.read_bytes(), str(path))
        elif str(self.rank) not in state.get("rng", {}) and rng_file(self.rank) in files:  # before own files
            with found.open(rng_file(self.rank)) as path:
                try:
                    state.setdefault("rng", {}).update(torch.load(path, weights_only=True))
                except Exception as e:  # noqa: BLE001 - torch.load raises many kinds; the file passed its checksum
                    raise CheckpointError(f"{path} is not a readable RNG file: {e}") from None
        self.state.load_state_dict(state)
        return self._resumed_from_storage(found, own)

    def _resumed_from_storage(self, found: Verified, own: dict | None = None) -> int:
        """This rank's own part from ``found`` (unless ``own`` holds it), its history; returns its step."""
        files = found.manifest.get("files", {})
        if own is None and own_file(self.rank) in files:
            own = unpack(found.file(own_file(self.rank)).read_bytes(), str(found.file(own_file(self.rank))))
        if own is not None:
            self.state.load_own(own)
        self.history = found.manifest.get("meta", {}).get("history", self.history)
        self.resumed_from = {"step": found.step, "source": "storage"}
        log.info("rank %d resumed from storage at step %d (%s)", self.rank, found.step, found.path)
        if not self.state.rng_loaded:
            log.warning("rank %d: %s holds no random streams or data position of this rank (the dump that "
                        "wrote it could not carry them; its log says why): they go on as this process seeded "
                        "them, so the job is no longer bit-identical to a fault-free run", self.rank, found.path.name)
        return found.step


def rng_file(rank: int) -> str:
    """The file of a checkpoint holding the RNG streams of ``rank`` (a rank that saved no shard), before
    checkpoints held every rank's own part (:func:`.own.own_file`); still read."""
    return f"rng_r{rank}.pt"


def read_stored_snapshot(path, device: torch.device) -> dict:
    """The state in a persisted snapshot, read with the safetensors library."""
    from safetensors import safe_open
    try:
        with safe_open(os.fspath(path), framework="pt", device="cpu") as f:  # a verified file: its descriptor
            meta = json.loads(f.metadata()["trainguard"])
            tensors = [f.get_tensor(name).to(device) if on_device(name) else f.get_tensor(name)
                       for name in meta["names"]]
        from .state import unflatten
        return unflatten(meta["skeleton"], tensors)["state"]
    except Exception as e:  # noqa: BLE001 - a file that passed its checksum and does not parse is corrupt
        raise CheckpointError(f"{path} is not a readable trainguard snapshot: {type(e).__name__}: {e}") from None
