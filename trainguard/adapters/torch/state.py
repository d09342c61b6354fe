"""Training state as trainguard handles it: gathered, flattened, shipped, hashed.

A state is a nested structure of dicts, lists, tuples, tensors and JSON
scalars (what ``state_dict()`` methods return). :func:`flatten` splits it
into a JSON *skeleton* and a list of tensors, so it can cross a process group
without pickling and be hashed canonically (:func:`state_sha256`).
:func:`send_state` / :func:`recv_state` move it between two ranks: a
header, then each large tensor straight from (and, on the receiver, straight
into) the memory it lives in -- recoveries must not wait on hundreds of
megabytes of fresh allocations -- and the small ones packed a megabyte at a
time, and the receiver verifies the XXH3 checksum the sender computed (a
transfer between live ranks needs to catch accidental corruption, not
forgery; checkpoints on disk use SHA-256).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import torch
import xxhash

from trainguard.core import RecoveryError

__all__ = ["fingerprint", "flatten", "recv_state", "send_state", "state_sha256", "unflatten"]

_SCALARS = (int, float, str, bool, type(None))


def flatten(obj: Any, paths: list[str] | None = None, *, strict: bool = True) -> tuple[Any, list[torch.Tensor]]:
    """Split ``obj`` into a JSON-able skeleton and its tensors (and, when
    ``paths`` is given, append where each tensor sits). Not ``strict``, a
    value that is neither a container, a tensor nor a JSON scalar, and a
    dict with other keys than str and int, stand as ``None`` in the skeleton.

    A snapshot flattens the whole state at every take (on a GPU before the
    first byte can leave the device), so the walk dispatches on each value's
    class once (:func:`_kind`) and handles a dict's tensors and scalars
    without a call each.

    Raises:
        TypeError: ``strict``, for a value that is neither a container, a
            tensor nor a JSON scalar (naming where it sits).
    """
    tensors: list[torch.Tensor] = []
    keep = tensors.append
    where = paths.append if paths is not None else None

    def walk(x: Any, path: str) -> Any:
        kind = _KINDS.get(type(x)) or _kind(x)
        if kind == "T":
            keep(x)
            if where is not None:
                where(path)
            return {"T": len(tensors) - 1}
        if kind == "s":
            return x
        if kind == "d":
            out = []
            for k, v in x.items():
                if type(k) is not str and type(k) is not int and not isinstance(k, (str, int)):
                    if not strict:
                        return None
                    raise TypeError(f"state key {k!r} at {path or '<root>'} is not a str or int")
                vkind = _KINDS.get(type(v))
                if vkind == "T":
                    keep(v)
                    if where is not None:
                        where(f"{path}.{k}")
                    out.append([k, {"T": len(tensors) - 1}])
                elif vkind == "s":
                    out.append([k, v])
                else:
                    out.append([k, walk(v, f"{path}.{k}")])
            return {"d": out}
        if kind == "t":
            return {"t": [walk(v, f"{path}[{i}]") for i, v in enumerate(x)]}
        if kind == "l":
            return {"l": [walk(v, f"{path}[{i}]") for i, v in enumerate(x)]}
        if not strict:
            return None
        raise TypeError(f"cannot carry a {type(x).__name__} at {path or '<root>'} in training state")

    try:
        return walk(obj, ""), tensors
    finally:  # walk refers to itself: without this, the cycle keeps the state's tensors until a collection
        walk = None  # noqa: F841


#: What :func:`flatten` makes of a value, by its class: a tensor, a JSON
#: scalar, a dict, a tuple, a list, or ``""`` (none of these).
_KINDS: dict[type, str] = {}


def _kind(x: Any) -> str:
    """The kind of ``x``'s class, learned once per class (a tensor subclass
    is a tensor, a float or str subclass a scalar, an OrderedDict a dict)."""
    kind = ("T" if isinstance(x, torch.Tensor) else "s" if isinstance(x, _SCALARS) else
            "d" if isinstance(x, dict) else "t" if isinstance(x, tuple) else "l" if isinstance(x, list) else "")
    _KINDS[type(x)] = kind
    return kind


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of :func:`flatten`."""
    if isinstance(skeleton, dict):
        if "T" in skeleton:
            return tensors[skeleton["T"]]
        if "d" in skeleton:
            return {k: unflatten(v, tensors) for k, v in skeleton["d"]}
        if "t" in skeleton:
            return tuple(unflatten(v, tensors) for v in skeleton["t"])
        if "l" in skeleton:
            return [unflatten(v, tensors) for v in skeleton["l"]]
        raise RecoveryError(f"malformed state skeleton node {sorted(skeleton)}")
    return skeleton


