"""Torch state in and out of snapshot slots.

:class:`Snapshots` copies a state (a ``state_dict``-like nest of tensors and
scalars) into a free slot of shared memory: the structure is flattened once
per layout, every tensor gets a typed view into the slot at its offset, and a
snapshot is then one ``copy_`` per tensor plus a small JSON header -- no
pickling, no allocation. When the state is on a GPU, each slot's pages are
registered with CUDA (``cudaHostRegister``) the first time it is filled, so
the device-to-host copies run at pinned-memory speed; they are unregistered
before the slot is remapped or closed. Through a staging
buffer (:class:`~.staging.Staging`, 64 MiB a device by default) runs of
small device tensors leave gathered. The persist worker (started here) seals each snapshot and
writes the ones asked for to storage.

``take(..., background=True)`` copies host (CPU) state on the ring's thread
(by ``memmove``, see :func:`_copy`) and returns at once: the caller must not change the state before
:meth:`~trainguard.core.snapshot.ring.SnapshotRing.settle` (the Guard
settles before the next optimizer update, so the copy runs beside the next
forward and backward). Device state leaves on a side stream of its own
instead, queued behind the work that wrote it, and the ring's thread waits
for it there; the next forward and backward run on their stream meanwhile.
In line, the device copies are started before the host work a snapshot
also needs (a check of the layout, the metadata), which runs while they
are in flight. Once a layout has been taken, the next take starts the device
copies *before* it walks the state (:class:`_Ahead`): it copies the tensors
the last take found, then walks the state and checks that each path still
holds the same memory -- a tensor whose memory moved is copied again behind
the rest, a changed structure (a new path, dtype or shape) is walked and
copied afresh. The walk (a millisecond for a ResNet's 800 tensors) then
overlaps the copies instead of preceding them.

:func:`read_payload` turns a payload (a slot's, or a persisted
``.safetensors`` file's bytes) back into the state, and
:func:`read_payload_into` fills the tensors a restarted process already has
(:mod:`.payload`, the reading side).
"""

from __future__ import annotations

import ctypes
import logging
import os
from contextlib import nullcontext
from typing import Any

import torch

from trainguard.core import CheckpointError
from trainguard.core.snapshot import Entry, SnapshotDir
from trainguard.core.snapshot.ring import SnapshotRing

from .payload import BY_NAME, DTYPES, destinations, filled, on_device, read_payload, read_payload_into
from .staging import Staging
from .state import flatten

__all__ = ["Snapshots", "destinations", "filled", "on_device", "read_payload", "read_payload_into", "staging_bytes"]

log = logging.getLogger("trainguard.torch")


def staging_bytes() -> int:
    """The device staging buffer: ``TRAINGUARD_SNAPSHOT_STAGING_MB`` (default
    64, on each GPU that holds state; 0: every tensor is copied to the host
    on its own, which on an H100 took ResNet-50's snapshot from 78% of a
    flat pinned copy's speed to 64%, see bench/results/checkpoint-gpu.json)."""
    mb = os.environ.get("TRAINGUARD_SNAPSHOT_STAGING_MB", "64")
    try:
        value = int(mb)
    except ValueError:
        raise CheckpointError(f"TRAINGUARD_SNAPSHOT_STAGING_MB={mb!r} is not a whole number of MiB") from None
    if value < 0:
        raise CheckpointError(f"TRAINGUARD_SNAPSHOT_STAGING_MB={value} is negative")
    return value << 20


def _entries(paths: list[str], tensors: list[torch.Tensor]) -> list[Entry]:
    out = []
    for path, t in zip(paths, tensors):
        if t.dtype not in DTYPES:
            raise CheckpointError(f"cannot snapshot {path}: dtype {t.dtype} has no safetensors name")
        out.append(Entry(path, DTYPES[t.dtype], tuple(t.shape), t.numel() * t.element_size(), t.element_size()))
    return out


