"""Training state as trainguard handles it: gathered, flattened, shipped, hashed.

A state is a nested structure of dicts, lists, tuples, tensors and JSON
scalars (what ``state_dict()`` methods return). :func:`flatten` splits it
into a JSON *skeleton* and a list of tensors, so it can cross a process group
without pickling and be hashed canonically (:func:`state_sha256`).
:func:`send_state` / :func:`recv_state` move it between two ranks: a
header, then each tensor straight from (and, on the receiver, straight into)
the memory it lives in -- recoveries must not wait on hundreds of megabytes
of fresh allocations -- and the receiver verifies the CRC32 the sender
computed (a transfer between live ranks needs to catch accidental
corruption, not forgery; checkpoints on disk use SHA-256).
"""

from __future__ import annotations

import hashlib
import json
import zlib
from typing import Any

import torch

from trainguard.core import RecoveryError

__all__ = ["flatten", "recv_state", "send_state", "state_sha256", "unflatten"]

_SCALARS = (int, float, str, bool, type(None))


def flatten(obj: Any, paths: list[str] | None = None) -> tuple[Any, list[torch.Tensor]]:
    """Split ``obj`` into a JSON-able skeleton and its tensors (and, when
    ``paths`` is given, append where each tensor sits).

    Raises:
        TypeError: for a value that is neither a container, a tensor nor a
            JSON scalar (naming where it sits).
    """
    tensors: list[torch.Tensor] = []

    def walk(x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            if paths is not None:
                paths.append(path)
            return {"T": len(tensors) - 1}
        if isinstance(x, _SCALARS):
            return x
        if isinstance(x, dict):
            for k in x:
                if not isinstance(k, (str, int)):
                    raise TypeError(f"state key {k!r} at {path or '<root>'} is not a str or int")
            return {"d": [[k, walk(v, f"{path}.{k}")] for k, v in x.items()]}
        if isinstance(x, tuple):
            return {"t": [walk(v, f"{path}[{i}]") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return {"l": [walk(v, f"{path}[{i}]") for i, v in enumerate(x)]}
        raise TypeError(f"cannot carry a {type(x).__name__} at {path or '<root>'} in training state")

    return walk(obj, ""), tensors


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
    """The tensor's bytes as a buffer hashlib can read without a copy (CPU)."""
    t = t.detach().contiguous().cpu().reshape(-1)
    return t.view(torch.uint8).numpy() if t.numel() else b""


def state_sha256(obj: Any) -> str:
    """A canonical SHA-256 of a state: structure, dtypes, shapes and bytes."""
    skeleton, tensors = flatten(obj)
    h = hashlib.sha256(json.dumps(skeleton, sort_keys=True).encode())
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
    (structure, where each tensor sits, dtypes, shapes), each tensor as it
    lies in memory (nothing is packed into a new buffer), then the running
    CRC32 over all of them."""
    paths: list[str] = []
    skeleton, tensors = flatten(obj, paths)
    metas = [{"path": p, "dtype": str(t.dtype), "shape": list(t.shape), "device": t.device.type}
             for p, t in zip(paths, tensors)]
    _send_bytes(group, json.dumps({"skeleton": skeleton, "tensors": metas}).encode(), dst, 0, device)
    crc = 0
    for i, t in enumerate(tensors):
        t = t.detach().contiguous()
        group.send([t.to(device)], dst, _DATA_TAG + i).wait()
        crc = zlib.crc32(_raw(t), crc)
    _send_bytes(group, json.dumps({"crc32": crc}).encode(), dst, 2, device)


def recv_state(group: Any, src: int, *, device: torch.device, into: Any = None) -> Any:
    """Receive a state sent by :func:`send_state`.

    Args:
        into: this rank's own state of the same structure, when it has one:
            each tensor at the same place with the same dtype and shape is
            received in place (no new memory); the rest is allocated on the
            device type the sender's sat on.

    Raises:
        RecoveryError: the header is malformed or the data fails its checksum
            (tensors received in place then hold garbage: the caller must not
            use this rank's state).
    """
    try:
        header = json.loads(_recv_bytes(group, src, 0, device))
        skeleton, metas = header["skeleton"], header["tensors"]
    except (ValueError, KeyError) as e:
        raise RecoveryError(f"malformed state header from rank {src}: {e}") from None
    mine: dict[str, torch.Tensor] = {}
    if into is not None:
        my_paths: list[str] = []
        _, my_tensors = flatten(into, my_paths)
        mine = dict(zip(my_paths, my_tensors))
    tensors, crc = [], 0
    for i, m in enumerate(metas):
        dtype, shape = _dtype(m["dtype"]), tuple(m["shape"])
        target = mine.get(m["path"])
        if (target is None or target.dtype != dtype or tuple(target.shape) != shape or not target.is_contiguous()
                or target.device.type != (device.type if m["device"] != "cpu" else "cpu")):
            target = torch.empty(shape, dtype=dtype, device=device if m["device"] != "cpu" else "cpu")
        landing = target if target.device == device else torch.empty(shape, dtype=dtype, device=device)
        group.recv([landing], src, _DATA_TAG + i).wait()
        if landing is not target:
            target.copy_(landing)
        crc = zlib.crc32(_raw(target), crc)
        tensors.append(target)
    try:
        theirs = json.loads(_recv_bytes(group, src, 2, device))["crc32"]
    except (ValueError, KeyError) as e:
        raise RecoveryError(f"malformed checksum from rank {src}: {e}") from None
    if theirs != crc:
        raise RecoveryError(f"state received from rank {src} fails its checksum")
    return unflatten(skeleton, tensors)