def _raw(t: torch.Tensor):
    """The tensor's bytes as a buffer hashlib can read without a copy (CPU);
    a DTensor's are its local shard's."""
    t = getattr(t, "_local_tensor", t).detach().contiguous().cpu().reshape(-1)
    return t.view(torch.uint8).numpy() if t.numel() else b""


def state_sha256(obj: Any) -> str:
    """A canonical SHA-256 of a state: structure, dtypes, shapes and bytes."""
    skeleton, tensors = flatten(obj)
    h = hashlib.sha256(json.dumps(skeleton, sort_keys=True).encode())
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(_raw(t))
    return h.hexdigest()


def fingerprint(obj: Any) -> str:
    """A fast canonical fingerprint of a state (XXH3-64, hex): structure,
    dtypes, shapes and bytes -- for comparing runs, not for integrity."""
    skeleton, tensors = flatten(obj, strict=False)
    h = xxhash.xxh3_64(json.dumps(skeleton, sort_keys=True).encode())
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(_raw(t))
    return h.hexdigest()


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise RecoveryError(f"unknown dtype {name!r} in a state header")
    return dtype


def _send_bytes(group: Any, data: bytes, dst: int, tag: int, device: torch.device) -> None:
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    group.send([torch.tensor([raw.numel()], dtype=torch.int64, device=device)], dst, tag).wait()
    group.send([raw], dst, tag + 1).wait()


def _recv_bytes(group: Any, src: int, tag: int, device: torch.device) -> bytes:
    length = torch.zeros(1, dtype=torch.int64, device=device)
    group.recv([length], src, tag).wait()
    raw = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    group.recv([raw], src, tag + 1).wait()
    return raw.cpu().numpy().tobytes()


# Tags: 0-1 header, 2-3 checksums, then one per tensor.
_DATA_TAG = 4


def send_state(group: Any, obj: Any, dst: int, *, device: torch.device) -> None:
    """Send ``obj`` to ``dst`` over ``group`` (point to point): a header
    (structure, where each tensor sits, dtypes, shapes), the tensors, then
    the running XXH3 checksum over all of them. A tensor of
    :data:`BUCKET_BYTES` or more goes as it lies in memory (nothing is packed
    into a new buffer); runs of smaller ones (an optimizer's per-parameter
    steps and biases: most of a state's tensors, little of its bytes) go
    packed into one message each, so a state of hundreds of tensors costs a
    few dozen messages. Sends are posted ahead (up to
    :data:`IN_FLIGHT_BYTES`), so the checksum and the next pieces overlap the
    wire instead of one round trip per piece."""
    paths: list[str] = []
    skeleton, tensors = flatten(obj, paths)
    metas = [{"path": p, "dtype": str(t.dtype), "shape": list(t.shape), "device": t.device.type}
             for p, t in zip(paths, tensors)]
    _send_bytes(group, json.dumps({"skeleton": skeleton, "tensors": metas}).encode(), dst, 0, device)
    digest = xxhash.xxh3_64()
    with _Window() as window:
        for tag, piece in enumerate(_pieces([t.numel() * t.element_size() for t in tensors]), _DATA_TAG):
            parts = [tensors[i].detach().contiguous() for i in piece]
            if len(parts) == 1:
                wire = parts[0].to(device)
            else:
                wire = torch.cat([_bytes_of(t).to(device) for t in parts])
            window.post(group.send([wire], dst, tag), wire)
            for t in parts:
                digest.update(_raw(t))
    _send_bytes(group, json.dumps({"xxh3": digest.intdigest()}).encode(), dst, 2, device)


