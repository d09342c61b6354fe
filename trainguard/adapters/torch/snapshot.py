"""Torch state in and out of snapshot slots.

:class:`Snapshots` copies a state (a ``state_dict``-like nest of tensors and
scalars) into a free slot of shared memory: the structure is flattened once
per layout, every tensor gets a typed view into the slot at its offset, and a
snapshot is then one ``copy_`` per tensor plus a small JSON header -- no
pickling, no allocation. When the state is on a GPU, each slot's pages are
registered with CUDA (``cudaHostRegister``) the first time it is filled, so
the device-to-host copies run at pinned-memory speed; they are unregistered
before the slot is remapped or closed. A device-to-host copy costs several
microseconds however small, so small tensors are not copied one by one:
each run of them that sits back to back in the slot is first gathered on the
device into a staging buffer of the same byte layout (one ``_foreach_copy_``
per dtype), then leaves in one copy (:class:`_Staging`). The persist worker
(started here) seals each snapshot and writes the ones asked for to storage.

``take(..., background=True)`` copies host (CPU) state on the ring's thread
(by ``memmove``, see :func:`_copy`) and returns at once: the caller must not change the state before
:meth:`~trainguard.core.snapshot.ring.SnapshotRing.settle` (the Guard
settles before the next optimizer update, so the copy runs beside the next
forward and backward). Device state is copied in line.

:func:`read_payload` turns a payload (a slot's, or a persisted
``.safetensors`` file's bytes) back into the state, with tensors that own
their memory (a view into a slot would be overwritten by the next snapshot);
:func:`read_payload_into` fills the tensors a restarted process already has
instead, once the payload passed its checksum (:func:`filled`).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from trainguard.core import CheckpointError
from trainguard.core.snapshot import Entry, SnapshotDir, payload_header
from trainguard.core.snapshot.ring import FORMAT, SnapshotRing

from .state import flatten, unflatten

__all__ = ["Snapshots", "destinations", "filled", "read_payload", "read_payload_into", "staging_bytes"]

log = logging.getLogger("trainguard.torch")

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
          torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
BY_NAME = {v: k for k, v in DTYPES.items()}


def staging_bytes() -> int:
    """The device staging buffer: ``TRAINGUARD_SNAPSHOT_STAGING_MB`` (default
    0: every tensor is copied to the host on its own; on an H100 a 64 MiB
    buffer measured no faster, see bench/results/checkpoint-gpu.json)."""
    mb = os.environ.get("TRAINGUARD_SNAPSHOT_STAGING_MB", "0")
    try:
        value = int(mb)
    except ValueError:
        raise CheckpointError(f"TRAINGUARD_SNAPSHOT_STAGING_MB={mb!r} is not a whole number of MiB") from None
    if value < 0:
        raise CheckpointError(f"TRAINGUARD_SNAPSHOT_STAGING_MB={value} is negative")
    return value << 20


@dataclass
class _Run:
    """Tensors back to back in the slot, gathered in the staging buffer."""
    device: torch.device
    start: int  # byte offset in the slot's data
    end: int
    groups: dict = field(default_factory=lambda: defaultdict(lambda: ([], [])))  # dtype -> (indices, staging views)
    staged: torch.Tensor | None = None  # the staging buffer's bytes of this run


class _Staging:
    """How one layout's device tensors travel to the host: runs of small
    tensors through a staging buffer of ``size`` bytes (one gather on the
    device, one device-to-host copy each), larger tensors straight into the
    slot, host tensors by a host copy."""

    def __init__(self, layout, paths: list[str], tensors: list[torch.Tensor], size: int, stage) -> None:
        self.key = (id(layout), size, tuple(t.device for t in tensors))
        self.runs: list[_Run] = []
        self.direct: list[int] = []
        self.host: list[int] = []
        self.buffers: dict[torch.device, torch.Tensor] = {}
        order = sorted(range(len(paths)), key=lambda i: layout.offsets[paths[i]][0])
        run = None
        for i in order:
            t, (b, e) = tensors[i], layout.offsets[paths[i]]
            if e == b or not stage(t):  # empty (its view is a tensor of its own), or on the host
                self.host.append(i)
                if run is not None and run.end == b and e - run.start <= size:
                    run.end = e  # rides along (an optimizer's step counters sit between its moments):
                    # the run lands garbage there, which the host copy after the synchronize replaces
            elif e - b > size:
                self.direct.append(i)
                run = None
            else:
                if run is None or run.end != b or e - run.start > size or run.device != t.device:
                    run = _Run(t.device, b, b)
                    self.runs.append(run)
                run.end = e
                run.groups[t.dtype][0].append(i)
        for run in self.runs:
            buf = self.buffers.get(run.device)
            if buf is None:
                buf = self.buffers[run.device] = torch.empty(size, dtype=torch.uint8, device=run.device)
            for dtype, (indices, views) in run.groups.items():
                for i in indices:
                    b, e = layout.offsets[paths[i]]
                    views.append(buf[b - run.start:e - run.start].view(dtype).view(tensors[i].shape))
            run.staged = buf[:run.end - run.start]

    def copy_device(self, base: torch.Tensor, data_start: int, views: list[torch.Tensor],
                    tensors: list[torch.Tensor]) -> None:
        """Start the device tensors' copies into the slot (``base``, its views
        ``views``); synchronize before :meth:`copy_host` and before reading."""
        for run in self.runs:  # in stream order: a run's gather waits for the previous run to leave the buffer
            for indices, staged in run.groups.values():
                torch._foreach_copy_(staged, [tensors[i] for i in indices])
            base[data_start + run.start:data_start + run.end].copy_(run.staged, non_blocking=True)
        if self.direct:
            torch._foreach_copy_([views[i] for i in self.direct], [tensors[i] for i in self.direct],
                                 non_blocking=True)

    def copy_host(self, views: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
        """The host tensors' copies (after the device copies have landed)."""
        if self.host:
            torch._foreach_copy_([views[i] for i in self.host], [tensors[i] for i in self.host])


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
                 naming: str = "torch") -> None:
        super().__init__(directory, rank, count=count, peer=peer, naming=naming)
        self._views: dict[int, list[torch.Tensor]] = {}
        self._cached: list[Entry] = []
        self._sig: list = []
        self._paths: list[str] = []
        self._pinned: dict[int, int] = {}  # slot index -> address registered with CUDA
        self.pins, self.pin_failed = 0, ""  # slot registrations; why pinning failed
        self.staging_bytes = staging_bytes()
        self._staging: _Staging | None = None
        self._stage = lambda t: t.is_cuda  # which tensors go through the staging buffer

    def forget_views(self) -> None:
        self._views.clear()
        self._staging = None
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
                "staged_copies": len(staged.runs) if staged else 0, "direct_copies": len(staged.direct) if staged else 0}

    def take(self, state: Any, step: int, *, background: bool = False, meta: dict | None = None) -> int | None:
        """Copy ``state`` (a nest of tensors and scalars) into a free slot as
        the snapshot of ``step``; the slot index, or ``None`` when skipped.
        With ``background``, host tensors are copied on a thread while the
        caller goes on (see the module docstring); ``meta``: more JSON for
        the payload header."""
        paths: list[str] = []
        skeleton, tensors = flatten(state, paths)

        def fill(index: int, payload: memoryview, layout):
            cuda = any(t.is_cuda for t in tensors)
            if cuda:
                self._pin(index, payload)
            views = self._views.get(index)
            if views is None:
                views = self._views[index] = self._make_views(payload, layout, paths)
            if background and not cuda:
                return lambda: _copy(views, tensors)
            staging = None
            with torch.no_grad():
                if self.staging_bytes and any(self._stage(t) for t in tensors):
                    staging = self._staging
                    if staging is None or staging.key != (id(layout), self.staging_bytes,
                                                          tuple(t.device for t in tensors)):
                        staging = self._staging = _Staging(layout, paths, tensors, self.staging_bytes, self._stage)
                    staging.copy_device(torch.frombuffer(payload, dtype=torch.uint8), layout.data_start, views,
                                        tensors)
                else:  # one call: a Python-level copy_ per tensor costs more than a small tensor's bytes
                    torch._foreach_copy_(views, tensors, non_blocking=cuda)
                if cuda:
                    torch.cuda.synchronize()
                if staging is not None:
                    staging.copy_host(views, tensors)

        sig = [(t.dtype, t.shape) for t in tensors]
        if sig != self._sig or paths != self._paths:  # entries only when the structure changed
            self._cached, self._sig, self._paths = _entries(paths, tensors), sig, paths
        return self.write(step, self._cached, {"names": paths, "skeleton": skeleton, **(meta or {})}, fill)

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


