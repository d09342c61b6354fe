"""Torch state out of a snapshot payload: the reading side of
:mod:`.snapshot`, for a slot's payload and a persisted ``.safetensors``
file's bytes alike.

:func:`read_payload` turns a payload back into the state, with tensors that own
their memory (a view into a slot would be overwritten by the next snapshot);
:func:`read_payload_into` fills the tensors a restarted process already has
instead, once the payload passed its checksum (:func:`filled`). The tensors'
dtypes go by their safetensors names (:data:`DTYPES`), as the snapshot wrote them.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from trainguard.core import CheckpointError
from trainguard.core.snapshot import payload_header
from trainguard.core.snapshot.ring import FORMAT

from .state import flatten, unflatten

__all__ = ["BY_NAME", "DTYPES", "destinations", "filled", "on_device", "read_payload", "read_payload_into"]

#: The safetensors name of each dtype a snapshot holds (and, below, back).
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
          torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
BY_NAME = {v: k for k, v in DTYPES.items()}


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
    payload passed its checksum, before the payload is unmapped (on
    whatever device the destination is). A destination of another dtype or
    shape is left alone.

    A restart then allocates and touches fresh memory only for what has no
    place yet (an optimizer's moments), and copies the rest once.

    Raises:
        CheckpointError: the payload is malformed or not a trainguard snapshot.
    """
    table, meta, start = payload_header(payload)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"not a {FORMAT} payload")
    base = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
    device, cpu = torch.device(device), torch.device("cpu")
    tensors, later = [], []
    try:
        for name in meta["names"]:
            e = table[name]
            b, end = e["data_offsets"]
            dtype, shape = BY_NAME[e["dtype"]], e["shape"]
            view = base[start + b:start + end].view(dtype).view(shape) if end > b else None
            dst = into.get(name)
            if dst is not None and dst.dtype == dtype and list(dst.shape) == shape:
                tensors.append(dst)
                if view is not None:
                    later.append((dst, view))
            else:  # model and optimizer state straight to the device (no host copy on the way), the rest
                # -- random streams, scheduler, data position, counters -- to the host, where it is used
                to = device if on_device(name) else cpu
                if view is None:
                    tensors.append(torch.empty(shape, dtype=dtype, device=to))
                else:
                    tensors.append(view.clone() if to.type == "cpu" else view.to(to))
        return int(meta["step"]), unflatten(meta["skeleton"], tensors), later
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"snapshot payload does not match its header ({e})") from None


#: The paths of a snapshot whose tensors a load may place on the device: the
#: model's and the optimizer's (torch: ``state.model``, ``state.optimizer``;
#: Megatron: ``state.rank.model<i>``, ``state.rank.optimizer``,
#: ``state.shards``). A random stream or a data position put there cannot be
#: set again (a CUDA restart from memory crashed in numpy on exactly that).
_ON_DEVICE = re.compile(r"\.state\.(?:rank\.)?(?:model\d*|optimizer)(?:[.\[]|$)|\.state\.shards(?:[.\[]|$)")


def on_device(path: str) -> bool:
    """Whether a load may place the snapshot tensor at ``path`` on the device."""
    return _ON_DEVICE.match(path) is not None


def destinations(state: Any) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` by path, as a snapshot of the same structure
    names them (any other value is passed over: it has no place to fill)."""
    paths: list[str] = []
    tensors = flatten(state, paths, strict=False)[1]
    return dict(zip(paths, tensors))


def filled(read: tuple[int, Any, list[tuple[torch.Tensor, torch.Tensor]]]) -> tuple[int, Any]:
    """``(step, state)`` of what :func:`read_payload_into` returned, once the
    copies it left have run."""
    step, state, copies = read
    try:
        with torch.no_grad():
            for dst, src in copies:
                dst.copy_(src)
    except RuntimeError as e:  # a destination that cannot be written (an expanded view)
        raise CheckpointError(f"a tensor could not be filled from the snapshot: {e}") from None
    return step, state
