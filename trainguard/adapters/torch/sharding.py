"""What kind of parallel state a model and its optimizer hold, and refusing
what the Guard cannot protect -- before step 0, on every rank alike.

The Guard's default layout treats every rank as a full copy of the state
(data parallelism). A sharded state holds only a part on each rank: saved
or copied as a full copy, it would make checkpoints that claim the whole
state and hold one rank's part, and repairs that copy one rank's part into
another's. :func:`sharding_of` recognises the sharded layouts the Guard
protects -- FSDP2 (``fully_shard`` over a 1-D device mesh: every rank its
own shard) and HSDP (``fully_shard`` over a 2-D ``(replicate, shard)``
mesh: each shard on one rank of every replica group) -- and describes
them for the replica registry (:class:`Sharding`); anything else sharded
(FSDP1's flat parameters, DTensors that ``fully_shard`` does not manage:
tensor parallelism, FSDP with TP, a mesh that leaves ranks out: pipeline
parallelism; ``ShardedTensor`` s) is refused with a message naming what was
found. Ranks that should hold copies of one model but hold different ones
(plain-torch pipeline stages) are found by :func:`structure` and refused by
:func:`refuse_different_models` once every rank's has been gathered.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from trainguard.core import ConfigError, ReplicaGroup

__all__ = ["Sharding", "find_sharded", "refuse_different_models", "refuse_unsupported", "sharding_of", "structure"]

DOCS = "docs/torch.md#sharded-models-fsdp2-hsdp"


def _sharded_types(dtensors: bool = True) -> tuple[type, ...]:
    types: list[type] = []
    try:
        from torch.distributed.tensor import DTensor
        if dtensors:
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


def find_sharded(model: torch.nn.Module, optimizer: Any, *, dtensors: bool = True) -> tuple[str, Any] | None:
    """The first sharded tensor of the model or the optimizer's state, as
    ``(where, tensor)``, or ``None`` when every tensor is a plain one
    (DTensors not counted without ``dtensors``)."""
    types = _sharded_types(dtensors)
    return next(((where, t) for where, t in _tensors(model, optimizer) if isinstance(t, types)), None)


def _fsdp1(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - every supported torch has it
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


@dataclass(frozen=True)
class Sharding:
    """A model sharded by ``fully_shard``, as the Guard protects it.

    ``mesh``: the device mesh every sharded parameter lives on; ``kind``:
    ``"FSDP2"`` (1-D) or ``"HSDP"`` (2-D, replicate x shard); ``replicas``:
    the replica registry's group -- the mesh's ranks row by row, each shard
    held by one rank of every replica group; ``param_groups``: FSDP's
    parameter groups (their process groups are swapped for abortable ones,
    :mod:`.fsdp`); ``root``: the module ``fully_shard`` was applied to last
    (the one FSDP resets after an abandoned step).
    """

    mesh: Any
    kind: str
    replicas: ReplicaGroup
    param_groups: tuple
    root: torch.nn.Module

    @property
    def join_refused(self) -> str:
        """Why no new process can join the job (recover-in-place, recover)."""
        return (f"a new process cannot join an {self.kind} job (its device mesh is built with collectives the "
                "running ranks do not take part in)")


def sharding_of(model: torch.nn.Module, optimizer: Any, world_size: int) -> Sharding | None:
    """The FSDP2/HSDP layout of ``model`` (``None``: nothing is sharded).

    Raises:
        ConfigError: sharded state the Guard does not protect (see
            :func:`refuse_unsupported`), naming what and why.
    """
    refuse_unsupported(model, optimizer, fsdp2=True)
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # pragma: no cover - every supported torch has them
        return None
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        refuse_unsupported(model, optimizer)  # DTensors without fully_shard: tensor parallelism
        return None
    groups, managed = [], set()
    for unit in units:
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            groups.append(group)
            managed.update(id(p.sharded_param) for p in group.fsdp_params)
    stray = next(((n, p) for n, p in model.named_parameters() if isinstance(p, DTensor) and id(p) not in managed),
                 None) or next(((n, b) for n, b in model.named_buffers() if isinstance(b, DTensor)), None)
    if stray is not None:
        raise ConfigError(f"{stray[0]} is a DTensor {tuple(stray[1].placements)} that fully_shard does not manage "
                          f"(tensor parallelism?): only FSDP2 and HSDP are supported. See {DOCS}")
    meshes = {id(g.mesh_info.mesh): g.mesh_info.mesh for g in groups}
    if len(meshes) != 1:
        raise ConfigError(f"fully_shard was applied over {len(meshes)} device meshes: the Guard protects one. "
                          f"See {DOCS}")
    (mesh,) = meshes.values()
    for g in groups:
        if g.mesh_info.is_spmd_mesh or any(getattr(p, "is_dtensor", False) for p in g.fsdp_params):
            raise ConfigError(f"FSDP with tensor parallelism (a {mesh.ndim}-D SPMD mesh) is not supported. See {DOCS}")
        if g.post_forward_mesh_info is not None and g.post_forward_mesh_info is not g.mesh_info:
            raise ConfigError("fully_shard(reshard_after_forward=<int>) reshards onto a mesh of its own, which the "
                              f"Guard cannot release; use True or False. See {DOCS}")
    if mesh.size() != world_size:
        raise ConfigError(f"the device mesh {tuple(mesh.shape)} covers {mesh.size()} of the job's {world_size} ranks "
                          f"(pipeline parallelism, or another dimension): not supported. See {DOCS}")
    want = (Shard,) if mesh.ndim == 1 else (Replicate, Shard)
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) and (len(p.placements) != len(want) or
                                       not all(isinstance(x, w) for x, w in zip(p.placements, want))):
            raise ConfigError(f"parameter {name} is placed {tuple(p.placements)} on a {mesh.ndim}-D mesh: the Guard "
                              f"protects FSDP2 (Shard) and HSDP (Replicate, Shard). See {DOCS}")
    if mesh.ndim > 2:
        raise ConfigError(f"a {mesh.ndim}-D device mesh is not supported (FSDP2: 1-D, HSDP: 2-D). See {DOCS}")
    replicas = ReplicaGroup.mesh(mesh.mesh.reshape(1 if mesh.ndim == 1 else mesh.shape[0], -1).tolist())
    roots = [u for u in units if not any(u is not o and any(m is u for m in o.modules()) for o in units)]
    return Sharding(mesh=mesh, kind="FSDP2" if mesh.ndim == 1 else "HSDP", replicas=replicas,
                    param_groups=tuple(groups), root=roots[0])


def refuse_unsupported(model: torch.nn.Module, optimizer: Any, *, fsdp2: bool = False) -> None:
    """Refuse a model or optimizer whose state the Guard cannot protect.

    Args:
        fsdp2: DTensors that ``fully_shard`` manages are left to
            :func:`sharding_of` (which calls this with it set).

    Raises:
        ConfigError: FSDP1 (``FullyShardedDataParallel``), or any sharded
            tensor (DTensor, ``ShardedTensor``) in the parameters, buffers
            or optimizer state, naming where.
    """
    if _fsdp1(model):
        raise ConfigError("FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel) is not supported: its flat "
                          "parameters hold one rank's part of the state, which the Guard would save and copy as "
                          f"a full copy. See {DOCS}")
    found = find_sharded(model, optimizer, dtensors=not fsdp2)
    if found is not None:
        where, tensor = found
        placements = getattr(tensor, "placements", None)
        raise ConfigError(f"{where} is a {type(tensor).__name__}{f' {tuple(placements)}' if placements else ''}: "
                          "sharded state that fully_shard does not manage (tensor or pipeline parallelism, "
                          "ShardedTensor) is not supported: the torch Guard would save and copy each rank's part "
                          f"as a full copy; it protects FSDP2 and HSDP (fully_shard). See {DOCS}")


def structure(model: torch.nn.Module) -> str:
    """A digest of the model's parameter and buffer names, (global) shapes
    and dtypes: the same on every rank of a data-parallel, FSDP2 or HSDP job."""
    from torch.nn.parameter import UninitializedTensorMixin
    h = hashlib.sha256()
    for kind, items in (("p", model.named_parameters()), ("b", model.named_buffers())):
        for name, t in items:
            shape = "lazy" if isinstance(t, UninitializedTensorMixin) else tuple(t.shape)  # a Lazy* module's
            h.update(f"{kind} {name} {shape} {t.dtype}\n".encode())
    return h.hexdigest()[:16]


def refuse_different_models(digests: Sequence[str]) -> None:
    """Refuse a job whose ranks (``digests[rank]``: :func:`structure`)
    hold models of different names, shapes or dtypes -- each a different
    part, as pipeline stages in plain torch are -- while the Guard would
    save and copy each as the whole model. Called with the same list on
    every rank, so all of them refuse alike.

    Raises:
        ConfigError: naming the first rank whose model differs from rank 0's.
    """
    odd = next((r for r, d in enumerate(digests) if d != digests[0]), None)
    if odd is not None:
        raise ConfigError(f"rank {odd}'s model differs from rank 0's (parameter or buffer names, shapes or dtypes): "
                          "the ranks hold different parts of a model (pipeline parallelism in plain torch?), which "
                          "the Guard would save and copy as whole copies; it protects data parallelism (DDP), FSDP2 "
                          f"and HSDP. For parts that are replicated, pass replicas=. See {DOCS}")
