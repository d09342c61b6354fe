"""Training state as trainguard handles it: gathered, flattened, shipped, hashed.

A state is a nested structure of dicts, lists, tuples, tensors and JSON
scalars (what ``state_dict()`` methods return). :func:`flatten` splits it
into a JSON *skeleton* and a list of tensors, so it can cross a process group
without pickling and be hashed canonically (:func:`state_sha256`).
:func:`send_state` / :func:`recv_state` move it between two ranks as one
header plus one buffer per dtype, and the receiver verifies the CRC32 the
sender computed (a transfer between live ranks needs to catch accidental
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


def flatten(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """Split ``obj`` into a JSON-able skeleton and its tensors.

    Raises:
        TypeError: for a value that is neither a container, a tensor nor a
            JSON scalar (naming where it sits).
    """
    tensors: list[torch.Tensor] = []

    def walk(x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
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


def _pack(tensors: list[torch.Tensor]) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Group tensors by dtype into one flat buffer each."""
    metas, by_dtype = [], {}
    for t in tensors:
        key = str(t.dtype)
        chunks = by_dtype.setdefault(key, [])
        offset = sum(c.numel() for c in chunks)
        metas.append({"dtype": key, "shape": list(t.shape), "offset": offset, "device": str(t.device)})
        chunks.append(t.detach().reshape(-1))
    return metas, {k: torch.cat(v) if v else torch.empty(0) for k, v in by_dtype.items()}


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise RecoveryError(f"unknown dtype {name!r} in a state header")
    return dtype


def _crc32(t: torch.Tensor) -> int:
    return zlib.crc32(_raw(t))


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


def send_state(group: Any, obj: Any, dst: int, *, device: torch.device) -> None:
    """Send ``obj`` to ``dst`` over ``group`` (point to point): a header
    (structure, shapes), one buffer per dtype, then a CRC32 of each buffer
    (computed while the receiver checks its copy)."""
    skeleton, tensors = flatten(obj)
    metas, buffers = _pack(tensors)
    keys = sorted(buffers)
    header = {"skeleton": skeleton, "tensors": metas, "buffers": {k: buffers[k].numel() for k in keys}}
    _send_bytes(group, json.dumps(header).encode(), dst, 0, device)
    for i, key in enumerate(keys):
        group.send([buffers[key].to(device)], dst, 2 + i).wait()
    _send_bytes(group, json.dumps({k: _crc32(buffers[k]) for k in keys}).encode(), dst, 2 + len(keys), device)


def recv_state(group: Any, src: int, *, device: torch.device) -> Any:
    """Receive a state sent by :func:`send_state`; tensors land on the device
    each one came from on the sender (mapped to ``device``'s type).

    Raises:
        RecoveryError: the header is malformed or a buffer fails its checksum.
    """
    try:
        header = json.loads(_recv_bytes(group, src, 0, device))
        skeleton, metas, sizes = header["skeleton"], header["tensors"], header["buffers"]
    except (ValueError, KeyError) as e:
        raise RecoveryError(f"malformed state header from rank {src}: {e}") from None
    keys = sorted(sizes)
    buffers = {}
    for i, key in enumerate(keys):
        buffers[key] = torch.empty(sizes[key], dtype=_dtype(key), device=device)
        group.recv([buffers[key]], src, 2 + i).wait()
    mine = {k: _crc32(buffers[k]) for k in keys}
    try:
        theirs = json.loads(_recv_bytes(group, src, 2 + len(keys), device))
    except ValueError as e:
        raise RecoveryError(f"malformed checksums from rank {src}: {e}") from None
    bad = [k for k in keys if theirs.get(k) != mine[k]]
    if bad:
        raise RecoveryError(f"state received from rank {src} fails its checksum ({', '.join(bad)} buffer)")
    tensors = []
    for m in metas:
        n = 1
        for d in m["shape"]:
            n *= d
        # A view into the received buffer: load_state_dict copies what it keeps.
        t = buffers[m["dtype"]][m["offset"]:m["offset"] + n].view(m["shape"])
        if torch.device(m["device"]).type == "cpu":
            t = t.cpu()
        tensors.append(t)
    return unflatten(skeleton, tensors)