class Snapshots(SnapshotRing):
    """One rank's snapshots of torch state (see :class:`SnapshotRing` for
    the arguments)."""

    def __init__(self, directory: SnapshotDir, rank: int, *, count: int = 2, peer: str | None = None,
                 naming: str = "torch", token: str = "") -> None:
        super().__init__(directory, rank, count=count, peer=peer, naming=naming, token=token)
        self._views: dict[int, list[torch.Tensor]] = {}
        self._cached: list[Entry] = []
        self._sig: list = []
        self._paths: list[str] = []
        self._pinned: dict[int, int] = {}  # slot index -> address registered with CUDA
        self.pins, self.pin_failed = 0, ""  # slot registrations; why pinning failed
        self.staging_bytes = staging_bytes()
        self._staging: Staging | None = None
        self._stage = lambda t: t.is_cuda  # which tensors go through the staging buffer
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # background device copies leave on these
        self._ahead: _Ahead | None = None  # the last device take's tensors: the next one's copies start from them
        self.copy_ahead = True  # off: every take walks the state before its first copy (the bench compares both)
        self.staging_overlap = True  # off: the staging buffer's gathers wait for the copies out (ditto)
        self.ahead_hits = self.ahead_late = 0  # takes started ahead of the walk; tensors copied again behind

    def forget_views(self) -> None:
        self._views.clear()
        self._staging = None
        self._ahead = None
        for address in self._pinned.values():
            torch.cuda.cudart().cudaHostUnregister(address)
        self._pinned.clear()

    def _pin(self, index: int, payload: memoryview) -> None:
        """Page-lock slot ``index`` for device-to-host copies (once per mapping)."""
        if index in self._pinned or self.pin_failed or not len(payload):
            return
        address = torch.frombuffer(payload, dtype=torch.uint8).data_ptr()
        rc = torch.cuda.cudart().cudaHostRegister(address, len(payload), 0)
        if int(rc) != 0:
            self.pin_failed = str(rc)
            log.warning("rank %d: cannot pin snapshot slot memory (%s): device-to-host copies stay pageable",
                        self.rank, rc)
            return
        self._pinned[index] = address
        self.pins += 1

    def report(self, resumed_from: dict | None) -> dict:
        staged = self._staging
        return {**super().report(resumed_from), "pinned": self.pins, "pin_failed": self.pin_failed,
                "staging_MB": self.staging_bytes >> 20,
                "staged_copies": len(staged.runs) if staged else 0,
                "direct_copies": len(staged.direct) if staged else 0,
                "copied_ahead": self.ahead_hits, "copied_behind": self.ahead_late}

    def take(self, state: Any, step: int, *, background: bool = False, meta: dict | None = None) -> int | None:
        """Copy ``state`` (a nest of tensors and scalars) into a free slot as
        the snapshot of ``step``; the slot index, or ``None`` when skipped.
        With ``background`` the copy goes on while the caller does (see the
        module docstring: settle before changing the state); ``meta``: more
        JSON for the payload header."""
        if self._ahead is not None and self.copy_ahead:
            try:
                return self._take_ahead(state, step, background, meta)
            except _Restructured:  # its copies have landed: walked and copied afresh below
                self._ahead = None
        paths: list[str] = []
        skeleton, tensors = flatten(state, paths)
        cuda = any(t.is_cuda for t in tensors)
        side = self._side_stream(tensors) if cuda and background else None
        background = background and (side is not None or not cuda)
        known = paths == self._paths  # then the entries stand unless a tensor changed (checked below)
        if not known:
            self._cached, self._sig, self._paths = _entries(paths, tensors), _sig(tensors), paths

        def changed() -> bool:
            if not known:
                return False
            sig = _sig(tensors)
            if sig == self._sig:
                return False
            self._cached, self._sig = _entries(paths, tensors), sig
            return True

        def fill(index: int, payload: memoryview, layout):
            if cuda:
                self._pin(index, payload)
            views = self._views.get(index)
            if views is None:
                views = self._views[index] = self._make_views(payload, layout, paths)
            if not cuda and changed():
                raise _Restructured
            if background and not cuda:
                return lambda: _copy(views, tensors)
            try:
                with torch.cuda.stream(side) if side is not None else nullcontext():
                    staging = self._copy_out(payload, layout, paths, views, tensors, cuda)
                    sent = side.record_event() if side is not None else None
            except RuntimeError:  # a tensor that no longer fits its view
                if cuda:
                    torch.cuda.synchronize()
                if changed():
                    raise _Restructured from None
                raise

            def landed() -> None:
                if sent is not None:
                    sent.synchronize()  # the GIL released meanwhile
                elif cuda:
                    torch.cuda.synchronize()
                if staging is not None:
                    with torch.no_grad():
                        staging.copy_host(views, tensors)
            if not cuda:
                return landed()
            if changed():  # copied into the old layout: let it land, then again in a new one
                landed()
                raise _Restructured
            self._ahead = _Ahead.of(tensors)
            return landed

        for _ in range(2):
            try:
                return self.write(step, self._cached, {"names": paths, "skeleton": skeleton, **(meta or {})}, fill,
                                  background=background)
            except _Restructured:  # out of this block before the retry: its traceback holds views into the slot
                pass
        raise CheckpointError(f"the state of step {step} kept changing its tensors while it was snapshot")

    def _take_ahead(self, state: Any, step: int, background: bool, meta: dict | None) -> int | None:
        """:meth:`take` with the device copies started from the last take's
        tensors before ``state`` is walked (see the module docstring).

        Raises:
            _Restructured: the walk found another structure; the copies
                started have landed (the slot may be laid out anew).
        """
        ahead, paths = self._ahead, self._paths
        side = self._side_stream(ahead.tensors) if background else None
        if background and side is None:
            raise _Restructured
        header = {**(meta or {})}  # the walk's names and skeleton join it before the ring encodes it

        def fill(index: int, payload: memoryview, layout):
            self._pin(index, payload)
            views = self._views.get(index)
            if views is None:
                views = self._views[index] = self._make_views(payload, layout, paths)
            with torch.no_grad(), torch.cuda.stream(side) if side is not None else nullcontext():
                staging = self._copy_device(payload, layout, paths, views, ahead)
            found: list[str] = []
            try:
                skeleton, tensors = flatten(state, found)
                behind = ahead.moved(found, paths, tensors, self._sig)
                if behind is None:  # another structure
                    raise _Restructured
            except BaseException:  # the copies land before the slot can be laid out anew, or unregistered
                side.synchronize() if side is not None else torch.cuda.synchronize()
                raise
            header.update(names=found, skeleton=skeleton)
            with torch.no_grad(), torch.cuda.stream(side) if side is not None else nullcontext():
                if behind:  # memory that moved since the last take: again, behind the copies of its old place
                    torch._foreach_copy_([views[i] for i in behind], [tensors[i] for i in behind],
                                         non_blocking=True)
                sent = side.record_event() if side is not None else None
            self._ahead = _Ahead.of(tensors)
            self.ahead_hits += 1
            self.ahead_late += len(behind)

            def landed() -> None:
                if sent is not None:
                    sent.synchronize()
                else:
                    torch.cuda.synchronize()
                with torch.no_grad():  # host tensors from this walk (a staging run may have landed over them)
                    if staging is not None:
                        staging.copy_host(views, tensors)
                    elif ahead.host:
                        torch._foreach_copy_([views[i] for i in ahead.host], [tensors[i] for i in ahead.host])
            return landed

        return self.write(step, self._cached, header, fill, background=background)

    def _copy_device(self, payload: memoryview, layout, paths: list[str], views: list[torch.Tensor],
                     ahead: "_Ahead") -> Staging | None:
        """Start the device copies of ``ahead``'s tensors (host tensors are
        left to the caller); the staging plan when they went through it."""
        tensors = ahead.tensors
        if self.staging_bytes:
            staging = self._plan(layout, paths, tensors)
            staging.copy_device(torch.frombuffer(payload, dtype=torch.uint8), layout.data_start, views, tensors)
            return staging
        torch._foreach_copy_([views[i] for i in ahead.device], [tensors[i] for i in ahead.device],
                             non_blocking=True)
        return None

    def _plan(self, layout, paths: list[str], tensors: list[torch.Tensor]) -> Staging:
        """The staging plan of this layout and these tensors' devices (made once, then reused)."""
        key = (id(layout), self.staging_bytes, tuple(t.device for t in tensors), self.staging_overlap)
        if self._staging is None or self._staging.key != key:
            self._staging = Staging(layout, paths, tensors, self.staging_bytes, self._stage,
                                    overlap=self.staging_overlap)
        return self._staging

    def _side_stream(self, tensors: list[torch.Tensor]) -> torch.cuda.Stream | None:
        """The stream a background copy of ``tensors`` leaves the device on,
        after the work queued so far (the update that wrote them); ``None``
        when they sit on more than one device (copied in line then)."""
        devices = {t.device for t in tensors if t.is_cuda}
        if len(devices) != 1:
            return None
        (device,) = devices
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        return side

    def _copy_out(self, payload: memoryview, layout, paths: list[str], views: list[torch.Tensor],
                  tensors: list[torch.Tensor], cuda: bool) -> Staging | None:
        """Copy (on a GPU: start copying) ``tensors`` into their ``views``;
        the staging plan when device tensors went through it."""
        with torch.no_grad():
            if self.staging_bytes and any(self._stage(t) for t in tensors):
                staging = self._plan(layout, paths, tensors)
                staging.copy_device(torch.frombuffer(payload, dtype=torch.uint8), layout.data_start, views, tensors)
                return staging
            # one call: a Python-level copy_ per tensor costs more than a small tensor's bytes
            torch._foreach_copy_(views, tensors, non_blocking=cuda)
            return None

    @staticmethod
    def _make_views(payload: memoryview, layout, paths: list[str]) -> list[torch.Tensor]:
        base = torch.frombuffer(payload, dtype=torch.uint8)
        by_name = {}
        for e in layout.entries:
            b, end = layout.offsets[e.name]
            part = base[layout.data_start + b:layout.data_start + end]
            by_name[e.name] = part.view(BY_NAME[e.dtype]).view(e.shape) if e.nbytes else \
                torch.empty(e.shape, dtype=BY_NAME[e.dtype])
        return [by_name[p] for p in paths]


