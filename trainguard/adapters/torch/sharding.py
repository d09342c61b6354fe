"""What kind of parallel state a model and its optimizer hold, and refusing
what the Guard cannot protect -- before step 0, on every rank alike.

The Guard's default layout treats every rank as a full copy of the state
(data parallelism). A sharded state -- DTensors (FSDP2's ``fully_shard``,
tensor parallelism), ``ShardedTensor`` s, FSDP1's flat parameters -- holds
only a part on each rank: saved or copied as a full copy, it would make
checkpoints that claim the whole state and hold one rank's part, and
repairs that copy one rank's part into another's. Such state is refused
with a message saying what was found and what is supported.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from trainguard.core import ConfigError

__all__ = ["find_sharded", "refuse_unsupported"]

DOCS = "docs/torch.md#sharded-models-fsdp2-hsdp"


def _sharded_types() -> tuple[type, ...]:
    types: list[type] = []
    try:
        from torch.distributed.tensor import DTensor
        types.append(DTensor)
    except ImportError:  # pragma: no cover - every supported torch has it
        pass
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
        types.append(ShardedTensor)
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)


def _tensors(model: torch.nn.Module, optimizer: Any) -> Iterator[tuple[str, Any]]:
    for name, p in model.named_parameters():
        yield f"parameter {name}", p
    for name, b in model.named_buffers():
        yield f"buffer {name}", b
    for i, state in enumerate(getattr(optimizer, "state", {}).values()):
        for key, value in (state.items() if isinstance(state, dict) else ()):
            yield f"optimizer state {i}.{key}", value


def find_sharded(model: torch.nn.Module, optimizer: Any) -> tuple[str, Any] | None:
    """The first sharded tensor of the model or the optimizer's state, as
    ``(where, tensor)``, or ``None`` when every tensor is a plain one."""
    types = _sharded_types()
    return next(((where, t) for where, t in _tensors(model, optimizer) if isinstance(t, types)), None)


def _fsdp1(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - every supported torch has it
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def refuse_unsupported(model: torch.nn.Module, optimizer: Any) -> None:
    """Refuse a model or optimizer whose state the Guard cannot protect.

    Raises:
        ConfigError: FSDP1 (``FullyShardedDataParallel``), or any sharded
            tensor (DTensor, ``ShardedTensor``) in the parameters, buffers
            or optimizer state, naming where.
    """
    if _fsdp1(model):
        raise ConfigError("FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel) is not supported: its flat "
                          "parameters hold one rank's part of the state, which the Guard would save and copy as "
                          f"a full copy. See {DOCS}")
    found = find_sharded(model, optimizer)
    if found is not None:
        where, tensor = found
        placements = getattr(tensor, "placements", None)
        raise ConfigError(f"{where} is a {type(tensor).__name__}{f' {tuple(placements)}' if placements else ''}: "
                          "sharded state (FSDP2's fully_shard, tensor or pipeline parallelism) is not supported "
                          "by this version of the torch Guard, which would save and copy each rank's part as a "
                          f"full copy. See {DOCS}")
