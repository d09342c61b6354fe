"""A MindSpore rank's own part -- its random streams (Python's, NumPy's
global one, MindSpore's default generator and its op seeds,
:func:`.state.streams`) and its buffers (BatchNorm's moving statistics) --
as bytes.

Replicas share their parameters, so any of them saves or serves those;
each rank's streams are its own, and so are the statistics its own batches
moved (a data-parallel all-reduce moves gradients only). The same bytes go into the node agent's
record when each update begins (:mod:`trainguard.core.snapshot.own`) and,
as ``own_r<rank>.json``, into a dying gasp's checkpoint, where a survivor on
a lost rank's node copies that rank's record over. The bytes are JSON:
loading them runs no code, and a record that is not one is refused.
"""

from __future__ import annotations

import base64
import json
import random
from typing import Any

import numpy as np
from mindspore import Tensor

from trainguard.core import CheckpointError
from trainguard.core.checkpoint import FileInfo

__all__ = ["FILE_INTS", "file_from_ints", "file_ints", "own_file", "pack", "unpack"]

#: A written file's record as integers, for the Guard's integer all-gather
#: (which carries 32 bits of each): 1 (written), its size, its SHA-256 as
#: sixteen 16-bit words.
FILE_INTS = 18

#: MindSpore's generator state (``ms.get_rng_state()``: seed and offset as bytes).
_GENERATOR_DTYPES = ("uint8", "int64")
#: What a buffer may hold.
_BUFFER_DTYPES = ("float16", "float32", "float64", "int32", "int64", "bool")


def own_file(rank: int) -> str:
    """The checkpoint file holding ``rank``'s own part."""
    return f"own_r{rank}.json"


def file_ints(info: FileInfo) -> list[int]:
    """``info``'s size and digest as :data:`FILE_INTS` integers."""
    digest = bytes.fromhex(info.sha256)
    return [1, info.bytes, *(int.from_bytes(digest[i:i + 2], "big") for i in range(0, 32, 2))]


def file_from_ints(name: str, ints: list[int]) -> FileInfo:
    """The record :func:`file_ints` made, as file ``name``'s."""
    return FileInfo(name, int(ints[1]), b"".join(int(w).to_bytes(2, "big") for w in ints[2:FILE_INTS]).hex())


def pack(streams: dict[str, Any], buffers: dict[str, np.ndarray] | None = None) -> bytes:
    """``streams`` (:func:`.state.streams`) and ``buffers`` (by name) as JSON bytes."""
    version, internal, gauss = streams["python"]
    name, keys, pos, has_gauss, cached = streams["numpy"]
    generator = streams["mindspore"].asnumpy()
    return json.dumps({  # the two state vectors as the hex of their words: a tenth of a list's time
        "python": [version, np.asarray(internal, np.int64).tobytes().hex(), gauss],
        "numpy": [name, np.asarray(keys, np.uint32).tobytes().hex(), int(pos), int(has_gauss), float(cached)],
        "mindspore": {"dtype": str(generator.dtype), "shape": list(generator.shape), "hex": generator.tobytes().hex()},
        "ops": sorted([kernel, int(op_seed), int(value)] for (kernel, op_seed), value in streams["ops"].items()),
        **({} if buffers is None else {"buffers": [
            [name, str(a.dtype), list(a.shape), base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()]
            for name, a in sorted(buffers.items())]}),
    }, separators=(",", ":")).encode()


def unpack(data: bytes, what: str) -> dict[str, Any]:
    """The streams ``pack`` wrote, checked by setting them in scratch
    generators first, and its buffers (``None``: a record without them).

    Raises:
        CheckpointError: ``data`` is not such a record (``what`` names it).
    """
    try:
        record = json.loads(data)
        version, internal, gauss = record["python"]
        words = np.frombuffer(bytes.fromhex(internal), np.int64)
        python = (int(version), tuple(words.tolist()), None if gauss is None else float(gauss))
        random.Random().setstate(python)
        name, keys, pos, has_gauss, cached = record["numpy"]
        numpy = (str(name), np.frombuffer(bytes.fromhex(keys), np.uint32).copy(), int(pos), int(has_gauss),
                 float(cached))
        np.random.RandomState().set_state(numpy)
        generator = record["mindspore"]
        if generator["dtype"] not in _GENERATOR_DTYPES:
            raise ValueError(f"a generator state of dtype {generator['dtype']!r}")
        raw = np.frombuffer(bytes.fromhex(generator["hex"]), np.dtype(generator["dtype"]))
        mindspore = Tensor(raw.reshape([int(n) for n in generator["shape"]]).copy())
        ops = None if "ops" not in record else {(_kernel(k), int(o)): int(v) for k, o, v in record["ops"]}
        buffers = None if "buffers" not in record else dict(_buffer(*row) for row in record["buffers"])
    except (ValueError, TypeError, KeyError, OverflowError) as e:
        raise CheckpointError(f"{what} is not a record of random streams: {type(e).__name__}: {e}") from None
    return {"python": python, "numpy": numpy, "mindspore": mindspore, "ops": ops, "buffers": buffers}


def _buffer(name: Any, dtype: Any, shape: Any, data: Any) -> tuple[str, np.ndarray]:
    if not isinstance(name, str) or dtype not in _BUFFER_DTYPES:
        raise TypeError(f"a buffer {name!r} of dtype {dtype!r}")
    raw = base64.b64decode(data, validate=True)
    return name, np.frombuffer(raw, np.dtype(dtype)).reshape([int(n) for n in shape]).copy()


def _kernel(name: Any) -> str:
    if not isinstance(name, str):
        raise TypeError(f"an op seed's kernel name {name!r}")
    return name
