"""The framework-free half of a rank's snapshots: a ring of slots in the
job's snapshot directory and the persist worker (the settings and the
directory: :mod:`.settings`; finding verified snapshots to load:
:mod:`.found`).

An adapter subclasses :class:`SnapshotRing` and calls :meth:`write` with
the layout of its state (one :class:`Entry` per tensor, in its own order),
the metadata to carry (JSON) and a ``fill`` function that copies the
tensors into the payload; it supplies :meth:`forget_views` to drop whatever
it cached about a slot's memory when the layout changes.

A ``fill`` may return the rest of its copy as a function. Asked for in the
``background``, the ring runs it on a thread of its own while training
goes on, then commits the slot and asks for its seal from that thread (so
a trainer that dies in the next step still leaves the snapshot behind);
else it runs it once the header is written (a device copy in flight
meanwhile). The caller must not change the state before
:meth:`SnapshotRing.settle`, which every other method calls first and the
adapter calls before the next optimizer update. A persist asked for
meanwhile is sent once the copy has landed.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..api import CheckpointError
from ..events import note
from ..checkpoint import CheckpointStore, FileInfo
from .peer import fetch
from .health import PersistHealth
from .persist_client import PersistWorker
from .records import give_up, write_record
from .found import load_verified, verified
from .segment import Entry, Layout, Slot, State
from .settings import check_settings, directory_for
from .shm import SnapshotDir

__all__ = ["FORMAT", "SnapshotRing", "check_settings", "directory_for", "load_verified"]

log = logging.getLogger("trainguard.snapshot")

FORMAT = "trainguard-snapshot/1"


class SnapshotRing:
    """One rank's snapshot slots and persist worker.

    Args:
        directory: the job's snapshot directory on this node.
        rank: the global rank whose state this is.
        count: slots kept in memory (2: a crash during a copy still leaves
            the previous snapshot).
        peer: ``host:port`` of the next node's agent, to keep a second copy
            there (None: no copy).
        naming: the checkpoint naming persists use (``torch``,
            ``megatron``, ``mindspore``).
        token: the job secret the copies on the peer node are pushed and
            fetched with (:attr:`~trainguard.core.config.RankConfig.token`).
    """

    def __init__(self, directory: SnapshotDir, rank: int, *, count: int = 2, peer: str | None = None,
                 naming: str = "torch", token: str = "") -> None:
        if count < 1:
            raise ValueError("keep at least one snapshot in memory")
        self.directory, self.rank, self.peer, self.naming = directory, rank, peer, naming
        self._token = token
        self.slots = [directory.slot(rank, i) for i in range(count)]
        self.worker = PersistWorker(env={"TRAINGUARD_TOKEN": token})  # its pushes to the peer carry it
        self.layout: Layout | None = None
        self._key: tuple = ()
        self._last_entries: Sequence[Entry] = ()
        self.held: dict[int, int] = {}  # slot -> step written there by this process
        self.pinned: dict[int, int | None] = {}  # slot -> request id of a persist not answered yet (None: copying)
        self.finalising: dict[int, list[str]] = {}  # step -> the files its finalise (asked, not answered) awaits
        self.taken = self.skipped = 0
        self.persisted: list[dict] = []
        self.errors: list[str] = []
        self.health = PersistHealth(rank)
        self.reused: list[int] = []  # steps whose dying-gasp save wrote the snapshot
        self.pending: _Pending | None = None  # the snapshot whose copy is still running
        self.waited = 0.0  # seconds settle() waited for copies still running
        self._settling = threading.Lock()
        self._copier: ThreadPoolExecutor | None = None  # runs the copies a fill left to the background

    def forget_views(self) -> None:
        """Drop every view into slot memory (the slots are about to be resized)."""

    def write(self, step: int, entries: Sequence[Entry], meta: dict,
              fill: Callable[[int, memoryview, Layout], Callable[[], None] | None], *,
              background: bool = False) -> int | None:
        """Write the snapshot of ``step`` into a free slot: ``fill(index,
        payload, layout)`` starts copying the tensors and returns what
        finishes the copy (``None``: nothing left). With ``background`` that
        runs on a thread of the ring's own while the caller goes on (see
        :meth:`settle`); else here, after the header: a device copy that
        ``fill`` left in flight runs while the metadata is encoded.

        Returns:
            The slot index, or ``None`` when every slot is being persisted
            (the snapshot is skipped).
        """
        self.settle()
        self.poll()
        key = self._key if entries is self._last_entries else tuple((e.name, e.dtype, e.shape) for e in entries)
        self._last_entries = entries
        if self.layout is None or key != self._key:
            self._relayout(entries, key, self._text(step, meta))
        while True:
            index = self._free_slot()
            if index is None:
                self.skipped += 1
                return None
            rest, outgrown = self._fill(index, step, meta, fill, background)
            if outgrown is None:
                break
            self._relayout(entries, key, outgrown)  # the metadata outgrew its reserve: again, in a new layout
        payload_bytes = self.layout.payload_bytes
        if rest is not None:
            if self._copier is None:
                self._copier = ThreadPoolExecutor(1, thread_name_prefix=f"trainguard-snapshot-r{self.rank}")
            self.pending = _Pending(index, step, self._copier.submit(self._finish, rest, index, step, payload_bytes))
            self.pinned[index] = None  # no persist may pick it, nor write() reuse it, until settled
            return index
        self._finish(None, index, step, payload_bytes)
        self._held(index, step)
        return index

    def _fill(self, index: int, step: int, meta: dict, fill, background: bool) -> tuple[Callable | None, str | None]:
        """Fill slot ``index`` (see :meth:`write`): the rest of the copy left
        to the background, and the metadata when it outgrew the layout's
        reserve (the slot is then left unlocked, its copy landed)."""
        slot, layout = self.slots[index], self.layout
        self.held.pop(index, None)  # its old step is overwritten from here on
        rest = None
        try:
            payload = slot.begin(layout.payload_bytes)
            rest = fill(index, payload, layout)
            text = self._text(step, meta)
            fits = len(text) * 2 <= layout.header_bytes
            if fits:
                payload[:layout.data_start] = layout.header(text)
            if rest is not None and not (background and fits):
                rest, finish = None, rest
                finish()
        finally:
            if rest is None:
                slot.unlock()
        return rest, None if fits else text

    @staticmethod
    def _text(step: int, meta: dict) -> str:
        return json.dumps({"format": FORMAT, "step": step, **meta})

    def _relayout(self, entries: Sequence[Entry], key: tuple, text: str) -> None:
        self.forget_views()
        self.layout, self._key = Layout(entries, meta_reserve=max(4096, 4 * len(text))), key

    def _finish(self, rest: Callable[[], None] | None, index: int, step: int, payload_bytes: int) -> None:
        """The rest of the copy (when given), commit the slot, ask for its seal."""
        slot = self.slots[index]
        try:
            if rest is not None:
                rest()
            slot.commit(step, payload_bytes)
        finally:
            slot.unlock()
        self.worker.submit("seal", slot=str(slot.path), step=step, rank=self.rank, peer=self.peer)

    def _held(self, index: int, step: int) -> None:
        for other in [i for i, held in self.held.items() if held == step]:  # taken again (whole, for a save)
            del self.held[other]
        self.held[index] = step
        self.taken += 1
        if self.rank == 0:  # one line a snapshot in the run directory's events (TRAINGUARD_RUN_DIR), not one a rank
            note("snapshot", step=step)

    def settle(self) -> None:
        """Wait for a copy :meth:`write` left running, commit its slot and
        send what waited on it (seal, persist). A copy that failed leaves
        the slot ``WRITING`` (never loaded) and its persist failed."""
        if self.pending is None:
            return
        with self._settling:  # a recovery thread may settle while the training thread does
            pending, self.pending = self.pending, None
            if pending is None:
                return
            t = time.perf_counter()
            try:
                pending.copying.result()
            except Exception as e:  # noqa: BLE001 - the copy's error belongs to this snapshot, not to training
                self.errors.append(f"step {pending.step}: the snapshot copy failed: {e}")
                log.error("rank %d: copying the snapshot of step %d failed: %s", self.rank, pending.step, e)
            else:
                self._held(pending.index, pending.step)
            finally:
                self.waited += time.perf_counter() - t
            del self.pinned[pending.index]
            for request in pending.persists:  # after a failed copy the worker refuses them, and says so
                self.persist(pending.index, pending.step, **request)

    def _free_slot(self) -> int | None:
        """The slot holding the oldest step (or none) that no persist needs
        and no other process is reading; when the worker is sealing the only
        one left, wait for it (a checksum pass, milliseconds)."""
        order = [i for i in sorted(range(len(self.slots)), key=lambda i: self.held.get(i, -1))
                 if i not in self.pinned]
        for i in order:
            if self.slots[i].lock(True):
                return i
        if order and self.slots[order[0]].lock(True, block=True):
            return order[0]
        return None

    def holding(self, step: int) -> int | None:
        """The slot this process wrote ``step`` into, if it still holds it."""
        self.settle()
        for index, held in self.held.items():
            info = self.slots[index].info()
            if held == step and info is not None and info.step == step and \
                    info.state in (State.COMPLETE, State.SEALED):
                return index
        return None

    # ------------------------------------------------------------ persist
    def persist(self, index: int, step: int, *, root: str, name: str, finalize: dict | None) -> None:
        """Ask the worker to write slot ``index`` (holding ``step``) to storage
        (once its copy has landed, when it is still running)."""
        if finalize:
            self.finalising[step] = list(finalize["expected"])
        if self.pending is not None and self.pending.index == index:
            self.pending.persists.append({"root": root, "name": name, "finalize": finalize})
            return
        rid = self.worker.submit("persist", slot=str(self.slots[index].path), step=step, root=root,
                                 naming=self.naming, name=name, finalize=finalize)
        self.pinned[index] = rid

    def give_up(self, store: CheckpointStore, names: Sequence[str], why: str) -> list[int]:
        """Give up each save this rank finalises that awaits one of ``names``
        not written yet: its writer was lost (``why``), so it never will be
        (:func:`.records.give_up`); the finaliser stops waiting at once and
        the next save writes a complete checkpoint. Returns those steps."""
        steps = []
        for step, expected in sorted(self.finalising.items()):
            try:
                lost = give_up(store, step, [n for n in expected if n in names])
            except CheckpointError as e:  # the finaliser waits its timeout, as before
                log.warning("rank %d: the save of step %d awaits a file that will never be written, and %s",
                            self.rank, step, e)
                continue
            if lost:
                steps.append(step)
                newest = store.tracked_step()
                log.warning("rank %d: the checkpoint of step %d is given up: %s will never be written (%s). Training "
                            "goes on; the next save writes a complete one (the newest complete checkpoint is %s)",
                            self.rank, step, ", ".join(lost), why, "none" if newest is None else f"step {newest}")
        return steps

    def write_beside(self, store: CheckpointStore, step: int, name: str, write: Callable[[], FileInfo], *,
                     whole: bool) -> None:
        """Write ``name``, a file of ``step``'s checkpoint, on this thread
        (``write``: a rank's own part, beside the shards the worker persists)
        and record it for the finaliser. A store that fails counts as a
        failed save (:attr:`health`; training goes on) and the file is
        recorded as failed, so the finaliser gives up on the step. ``whole``:
        this file is all this rank saves of the step (its success ends a
        streak of failed saves)."""
        try:
            write_record(store, step, write())
        except CheckpointError as e:
            self.errors.append(f"step {step}: {e}")
            self.health.failed(step, str(e), store.tracked_step() if self.health.failing is None else None)
            try:
                write_record(store, step, FileInfo(name, -1, ""))
            except CheckpointError:  # the finaliser waits its timeout (unless the store fails it too)
                pass
            return
        if whole:
            self.health.saved(step)

    def poll(self, timeout: float | None = None) -> list[dict]:
        replies = self.worker.poll(timeout)
        for r in replies:
            if r["op"] == "persist":
                self.pinned = {i: rid for i, rid in self.pinned.items() if rid is None or rid != r["id"]}
                self.finalising.pop(r["step"], None)
                if r["ok"]:
                    self.persisted.append({"step": r["step"], "final": r.get("final")})
                    self.health.saved(r["step"], final=r.get("final") is not None)
                else:
                    self.errors.append(f"step {r['step']}: {r['error']}")
                    if r.get("abandoned"):  # not a failure of the store: give_up() said so already
                        log.debug("rank %d: %s", self.rank, r["error"])
                    elif r.get("superseded"):  # not a failure: the newer checkpoint is there
                        log.info("rank %d: the save of step %s was not finalised: %s", self.rank, r["step"],
                                 r["error"])
                    else:
                        self.health.failed(r["step"], r["error"], r.get("last_complete"))
            elif not r["ok"]:
                log.warning("rank %d: sealing the snapshot of step %s failed: %s", self.rank, r["step"], r["error"])
        return replies

    def wait(self, timeout: float) -> None:
        """Wait for every persist asked so far."""
        self.settle()
        deadline = time.monotonic() + timeout
        while self.pinned and time.monotonic() < deadline:
            self.poll(timeout=0.2)

    def report(self, resumed_from: dict | None) -> dict:
        return {"taken": self.taken, "skipped": self.skipped, "persisted": list(self.persisted),
                "errors": list(self.errors), "worker_restarts": self.worker.restarts,
                "reused_for_dump": list(self.reused), "resumed_from": resumed_from,
                "waited_for_copies_s": round(self.waited, 4), **self.health.report()}

    def shutdown(self, wait_s: float) -> None:
        """At the end of training: wait up to ``wait_s`` for the persists
        asked (0: leave them to the worker), close, and remove the directory
        when this process owns it."""
        if wait_s:
            self.wait(wait_s)
        self.health.closing()
        self.close(wait=bool(wait_s))
        self.directory.remove()

    def close(self, *, wait: bool = True) -> None:
        self.settle()
        if self._copier is not None:
            self._copier.shutdown()
            self._copier = None
        self.poll()
        self.worker.close(wait=wait)
        self.poll()
        self.forget_views()
        for slot in self.slots:
            slot.close()

    # ------------------------------------------------------------ load
    def available(self, *, verify: bool = True) -> dict[int, tuple[Slot, str]]:
        """Sealed snapshots of this rank in this node's memory: step ->
        (slot, "memory" or "peer memory"); with a peer and none of its own
        here, the copy fetched from the peer. Bad ones are logged and
        skipped. Without ``verify`` the checksum is not checked here: the
        caller checks the one it loads (:func:`load_verified`)."""
        found = verified(self.directory, self.directory.candidates(self.rank), verify, self.rank)
        if self.peer and not any(source == "memory" for _, source in found.values()):
            # A new node in place of a lost one: the copy is on the node this rank pushed to.
            try:
                copy = fetch(self.peer, self.directory, rank=self.rank, token=self._token)
            except CheckpointError as e:
                log.warning("rank %d: no copy from the peer node: %s", self.rank, e)
                copy = None
            if copy is not None:
                copy.close()
                found = verified(self.directory, self.directory.candidates(self.rank), verify, self.rank)
        return found

    def replica_slots(self, rank: int) -> dict[int, Slot]:
        """Sealed snapshots another rank wrote on this node, by step (their
        checksums are checked when one is read, :func:`load_verified`)."""
        return {step: slot for step, (slot, _) in verified(self.directory, self.directory.slots_of(rank), False, self.rank).items()}


@dataclass
class _Pending:
    """A snapshot whose copy was still running when :meth:`SnapshotRing.write` returned."""
    index: int
    step: int
    copying: Future
    persists: list[dict] = field(default_factory=list)  # persist() requests made meanwhile
