"""A rank's own part of the torch state (its random streams and data
position, :meth:`.trainstate.TrainState.own_part`) as bytes.

The same bytes go into the node agent's record at every update
(:mod:`trainguard.core.snapshot.own`) and, as ``own_r<rank>.bin``, into
every checkpoint -- the dying gasp's included, where a survivor on the lost
rank's node copies its record over. Loading them runs no code: a JSON header
(structure, and each tensor's dtype and shape) and the tensors' bytes.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch

from trainguard.core import CheckpointError

from .state import fingerprint, flatten, unflatten

__all__ = ["fingerprints", "own_file", "pack", "unpack"]

_LENGTH = struct.Struct("<Q")
#: dtypes an own part holds (RNG states: uint8 and int64; a data position may hold others).
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool, torch.float16, torch.bfloat16,
    torch.float32, torch.float64)}


def own_file(rank: int) -> str:
    """The checkpoint file holding ``rank``'s own part."""
    return f"own_r{rank}.bin"


def pack(own: Any) -> bytes:
    """``own`` (tensors, JSON scalars, containers) as bytes; tensors go to the host.

    Raises:
        TypeError: a value that is neither (naming where it sits).
    """
    skeleton, tensors = flatten(own)
    host = [t.detach().cpu().contiguous() for t in tensors]
    head = json.dumps({"skeleton": skeleton,
                       "tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in host]},
                      separators=(",", ":")).encode()
    return b"".join([_LENGTH.pack(len(head)), head,
                     *(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in host)])


def unpack(data: bytes, where: str = "own part") -> Any:
    """The object :func:`pack` made (tensors on the host).

    Raises:
        CheckpointError: the bytes are not a packed own part.
    """
    try:
        (n,) = _LENGTH.unpack_from(data, 0)
        if n > len(data) - _LENGTH.size:
            raise ValueError("header runs past the end")
        head = json.loads(data[_LENGTH.size:_LENGTH.size + n])
        pos, tensors = _LENGTH.size + n, []
        for name, shape in head["tensors"]:
            dtype = _DTYPES[name]
            count = 1
            for d in shape:
                count *= int(d)
            size = count * torch.empty((), dtype=dtype).element_size()
            if count < 0 or pos + size > len(data):
                raise ValueError("tensor data runs past the end")
            raw = torch.frombuffer(bytearray(data[pos:pos + size]), dtype=torch.uint8) if size else \
                torch.empty(0, dtype=torch.uint8)
            tensors.append(raw.view(dtype).reshape(shape))
            pos += size
        if pos != len(data):
            raise ValueError(f"{len(data) - pos} bytes left over")
        return unflatten(head["skeleton"], tensors)
    except Exception as e:  # noqa: BLE001 - every way malformed bytes fail is the same answer
        raise CheckpointError(f"{where} is malformed ({type(e).__name__}: {e})") from None


def fingerprints(module: torch.nn.Module, own: dict, rank: int, pieces: dict | None = None) -> dict:
    """For ``trainguard rehearse``: the model, this rank's streams (torch's
    apart from Python's and NumPy's, which a script may leave unseeded),
    its data position and each of ``pieces`` (the optimizer, the scheduler,
    ...: :meth:`.trainstate.TrainState.pieces`), each as a fingerprint."""
    rng = own["rng"][str(rank)]
    return {"model": fingerprint(module.state_dict()),
            "rng": fingerprint({"torch": rng["torch"], "cuda": rng.get("cuda")}),
            "python": fingerprint(rng["python"]), "numpy": fingerprint(rng.get("numpy")),
            "data": fingerprint(own["data"]) if "data" in own else None,
            **{name: fingerprint(value) for name, value in (pieces or {}).items()}}