def recv_state(group: Any, src: int, *, device: torch.device, into: Any = None) -> Any:
    """Receive a state sent by :func:`send_state`.

    Args:
        into: this rank's own state of the same structure, when it has one:
            each tensor at the same place with the same dtype and shape is
            received in place (a tensor sent alone lands in it directly, a
            packed one is copied there; no new memory either way); the rest
            is allocated on the device type the sender's sat on.

    Raises:
        RecoveryError: the header is malformed or the data fails its checksum
            (tensors received in place then hold garbage: the caller must not
            use this rank's state).
    """
    try:
        header = json.loads(_recv_bytes(group, src, 0, device))
        skeleton, metas = header["skeleton"], header["tensors"]
        kinds = [(_dtype(m["dtype"]), tuple(m["shape"]), m["device"] != "cpu") for m in metas]
        sizes = [math.prod(shape) * dtype.itemsize for dtype, shape, _ in kinds]
    except (ValueError, KeyError, TypeError) as e:
        raise RecoveryError(f"malformed state header from rank {src}: {e}") from None
    mine: dict[str, torch.Tensor] = {}
    if into is not None:
        my_paths: list[str] = []
        _, my_tensors = flatten(into, my_paths)
        mine = dict(zip(my_paths, my_tensors))
    tensors = []
    for m, (dtype, shape, on_device) in zip(metas, kinds):
        target = mine.get(m["path"])
        home = device.type if on_device else "cpu"
        if (target is None or target.dtype != dtype or tuple(target.shape) != shape
                or not target.is_contiguous() or target.device.type != home):
            target = torch.empty(shape, dtype=dtype, device=device if on_device else "cpu")
        tensors.append(target)
    digest = xxhash.xxh3_64()

    def landed(landing: torch.Tensor, piece: list[int]) -> None:
        at = 0
        for i in piece:
            target = tensors[i]
            if len(piece) > 1:
                _bytes_of(target).copy_(landing[at:at + sizes[i]])
            elif landing is not target:  # received on the device, kept where the sender's was
                target.copy_(landing)
            at += sizes[i]
            digest.update(_raw(target))

    with _Window() as window:  # received in order: the checksum runs while later pieces arrive
        for tag, piece in enumerate(_pieces(sizes), _DATA_TAG):
            target = tensors[piece[0]]
            if len(piece) > 1:
                landing = torch.empty(sum(sizes[i] for i in piece), dtype=torch.uint8, device=device)
            elif target.device == device:
                landing = target
            else:
                landing = torch.empty_like(target, device=device)
            window.post(group.recv([landing], src, tag), landing,
                        lambda landing=landing, piece=piece: landed(landing, piece))
    try:
        theirs = json.loads(_recv_bytes(group, src, 2, device))["xxh3"]
    except (ValueError, KeyError) as e:
        raise RecoveryError(f"malformed checksum from rank {src}: {e}") from None
    if theirs != digest.intdigest():
        raise RecoveryError(f"state received from rank {src} fails its checksum")
    return unflatten(skeleton, tensors)


#: Tensors smaller than this travel packed with their neighbours, in
#: messages of up to about this size (see :func:`send_state`).
BUCKET_BYTES = 1 << 20


def _pieces(sizes: list[int]) -> list[list[int]]:
    """The messages a state's tensors travel in, as lists of their indices,
    in order: one per tensor of :data:`BUCKET_BYTES` or more, and runs of
    smaller ones packed up to that size. Both sides compute it from the
    header's sizes."""
    out: list[list[int]] = []
    run: list[int] = []
    run_bytes = 0
    for i, size in enumerate(sizes):
        if size >= BUCKET_BYTES:
            if run:
                out.append(run)
                run, run_bytes = [], 0
            out.append([i])
            continue
        if run and run_bytes + size > BUCKET_BYTES:
            out.append(run)
            run, run_bytes = [], 0
        run.append(i)
        run_bytes += size
    if run:
        out.append(run)
    return out


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat ``uint8`` view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


#: How many bytes of point-to-point transfers :func:`send_state` and
#: :func:`recv_state` keep posted at once (temporary device copies of host
#: tensors live until their transfer completes).
IN_FLIGHT_BYTES = 64 << 20


class _Window:
    """Posted transfers, oldest first: waited for (and their ``then`` run,
    in order) once more than :data:`IN_FLIGHT_BYTES` are in flight, and all
    of them on leaving the ``with`` block."""

    def __init__(self) -> None:
        self._posted: list[tuple[Any, int, Any]] = []
        self._bytes = 0

    def post(self, work: Any, tensor: torch.Tensor, then: Any = None) -> None:
        size = tensor.numel() * tensor.element_size()
        self._posted.append((work, size, then))
        self._bytes += size
        while self._bytes > IN_FLIGHT_BYTES and len(self._posted) > 1:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        work, size, then = self._posted.pop(0)
        work.wait()
        self._bytes -= size
        if then is not None:
            then()

    def __enter__(self) -> "_Window":
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is None:
            while self._posted:
                self._finish_oldest()
