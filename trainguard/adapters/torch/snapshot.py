"""Torch state in and out of snapshot slots.

:class:`Snapshots` copies a state (a ``state_dict``-like nest of tensors and
scalars) into a free slot of shared memory: the structure is flattened once
per layout, every tensor gets a typed view into the slot at its offset, and a
snapshot is then one ``copy_`` per tensor plus a small JSON header -- no
pickling, no allocation. The persist worker (started here) seals each
snapshot and writes the ones asked for to storage.

:func:`read_payload` turns a payload (a slot's, or a persisted
``.safetensors`` file's bytes) back into the state, with tensors that own
their memory (a view into a slot would be overwritten by the next snapshot).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import torch

from trainguard.core import CheckpointError
from trainguard.core.snapshot import Entry, Layout, PersistWorker, Slot, SnapshotDir, State, fetch, payload_header

from .state import flatten, unflatten

__all__ = ["Snapshots", "read_payload"]

log = logging.getLogger("trainguard.torch")

FORMAT = "trainguard-snapshot/1"
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
          torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
BY_NAME = {v: k for k, v in DTYPES.items()}


def _entries(paths: list[str], tensors: list[torch.Tensor]) -> list[Entry]:
    out = []
    for path, t in zip(paths, tensors):
        if t.dtype not in DTYPES:
            raise CheckpointError(f"cannot snapshot {path}: dtype {t.dtype} has no safetensors name")
        out.append(Entry(path, DTYPES[t.dtype], tuple(t.shape), t.numel() * t.element_size(), t.element_size()))
    return out


class Snapshots:
    """One rank's snapshot slots and persist worker.

    Args:
        directory: the job's snapshot directory on this node.
        rank: the global rank whose state this is.
        count: slots kept in memory (2: a crash during a copy still leaves
            the previous snapshot).
        peer: ``host:port`` of the next node's agent, to keep a second copy
            there (None: no copy).
    """

    def __init__(self, directory: SnapshotDir, rank: int, *, count: int = 2, peer: str | None = None) -> None:
        if count < 1:
            raise ValueError("keep at least one snapshot in memory")
        self.directory, self.rank, self.peer = directory, rank, peer
        self.slots = [directory.slot(rank, i) for i in range(count)]
        self.worker = PersistWorker()
        self._layout: Layout | None = None
        self._views: dict[int, list[torch.Tensor]] = {}
        self.held: dict[int, int] = {}  # slot -> step written there by this process
        self.pinned: dict[int, int] = {}  # slot -> request id of a persist not answered yet
        self.taken = self.skipped = 0
        self.persisted: list[dict] = []
        self.errors: list[str] = []

    # ------------------------------------------------------------ snapshot
    def take(self, state: Any, step: int) -> int | None:
        """Copy ``state`` into a free slot as the snapshot of ``step``.

        Returns:
            The slot index, or ``None`` when every slot is busy (being
            persisted), in which case the snapshot is skipped.
        """
        self.poll()
        paths: list[str] = []
        skeleton, tensors = flatten(state, paths)
        meta = json.dumps({"format": FORMAT, "step": step, "names": paths, "skeleton": skeleton})
        key = tuple((p, t.dtype, tuple(t.shape)) for p, t in zip(paths, tensors))
        if self._layout is None or key != self._key or len(meta) * 2 > self._layout.header_bytes:
            self._relayout(paths, tensors, key, len(meta))
        index = self._free_slot()
        if index is None:
            self.skipped += 1
            return None
        slot, layout = self.slots[index], self._layout
        try:
            payload = slot.begin(layout.payload_bytes)
            payload[:layout.data_start] = layout.header(meta)
            views = self._views.get(index)
            if views is None:
                views = self._views[index] = self._make_views(payload)
            with torch.no_grad():
                for view, t in zip(views, tensors):
                    view.copy_(t, non_blocking=t.is_cuda)
            if any(t.is_cuda for t in tensors):
                torch.cuda.synchronize()
            slot.commit(step, layout.payload_bytes)
        finally:
            slot.unlock()
        self.held[index] = step
        self.taken += 1
        self.worker.submit("seal", slot=str(slot.path), step=step, rank=self.rank, peer=self.peer)
        return index

    def _relayout(self, paths, tensors, key, meta_len: int) -> None:
        self._views.clear()  # drop every view of the old mappings before slots are resized
        self._layout = Layout(_entries(paths, tensors), meta_reserve=max(4096, 4 * meta_len))
        self._key = key
        self._order = {p: i for i, p in enumerate(paths)}

    def _make_views(self, payload: memoryview) -> list[torch.Tensor]:
        layout = self._layout
        base = torch.frombuffer(payload, dtype=torch.uint8)
        by_name = {}
        for e in layout.entries:
            b, end = layout.offsets[e.name]
            part = base[layout.data_start + b:layout.data_start + end]
            by_name[e.name] = part.view(BY_NAME[e.dtype]).view(e.shape) if e.nbytes else \
                torch.empty(e.shape, dtype=BY_NAME[e.dtype])
        return [by_name[p] for p in self._order]

    def _free_slot(self) -> int | None:
        """The slot holding the oldest step (or none) that no persist needs
        and no other process is reading; when the worker is sealing the only
        one left, wait for it (a CRC pass, milliseconds)."""
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
        for index, held in self.held.items():
            info = self.slots[index].info()
            if held == step and info is not None and info.step == step and \
                    info.state in (State.COMPLETE, State.SEALED):
                return index
        return None

    # ------------------------------------------------------------ persist
    def persist(self, index: int, step: int, *, root: str, name: str, finalize: dict | None) -> None:
        """Ask the worker to write slot ``index`` (holding ``step``) to storage."""
        rid = self.worker.submit("persist", slot=str(self.slots[index].path), step=step, root=root,
                                 naming="torch", name=name, finalize=finalize)
        self.pinned[index] = rid

    def poll(self, timeout: float | None = None) -> list[dict]:
        replies = self.worker.poll(timeout)
        for r in replies:
            if r["op"] == "persist":
                self.pinned = {i: rid for i, rid in self.pinned.items() if rid != r["id"]}
                if r["ok"]:
                    self.persisted.append({"step": r["step"], "final": r.get("final")})
                else:
                    self.errors.append(f"step {r['step']}: {r['error']}")
                    log.error("rank %d: persisting step %s failed: %s", self.rank, r["step"], r["error"])
            elif not r["ok"]:
                log.warning("rank %d: sealing the snapshot of step %s failed: %s", self.rank, r["step"], r["error"])
        return replies

    def wait(self, timeout: float) -> None:
        """Wait for every persist asked so far."""
        deadline = time.monotonic() + timeout
        while self.pinned and time.monotonic() < deadline:
            self.poll(timeout=0.2)

    def close(self) -> None:
        self.poll()
        self.worker.close()
        self.poll()
        self._views.clear()
        for slot in self.slots:
            slot.close()

    # ------------------------------------------------------------ load
    def available(self) -> dict[int, tuple[Slot, str]]:
        """Verified snapshots of this rank in this node's memory: step ->
        (slot, "memory" or "peer memory"); with a peer and none of its own
        here, the copy fetched from the peer. Bad ones are logged and skipped."""
        found = self._verified(self.directory.candidates(self.rank))
        if self.peer and not any(source == "memory" for _, source in found.values()):
            # A new node in place of a lost one: the copy is on the node this rank pushed to.
            try:
                copy = fetch(self.peer, self.directory, rank=self.rank, token=os.environ.get("TRAINGUARD_TOKEN", ""))
            except CheckpointError as e:
                log.warning("rank %d: no copy from the peer node: %s", self.rank, e)
                copy = None
            if copy is not None:
                copy.close()
                found = self._verified(self.directory.candidates(self.rank))
        return found

    def _verified(self, slots: list[Slot]) -> dict[int, tuple[Slot, str]]:
        found: dict[int, tuple[Slot, str]] = {}
        peer_dir = self.directory.path / "peer"
        for slot in slots:
            source = "peer memory" if slot.path.parent == peer_dir else "memory"
            try:
                if not slot.lock(False):
                    continue
                info = slot.verified()
                found.setdefault(info.step, (slot, source))
            except CheckpointError as e:
                log.warning("rank %d: not using snapshot %s: %s", self.rank, slot.path.name, e)
            finally:
                slot.unlock()
        return found


def read_payload(payload: memoryview | bytes, device: torch.device | str = "cpu") -> tuple[int, Any]:
    """The step and state held in a snapshot payload (tensors copied out).

    Raises:
        CheckpointError: the payload is malformed or not a trainguard snapshot.
    """
    table, meta, start = payload_header(payload)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"not a {FORMAT} payload")
    base = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
    tensors = []
    try:
        for name in meta["names"]:
            e = table[name]
            b, end = e["data_offsets"]
            dtype = BY_NAME[e["dtype"]]
            t = base[start + b:start + end].clone().view(dtype).view(e["shape"]) if end > b else \
                torch.empty(e["shape"], dtype=dtype)
            tensors.append(t.to(device))
        return int(meta["step"]), unflatten(meta["skeleton"], tensors)
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"snapshot payload does not match its header ({e})") from None
