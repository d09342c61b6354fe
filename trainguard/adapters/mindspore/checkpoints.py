"""The MindSpore Guard's checkpoints: periodic saves, in-memory snapshots of
the parameter dict, and the newest state loaded at start.

A mix-in of :class:`~.guard.Guard`. Without snapshots a save writes
MindSpore's own ``.ckpt`` (``ms.save_checkpoint``). With ``snapshot_every``
every parameter (weights, BatchNorm statistics, optimizer moments, its step
counter) is copied into a slot in shared memory every that many steps --
one ``asnumpy`` and one copy per parameter, no pickling -- and a save only
hands that slot to the persist worker, which writes it as
``rank_{r}/ttp_rank_{r}-{epoch}_{step}.safetensors`` (a safetensors file
whose tensor names are the parameter names, readable by
``mindspore.load_checkpoint(path, format="safetensors")``). A dying-gasp
save of a step memory already holds writes that payload as is.

With ``snapshot_shared`` the data-parallel replicas on a machine share one
snapshot per step (:mod:`trainguard.core.snapshot.shared`): the lowest
copies the parameters, the others only a header naming it (MindSpore's
state has no per-rank part), and a replica that writes a save copies them
itself.

Each rank's random streams and BatchNorm statistics are its own
(:mod:`.own`): recorded in the node
agent's memory as each update begins, written as ``own_r<rank>.json`` by
every rank at a periodic save and by every survivor of a dying gasp (a
survivor on a lost rank's node carries that rank's record), and set again at
a resume from that checkpoint.
"""

from __future__ import annotations

import logging
import os
import shutil

import numpy as np

from trainguard.core import CheckpointError, ConfigError
from trainguard.core.checkpoint import FileInfo, Verified
from trainguard.core.rank.history import JobHistory
from trainguard.core.snapshot import Entry, SnapshotDir, SnapshotRing, payload_header
from trainguard.core.snapshot.ring import FORMAT, check_settings, directory_for, load_verified
from trainguard.core.snapshot.own import OwnRecords, read_own
from trainguard.core.snapshot.shared import Sharing

from .handlers import load_checkpoint, shard_name
from .own import FILE_INTS, file_from_ints, file_ints, own_file, pack, unpack
from .state import set_streams

__all__ = ["Checkpoints", "ParamSnapshots", "read_arrays"]

log = logging.getLogger("trainguard.mindspore")

DTYPES = {np.dtype(k): v for k, v in {
    "float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32", "int16": "I16",
    "int8": "I8", "uint8": "U8", "bool": "BOOL", "uint16": "U16", "uint32": "U32", "uint64": "U64"}.items()}
BY_NAME = {v: k for k, v in DTYPES.items()}


class ParamSnapshots(SnapshotRing):
    """Snapshots of a MindSpore parameter dict (arrays by parameter name)."""

    def __init__(self, directory: SnapshotDir, rank: int, *, count: int = 2) -> None:
        super().__init__(directory, rank, count=count, naming="mindspore")
        self._views: dict[int, list[np.ndarray]] = {}

    def forget_views(self) -> None:
        self._views.clear()

    def take(self, arrays: dict[str, np.ndarray], step: int, history: dict, meta: dict | None = None) -> int | None:
        """Copy ``arrays`` into a free slot as the snapshot of ``step``; the
        slot index, or ``None`` when skipped. ``meta``: more JSON for the
        payload header."""
        names = list(arrays)
        entries = []
        for name in names:
            a = arrays[name]
            if a.dtype not in DTYPES:
                raise CheckpointError(f"cannot snapshot parameter {name}: dtype {a.dtype} has no safetensors name")
            entries.append(Entry(name, DTYPES[a.dtype], tuple(a.shape), a.nbytes, a.itemsize))

        def fill(index: int, payload: memoryview, layout) -> None:
            views = self._views.get(index)
            if views is None:
                views = self._views[index] = [
                    np.frombuffer(payload, BY_NAME[e.dtype], int(np.prod(e.shape, dtype=np.int64)),
                                  layout.data_start + layout.offsets[e.name][0]).reshape(e.shape)
                    for e in entries]
            for view, name in zip(views, names):
                np.copyto(view, arrays[name])

        return self.write(step, entries, {"names": names, "history": history, **(meta or {})}, fill)