class _Ahead:
    """The tensors a device take copied, kept (with their memory) until the
    next take, which starts copying them before it walks the state: the
    walk then confirms each path still holds the same memory (a state dict's
    tensors are new objects at every call, their memory is not)."""

    def __init__(self, tensors: list[torch.Tensor], device: list[int], host: list[int]) -> None:
        self.tensors, self.device, self.host = tensors, device, host
        self.places = [_place(tensors[i]) for i in device]

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> "_Ahead | None":
        """The record of a take of ``tensors``; ``None`` unless every device
        tensor sits on one device."""
        device = [i for i, t in enumerate(tensors) if t.is_cuda]
        if len({tensors[i].device for i in device}) != 1:
            return None
        return cls(tensors, device, [i for i, t in enumerate(tensors) if not t.is_cuda])

    def moved(self, paths: list[str], known: list[str], tensors: list[torch.Tensor], sig: list) -> list[int] | None:
        """The device tensors of this walk whose memory is not where the last
        take found it; ``None`` when the structure changed (other paths,
        dtypes, shapes, or a tensor that changed device)."""
        if paths != known or len(tensors) != len(self.tensors) or _sig(tensors) != sig:
            return None
        if any(tensors[i].is_cuda for i in self.host):
            return None
        behind = []
        for i, place in zip(self.device, self.places):
            t = tensors[i]
            if t.device != self.tensors[i].device:
                return None
            if _place(t) != place:
                behind.append(i)
        return behind


