"""The persisted snapshot file of a Megatron rank: its name in Megatron's
layout, which files hold what, and what goes in it (see :mod:`.snapshot`
for the ring that makes them, :func:`~.checkpoint.load_found` for the
load that reads them beside Megatron's ``.pt`` files)."""

from __future__ import annotations

import io
import re
from collections import OrderedDict
from typing import Any, Iterable

import torch

from trainguard.adapters.torch.checkpoints import read_stored_snapshot
from trainguard.core import CheckpointError

from .kinds import EXPERT, shard_state, sharded_kinds
from .layout import FILE, ParallelRank
from .state import rank_state

__all__ = ["contents", "holding", "parts", "read_file", "snapshot_file"]

_PLAIN = (int, float, str, bool, type(None))


def snapshot_file(subdir: str, index: dict[int, int]) -> str:
    """The name of a persisted snapshot in a checkpoint: Megatron's model
    file or, with a distributed optimizer, one named after the shard of
    each kind it holds (``index``: kind -> shard)."""
    if not index:
        return f"{subdir}/{FILE.removesuffix('.pt')}.safetensors"
    parts = [f"{'expert_' if kind == EXPERT else ''}shard_{j:03d}" for kind, j in sorted(index.items())]
    return f"{subdir}/distrib_optim_{'_'.join(parts)}.safetensors"


_NAME = re.compile(r"^(?P<sub>[^/]+)/(?:model_optim_rng|distrib_optim(?:_shard_(?P<dense>\d+))?"
                   r"(?:_expert_shard_(?P<expert>\d+))?)\.safetensors$")


def holding(names: Iterable[str], here: ParallelRank, kind: int | None, shard: int | None) -> list[str]:
    """The persisted snapshots among ``names`` that hold this rank's model
    state (``kind`` None: any in its directory) or shard ``shard`` of
    ``kind`` (the dense shards: any expert-parallel rank's)."""
    out = []
    for name in sorted(names):
        m = _NAME.match(name)
        if m is None:
            continue
        sub = m["sub"]
        if kind is None or kind == EXPERT:
            fits = sub == here.subdir and (kind is None or m["expert"] is not None and int(m["expert"]) == shard)
        else:
            fits = re.fullmatch(re.escape(here.dense_subdir) + r"(_\d{3})?", sub) is not None and \
                m["dense"] is not None and int(m["dense"]) == shard
        if fits:
            out.append(name)
    return out


# ------------------------------------------------------------------ values
def _pack(obj: Any, path: tuple, odd: list) -> Any:
    """``obj`` with every value the ring cannot carry as it is replaced by
    its ``torch.save`` bytes (their paths appended to ``odd``)."""
    kind = type(obj)
    if isinstance(obj, torch.Tensor) or kind in _PLAIN:
        return obj
    if kind in (dict, OrderedDict) and all(type(k) in (str, int) for k in obj):
        return {k: _pack(v, (*path, k), odd) for k, v in obj.items()}
    if kind in (list, tuple):
        return kind(_pack(v, (*path, i), odd) for i, v in enumerate(obj))
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    odd.append(list(path))
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _unpack(obj: Any, odd: set, path: tuple) -> Any:
    if not odd:
        return obj
    if path in odd:
        try:
            return torch.load(io.BytesIO(obj.cpu().numpy().tobytes()), weights_only=True)
        except Exception as e:
            raise CheckpointError(f"the value at {'/'.join(map(str, path))} could not be loaded safely: {e}") \
                from None
    if isinstance(obj, dict):
        return {k: _unpack(v, odd, (*path, k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unpack(v, odd, (*path, i)) for i, v in enumerate(obj))
    return obj


def contents(step: int, model: Any, optimizer: Any, scheduler: Any, history: dict, rng: dict | None = None) -> dict:
    odd: list = []
    parts = _pack({"rank": rank_state(step, model, optimizer, scheduler, rng=rng),
                   "shards": [shard_state(optimizer, k) for k in sharded_kinds(optimizer)]}, (), odd)
    return {"state": {**parts, "odd": odd}, "history": history}


def parts(state: dict) -> tuple[dict, dict[int, dict]]:
    """(rank state, its shards by kind) of a snapshot's ``state``.

    Raises:
        CheckpointError: it is not a Megatron rank's snapshot.
    """
    try:
        odd = {tuple(p) for p in state["odd"]}
        shards = _unpack(state["shards"], odd, ("shards",))
        return _unpack(state["rank"], odd, ("rank",)), {s["kind"]: s for s in shards}
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"not a snapshot of a Megatron rank (no {e})") from None


def read_file(path: Any, device: Any = "cpu") -> tuple[dict, dict[int, dict]]:
    """(rank state, its shards by kind) in a persisted snapshot file.

    Raises:
        CheckpointError: it is not a readable trainguard snapshot.
    """
    return parts(read_stored_snapshot(path, torch.device(device)))