def read_arrays(payload, *, copy: bool = True) -> tuple[int, dict[str, np.ndarray], dict]:
    """Step, parameter arrays and history of a snapshot payload; the arrays
    are copied out, or views into ``payload`` (not ``copy``: for a caller
    that loads them while it holds the payload).

    Raises:
        CheckpointError: malformed, or not a parameter-dict snapshot.
    """
    table, meta, start = payload_header(payload)
    if meta.get("format") != FORMAT or "history" not in meta:
        raise CheckpointError("not a MindSpore trainguard snapshot")
    try:
        arrays = {}
        for name in meta["names"]:
            e = table[name]
            b, end = e["data_offsets"]
            dtype = BY_NAME[e["dtype"]]
            view = np.frombuffer(payload, dtype, (end - b) // dtype.itemsize, start + b).reshape(e["shape"])
            arrays[name] = view.copy() if copy else view
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"snapshot payload does not match its header ({e})") from None
    return int(meta["step"]), arrays, meta["history"]


class Checkpoints(JobHistory):
    """Saving and loading for the MindSpore :class:`~.guard.Guard` (a mix-in)."""

    def setup_snapshots(self, every: int, count: int, shared: bool = False) -> None:
        """Snapshots every ``every`` steps in ``count`` slots (0: none), one
        per machine for the replicas there when ``shared``.

        Raises:
            ConfigError: see :func:`~trainguard.core.snapshot.ring.check_settings`.
        """
        check_settings(every, count, self.save_every)
        self.snapshot_every, self.snapshots, self.resumed_from = every, None, None
        here = self.hosts[self.rank]
        self.sharing = Sharing(self.rank, every, shared, {r for r, h in self.hosts.items() if h == here})
        if every:
            directory = directory_for(f"{self.settings.job_id or 'ms'}-r{self.rank}-{os.getpid()}",
                                      node_dir=self.settings.node_dir, root=self.settings.snapshot_root)
            self.snapshots = ParamSnapshots(directory, self.rank, count=count)

    # ------------------------------------------------------------ own part
    def setup_own_records(self) -> None:
        """Record this rank's random streams in the node agent's memory as
        each update begins (:mod:`trainguard.core.snapshot.own`); none
        without an agent."""
        self.own_records = OwnRecords(self.settings.node_dir, self.rank) if self.settings.node_dir else None

    def updating(self, step: int) -> None:
        """The update to ``step`` begins: the step drew its random numbers."""
        self.state.updating(step)
        if self.own_records is not None:
            self.own_records.write(step, pack(self.state.streams_at(step), self.state.buffers_at(step)))

    def recorded_own(self, rank: int, step: int) -> bytes | None:
        """``rank``'s streams at ``step`` as recorded on this node, or ``None``."""
        return read_own(self.settings.node_dir, rank, step) if self.settings.node_dir else None

    def write_own(self, step: int, rank: int, data: bytes) -> FileInfo:
        """``rank``'s streams (packed) as a file of ``step``'s checkpoint."""
        return self.store.write(step, own_file(rank), lambda f: f.write(data))

    def _load_own(self, found: Verified | None, step: int) -> bool:
        """Set this rank's random streams and buffers from ``found``, the
        checkpoint of ``step`` on storage; say so when it holds none of this
        rank's. True when the buffers were this rank's own."""
        name = own_file(self.rank)
        if found is not None and found.step == step and name in found.manifest.get("files", {}):
            with found.open(name) as path:
                return self._set_own(path.read_bytes(), str(path))
        log.warning("rank %d: the checkpoint of step %d holds no random streams of this rank (written before "
                    "trainguard saved them, or by a dying gasp that could not carry them: its log says why): they "
                    "go on as this process seeded them, so a script that draws from them is no longer "
                    "bit-identical to a fault-free run", self.rank, step)
        return False

    def _set_own(self, data: bytes, what: str) -> bool:
        """Set this rank's streams, and its buffers when the record has them
        (True), from its own-part record ``data``."""
        record = unpack(data, what)
        if record["buffers"] is not None:
            try:
                self.state.set_buffers(record["buffers"], source=what)
            except ValueError as e:
                raise CheckpointError(str(e)) from None
        set_streams(record)
        return record["buffers"] is not None

    def resume_user_streams(self, position: int) -> None:
        """Set this rank's random streams from those written beside a user
        save function's files of data position ``position`` (see
        :mod:`.user_saves`); say so when there are none."""
        data = self.stream_files.read(position, self.rank) if self.stream_files is not None else None
        if data is None:
            where = self.stream_files.path(position, self.rank) if self.stream_files is not None else \
                "nowhere (no ckpt_save_path)"
            log.warning("rank %d: no random streams of step %d beside your save function's files (%s): they go "
                        "on as this process seeded them, so a script that draws from them is no longer "
                        "bit-identical to a fault-free run", self.rank, position, where)
            return
        if not self._set_own(data, str(self.stream_files.path(position, self.rank))):
            self._warn_of_others_statistics("your load function's")
        self.state.commit(self._step)  # a retry of the first step sets these back
        log.info("rank %d took its random streams of step %d from %s", self.rank, position,
                 self.stream_files.path(position, self.rank))

    def take_snapshot(self, step: int, *, wait_s: float = 0.0, whole: bool = False) -> int | None:
        """Copy the parameters at ``step`` into memory (only a header naming
        the replica whose snapshot holds them, when shared, unless
        ``whole``); with ``wait_s``, wait that long for a slot a persist holds."""
        holder = self.rank if whole else self.snapshot_holder()
        arrays = self.state.arrays() if holder == self.rank else {}
        take = lambda: self.snapshots.take(arrays, step, self.merged_history({}),  # noqa: E731
                                           meta=self.sharing.meta(holder))
        index = take()
        if index is None and wait_s:
            self.snapshots.wait(wait_s)
            index = take()
        if index is None:
            raise CheckpointError(f"rank {self.rank}: no snapshot slot came free for step {step}")
        self.sharing.taken(step, holder, len(self.snapshots.slots))
        return index

    def snapshot_holder(self) -> int:
        """The rank whose snapshots hold this rank's parameters on this
        machine (see :meth:`~trainguard.core.snapshot.shared.Sharing.holder`)."""
        return self.sharing.holder(self.groups[0].copies(self.rank), range(self.world_size),
                                   self.snapshots.directory.slots_of)

    def write_snapshot_file(self, step: int):
        """The dying-gasp file of ``step`` from its snapshot (taken now
        unless memory holds it already)."""
        index = self.snapshots.holding(step) if self.sharing.whole(step) else None
        if index is None:
            index = self.take_snapshot(step, wait_s=self.save_timeout_s, whole=True)
        else:
            self.snapshots.reused.append(step)
            log.info("rank %d: the save of step %d reuses its snapshot in memory", self.rank, step)
        slot = self.snapshots.slots[index]
        slot.lock(False, block=True)
        try:
            return self.store.write_buffer(step, _snapshot_name(self, step), slot.payload())
        finally:
            slot.unlock()

    # ----------------------------------------------------------------- save
    def save(self) -> None:
        """Save a checkpoint at the current step (every rank calls this): the
        lowest rank of the shard writes the parameters and finalises once
        every rank has written its own part (``own_r<rank>.json``)."""
        if self.store is None:
            raise ConfigError("no checkpoint_dir was given to the Guard")
        if self.rehearsal is not None:
            self.rehearsal.saved(self._step)
        self.injector.strike("save", self._step)
        step, copies = self._step, self.groups[0].copies(self.rank)
        saver = self.rank == min(copies)
        if self.snapshots is None:
            self._save_now(step, copies, saver)
            return
        index = self.snapshots.holding(step) if not saver or self.sharing.whole(step) else None
        if index is None:
            index = self.take_snapshot(step, wait_s=self.save_timeout_s, whole=saver)
        self.snapshots.write_beside(self.store, step, own_file(self.rank), lambda: self._write_committed_own(step),
                                    whole=not saver)
        if saver:  # the persist worker's finaliser waits for every rank's own part
            name = _snapshot_name(self, step)
            self.snapshots.persist(index, step, root=str(self.store.root), name=name, finalize={
                "expected": [name] + [own_file(r) for r in range(self.world_size)],
                "timeout_s": self.save_timeout_s, "keep": self.store.keep,
                "layout": {"world_size": self.world_size, "shards": [
                    {"kind": 0, "copies": list(copies), "full": len(copies) == self.world_size,
                     "saved_by": self.rank, "files": [name]}]},
                "meta": {"history": self.merged_history({}), "finalised_by": self.rank}})

    def _save_now(self, step: int, copies, saver: bool) -> None:
        """Every rank writes its own part (the saver the parameters too) and
        all learn in one all-gather what each wrote, digests included; the
        saver finalises when every part is there. A rank whose write failed
        raises its error; the others train on."""
        error, mine = None, [0] * FILE_INTS
        try:
            own = self._write_committed_own(step)
            shard = self._handlers.write(step) if saver else None
            mine = file_ints(own)
        except CheckpointError as e:
            error = e
        every = self.all_gather_ints(mine)
        rows = [every[r * FILE_INTS:(r + 1) * FILE_INTS] for r in range(self.world_size)]
        missing = [r for r, row in enumerate(rows) if not row[0]]
        if saver and not missing:
            owns = [file_from_ints(own_file(r), row) for r, row in enumerate(rows)]
            self._handlers.finalize_files(step, [shard, *owns], copies, self.merged_history({}))
        elif saver:
            log.warning("step %d's checkpoint is not finalised: rank(s) %s could not write their part", step,
                        missing)
            shutil.rmtree(self.store.tmp_path(step), ignore_errors=True)
        if error is not None:
            raise error

    def _write_committed_own(self, step: int) -> FileInfo:
        streams = self.state.streams_at(step)
        if streams is None:
            raise CheckpointError(f"rank {self.rank} holds no random streams of step {step} "
                                  f"(it committed step {self.state.snapshot_step})")
        return self.write_own(step, self.rank, pack(streams, self.state.buffers_at(step)))

    # ------------------------------------------------- load (RankRuntime._load)
    def _gather_steps(self, steps: list[int], width: int = 64) -> list[list[int]]:
        """Every rank's short list of steps (at most ``width``), through the
        Guard's integer all-gather (-1 pads)."""
        padded = (sorted(steps)[-width:] + [-1] * width)[:width]
        flat = self.all_gather_ints(padded)
        return [[v for v in flat[r * width:(r + 1) * width] if v >= 0] for r in range(self.world_size)]

    def _gather_outcomes(self, code: int) -> list[int]:
        return self.all_gather_ints([code])

    def _load_memory(self, step: int, slot, source: str, found: Verified | None, holder) -> None:
        def load(read: tuple) -> dict:  # from the slot, still mapped, once its checksum matched
            self._load_arrays(read[1], str(slot.path))
            return read[2]

        views = lambda payload: read_arrays(payload, copy=False)  # noqa: E731
        if holder is None:
            history = load_verified(slot, views, load)
        else:  # this rank's own slot holds only a header naming the replica whose snapshot holds the parameters
            history = load_verified(slot, views)[2]
            load_verified(holder, views, load)
        stored = found.manifest.get("meta", {}).get("history") if found is not None and found.step == step \
            else None
        self.history = stored or history
        own = self._load_own(found, step)
        self.resumed_from = {"step": step, "source": source, **({"state_of": holder.path.name} if holder else {})}
        log.info("rank %d resumed from %s at step %d (%s%s)", self.rank, source, step, slot.path,
                 f" and {holder.path.name}" if holder else "")
        if holder is not None and not own:
            self._warn_of_others_statistics(f"{holder.path.name}'s")

    def _load_arrays(self, arrays: dict[str, np.ndarray], source: str) -> None:
        try:
            self.state.load_arrays(arrays, source=source)
        except ValueError as e:
            raise CheckpointError(str(e)) from None

    def _load_stored(self, found: Verified) -> int:
        shards = found.manifest.get("layout", {}).get("shards", [])
        mine = next((s for s in shards if s["kind"] == 0 and (s["full"] or self.rank in s["copies"])), None)
        if mine is not None and mine["files"][0].endswith(".safetensors"):
            with found.open(mine["files"][0]) as path:  # the bytes verified, whatever is at the name now
                self._load_arrays(read_arrays(path.read_bytes(), copy=False)[1], str(path))
            self.history = found.manifest.get("meta", {}).get("history", {"records": [], "pids": {}})
        else:
            self.history = load_checkpoint(found, self.rank, self.state)
        own = self._load_own(found, found.step)
        if mine is not None and mine.get("saved_by", self.rank) != self.rank and not own:
            self._warn_of_others_statistics(f"rank {mine['saved_by']}'s")
        self.resumed_from = {"step": found.step, "source": "storage"}
        log.info("rank %d resumed from storage at step %d (%s)", self.rank, found.step, found.path)
        return found.step

    def _warn_of_others_statistics(self, whose: str) -> None:
        """A checkpoint holds one replica's parameters; BatchNorm's moving
        statistics are each rank's own (moved by its own batches, never
        all-reduced), and a rank whose own part does not carry its own (a
        record written before they were kept) goes on with other
        statistics than it had."""
        moving = [p.name for p in self.state.buffers if "moving_" in p.name]
        if moving:
            log.warning("rank %d resumed with %s BatchNorm statistics (%s, ...): each rank moves its own, and a "
                        "checkpoint holds one replica's, so this job is no longer bit-identical to a run without "
                        "the restart (docs/mindspore.md)", self.rank, whose, moving[0])


def _snapshot_name(guard, step: int) -> str:
    return shard_name(guard.rank, step, guard.steps_per_epoch).removesuffix(".ckpt") + ".safetensors"