def _place(t: torch.Tensor) -> tuple:
    """Where a tensor's bytes are: two tensors alike here read the same memory."""
    return t.data_ptr(), t.stride(), t.device


class _Restructured(Exception):
    """A tensor changed its dtype or shape under the same path: the snapshot
    needs a new layout."""


def _sig(tensors: list[torch.Tensor]) -> list[tuple]:
    return [(t.dtype, t.shape) for t in tensors]


def _copy(views: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
    """The background copy, on the ring's thread: contiguous tensors by
    ``memmove`` (one core, the GIL released). Not torch's own copy: its
    OpenMP team on a second thread leaves the training thread's parallel
    regions to sleep and wake at every barrier for the rest of the process
    (with 2 intra-op threads a ResNet-50 CPU step took 1.1 s before the
    first such copy, 1.6 s after)."""
    rest = []
    for view, t in zip(views, tensors):
        if t.is_contiguous() and t.dtype == view.dtype and t.device.type == "cpu":
            if view.nbytes:
                ctypes.memmove(view.data_ptr(), t.data_ptr(), view.nbytes)
        else:
            rest.append((view, t))
    if rest:  # strided or on another device: torch's copy
        with torch.no_grad():  # grad mode is per thread
            torch._foreach_copy_([v for v, _ in rest], [t for _, t in rest])