def read_payload(payload: memoryview | bytes, device: torch.device | str = "cpu") -> tuple[int, Any]:
    """The step and state held in a snapshot payload (tensors copied out).

    Raises:
        CheckpointError: the payload is malformed or not a trainguard snapshot.
    """
    step, state, _ = read_payload_into(payload, device, {})
    return step, state


def read_payload_into(payload: memoryview | bytes, device: torch.device | str,
                      into: dict[str, torch.Tensor]) -> tuple[int, Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Like :func:`read_payload`, where ``into`` (path -> tensor, see
    :func:`destinations`) names tensors that already hold a place for a
    payload tensor (a restarted model's parameters): the state holds those
    tensors, still unchanged, and the returned copies (destination, view
    into the payload) fill them -- the caller runs :func:`filled` once the
    payload passed its checksum, before the payload is unmapped. A
    destination of another dtype, shape or device is left alone.

    A restart then allocates and touches fresh memory only for what has no
    place yet (an optimizer's moments), and copies the rest once.

    Raises:
        CheckpointError: the payload is malformed or not a trainguard snapshot.
    """
    table, meta, start = payload_header(payload)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"not a {FORMAT} payload")
    base = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
    device = torch.device(device)
    tensors, later = [], []
    try:
        for name in meta["names"]:
            e = table[name]
            b, end = e["data_offsets"]
            dtype, shape = BY_NAME[e["dtype"]], e["shape"]
            view = base[start + b:start + end].view(dtype).view(shape) if end > b else None
            dst = into.get(name)
            if dst is not None and dst.dtype == dtype and list(dst.shape) == shape and _on(dst, device):
                tensors.append(dst)
                if view is not None:
                    later.append((dst, view))
            elif view is None:
                tensors.append(torch.empty(shape, dtype=dtype, device=device))
            else:  # straight to the device: no host copy on the way
                tensors.append(view.clone() if device.type == "cpu" else view.to(device))
        return int(meta["step"]), unflatten(meta["skeleton"], tensors), later
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"snapshot payload does not match its header ({e})") from None


def _on(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def destinations(state: Any) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` by path, as a snapshot of the same structure names them."""
    paths: list[str] = []
    tensors = flatten(state, paths)[1]
    return dict(zip(paths, tensors))


def filled(read: tuple[int, Any, list[tuple[torch.Tensor, torch.Tensor]]]) -> tuple[int, Any]:
    """``(step, state)`` of what :func:`read_payload_into` returned, once the
    copies it left have run."""
    step, state, copies = read
    with torch.no_grad():
        for dst, src in copies:
            dst.copy_(src)
    return step, state
