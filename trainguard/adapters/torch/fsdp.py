"""The torch Guard on a model sharded by ``fully_shard`` (FSDP2, HSDP).

What changes against data parallelism (:mod:`.sharding` recognises the
layout and gives the replica registry its group):

* **Collectives that can be released.** FSDP all-gathers parameters and
  reduce-scatters (HSDP: also all-reduces) gradients on the device mesh's
  process groups, where a peer that died leaves every rank waiting for the
  backend's timeout. :class:`MeshGroups` puts an abortable group
  (:class:`~.process_group.AbortableProcessGroup`) in place of each of the
  mesh's groups in FSDP's parameter groups, which a STOP releases and a
  recovery rebuilds. DTensor's own collectives (a ``clip_grad_norm_``'s
  all-reduce, ``full_tensor()``) stay on the mesh's groups: they run in C++
  on the group's backend, where a Python group cannot stand in (c10d
  keeps the first backend registered for good, and a mix of the two
  deadlocked in one of three relaunches here), so a rank alive but stopped
  inside one of those is not released (a lost peer fails it at once).
* **A rank's own part of each tensor.** Snapshots, state copies between
  replicas and hashes take each DTensor's local shard (:func:`local`); a
  state received that way is put back into DTensors of this rank's mesh
  (:func:`with_specs`, :func:`optimizer_with_specs`).
* **Checkpoints in DCP's format** (:mod:`.dcp`): each shard's saver writes
  its part, the finaliser merges their metadata; any rank loads its part
  of a checkpoint written with any layout DCP can reshard.
* **An abandoned step** (a fault mid-forward or mid-backward) leaves FSDP's
  per-iteration state behind; :func:`reset` clears it before the step runs
  again (``FSDPModule.reset_iter_state``).

torch internals used (torch 2.13): ``FSDPModule._get_fsdp_state()``, its
``_fsdp_param_groups`` and their ``mesh_info`` / ``fsdp_params`` (each
``sharded_param``, ``mesh_info``, ``_unsharded_param`` and
``unsharded_accumulated_grad``), ``_all_gather_result``; c10d's
``_world.pg_group_ranks`` and ``pg_map`` (not ``pg_names``: the groups
named there are the ones ``destroy_process_group`` shuts down).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from trainguard.core import CheckpointError, ConfigError, RecoveryError
from trainguard.core.checkpoint import FileInfo, Verified, io_error, sha256_of

from . import dcp
from .process_group import AbortableProcessGroup
from .sharding import Sharding

__all__ = ["MeshGroups", "backward_hook", "finalize", "is_dcp", "load", "local", "optimizer_with_specs", "reset",
           "with_specs", "write_part"]


class MeshGroups:
    """Abortable groups in place of the device mesh's in FSDP's parameter
    groups (c10d's Python side knows each by its mesh group's ranks and
    backend name).

    Args:
        sharding: the model's layout.
        rank, world_size: this process's place in the job.
        device: the Guard's :class:`~.device.Device`.
        timeout, namespace, generation: as the Guard's own group's.
        first_reduce: called once per :meth:`arm` when FSDP issues the
            step's first gradient reduce-scatter (this rank's gradients
            leave: the moment the DDP hook records the own part).

    Raises:
        ConfigError: FSDP uses a group that is not one of the mesh's (a
            separate reduce-scatter group).
    """

    def __init__(self, sharding: Sharding, rank: int, world_size: int, device: Any, *, timeout: timedelta,
                 namespace: str, generation: int = 0, first_reduce: Callable[[], None] | None = None) -> None:
        mesh = sharding.mesh
        store = dist.distributed_c10d._get_default_store()
        world = dist.distributed_c10d._world
        self.groups: list[AbortableProcessGroup] = []
        swapped: dict[int, AbortableProcessGroup] = {}
        for dim in range(mesh.ndim):
            old = mesh.get_group(dim)
            members = dist.get_process_group_ranks(old)
            new = AbortableProcessGroup(store, rank, world_size, members=members, backend_factory=device.backend,
                                        timeout=timeout, namespace=f"{namespace}/mesh{dim}.{members[0]}",
                                        abort=device.abort, generation=generation)
            # What c10d's Python side looks up by group: a failed collective is logged with its backend's name.
            world.pg_group_ranks[new] = dict(world.pg_group_ranks[old])
            world.pg_map[new] = world.pg_map[old]
            swapped[id(old)] = new
            self.groups.append(new)
        infos = {id(i): i for g in sharding.param_groups for i in
                 (g.mesh_info, g.post_forward_mesh_info, *(p.mesh_info for p in g.fsdp_params)) if i is not None}
        for info in infos.values():
            for attr in ("shard_process_group", "replicate_process_group", "reduce_scatter_process_group"):
                group = getattr(info, attr, None)
                if group is None or any(group is g for g in self.groups):
                    continue
                if id(group) not in swapped:
                    raise ConfigError(f"FSDP's {attr} is not one of the device mesh's groups (a separate "
                                      "reduce-scatter group?): trainguard cannot release it")
                setattr(info, attr, swapped[id(group)])
        self._first_reduce, self._armed = first_reduce, False
        if first_reduce is not None:
            for group in self.groups:
                group.observer = self._observe

    def arm(self) -> None:
        """A step begins: tell ``first_reduce`` of its first reduce-scatter."""
        self._armed = self._first_reduce is not None

    def _observe(self, op: str, args: tuple, work: Any) -> None:
        if self._armed and op.startswith(("_reduce_scatter", "reduce_scatter")):
            self._armed = False
            self._first_reduce()

    @property
    def busy(self) -> bool:
        return any(g.busy for g in self.groups)

    def stop(self, reason: str = "stopped by the controller") -> None:
        for group in self.groups:
            group.stop(reason)

    def rebuild(self, generation: int, cancelled: Callable[[], bool], store: Any = None) -> None:
        """Rebuild every group (every rank in the same order: the mesh's dimensions)."""
        for group in self.groups:
            group.rebuild(generation, cancelled=cancelled, store=store, quiet=True)


def reset(sharding: Sharding) -> None:
    """Clear what an abandoned step left in FSDP (unsharded parameters,
    pending all-gathers and reductions, per-iteration trackers), so the
    step can run again. The abandoned all-gathers' works are dropped
    first: waiting on one released by a STOP would raise. So are the
    gradients the abandoned backward pass left on unsharded parameters
    whose reduce-scatter never ran (the root unit's reduces last): the
    repeated pass would add to them (FSDP's own reset keeps them; a retry
    in the backward pass parted from the fault-free run without this)."""
    for group in sharding.param_groups:
        group._all_gather_result = None
        for param in group.fsdp_params:
            unsharded = getattr(param, "_unsharded_param", None)  # none before the first all-gather
            if unsharded is not None:
                unsharded.grad = None
            param.unsharded_accumulated_grad = None
    state = sharding.root._get_fsdp_state()
    if not state._is_root:  # None before the first forward: nothing ran yet
        return
    if not hasattr(sharding.root, "reset_iter_state"):
        raise RecoveryError(f"torch {torch.__version__} has no FSDPModule.reset_iter_state (torch 2.13 has): a step "
                            "abandoned in FSDP's forward or backward pass cannot be run again in place")
    sharding.root.reset_iter_state()


def backward_hook(sharding: Sharding, strike: Callable[[], None]) -> Any:
    """Call ``strike`` in the middle of every backward pass: when the
    gradient reaches the output of the middle ``fully_shard`` unit (the
    units after it have reduced their gradients, the ones before it not
    yet). A hook on a parameter would never run: FSDP computes with
    unsharded copies. Returns the handle to remove."""
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in sharding.root.modules() if isinstance(m, FSDPModule) and m is not sharding.root]
    unit = units[len(units) // 2] if units else sharding.root

    def on_output(module: Any, args: Any, output: Any) -> None:
        tensor = next((t for t in (output if isinstance(output, (tuple, list)) else (output,))
                       if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if tensor is not None:
            tensor.register_hook(lambda grad: strike())
    return unit.register_forward_hook(on_output)


# ------------------------------------------------------------ local view
def _dtensor() -> type:
    from torch.distributed.tensor import DTensor
    return DTensor


def local(obj: Any) -> Any:
    """``obj`` with each DTensor replaced by its local tensor (same memory)."""
    dtensor = _dtensor()

    def walk(x: Any) -> Any:
        if isinstance(x, dtensor):
            return x._local_tensor
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple):
            return tuple(walk(v) for v in x)
        return x
    return walk(obj)


def _wrap(t: torch.Tensor, like: Any) -> Any:
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(t, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def with_specs(obj: Any, like: Any) -> Any:
    """``obj`` (a state from :func:`local`) with each plain tensor that sits
    where ``like`` holds a DTensor put back into a DTensor of ``like``'s
    mesh, placements and global shape."""
    dtensor = _dtensor()
    if isinstance(like, dtensor) and isinstance(obj, torch.Tensor) and not isinstance(obj, dtensor):
        return _wrap(obj, like)
    if isinstance(obj, dict) and isinstance(like, dict):
        return {k: with_specs(v, like[k]) if k in like else v for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and isinstance(like, (list, tuple)) and len(obj) == len(like):
        return type(obj)(with_specs(v, w) for v, w in zip(obj, like))
    return obj


def optimizer_with_specs(state: dict, optimizer: torch.optim.Optimizer) -> dict:
    """An optimizer's ``state_dict`` from :func:`local`, its per-parameter
    tensors of a DTensor parameter's local shape put back into DTensors of
    that parameter's layout (a fresh optimizer has no state to copy it
    from)."""
    dtensor = _dtensor()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    out = dict(state)
    out["state"] = {}
    for index, values in state.get("state", {}).items():
        p = params[int(index)] if int(index) < len(params) else None
        if isinstance(p, dtensor) and isinstance(values, dict):
            shape = p._local_tensor.shape
            values = {k: _wrap(v, p) if isinstance(v, torch.Tensor) and not isinstance(v, dtensor)
                      and v.dim() and v.shape == shape else v for k, v in values.items()}
        out["state"][index] = values
    return out


# ------------------------------------------------------------ checkpoints
def _dcp_state(train_state: Any, host: dict) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    module, optimizer = train_state.module, train_state.optimizer
    model = get_model_state_dict(module)
    return {"model": model, "optimizer": get_optimizer_state_dict(module, optimizer), "trainguard": {"host": host}}


def write_part(store: Any, step: int, train_state: Any, rank: int) -> list[FileInfo]:
    """Write this saver's part of the committed state at ``step`` into the
    step's temporary directory as DCP files: model, optimizer (both keyed
    by parameter name, as ``get_state_dict`` gives them) and, under
    ``trainguard.host``, the scheduler, scaler, data position and extras.

    Raises:
        CheckpointError: the files could not be written.
    """
    import copy
    snapshot = train_state.snapshot or {}
    state = _dcp_state(train_state, copy.deepcopy(snapshot.get("host", {})))
    model = state["model"]
    for name, saved in snapshot.get("buffers", {}).items():  # as committed: a failed forward may have moved them
        if name in model:
            model[name] = saved
    directory = store.tmp_path(step)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        names = dcp.write_part(directory, state, rank)
        return [FileInfo(n, (directory / n).stat().st_size, sha256_of(directory / n)) for n in names]
    except OSError as e:
        raise io_error(f"writing the DCP part of rank {rank} in {directory}", e) from None


def finalize(store: Any, step: int, shards: Sequence[Any], extra: Sequence[FileInfo], *, world_size: int,
             meta: dict) -> None:
    """Merge the savers' DCP metadata into ``.metadata``, check that the
    checkpoint holds every tensor whole, and finalise it (manifest layout
    ``format: dcp``).

    Raises:
        CheckpointError: a part is missing or unreadable, or the parts do
            not hold every tensor whole.
    """
    directory = store.tmp_path(step)
    files = [f for s in shards for f in s.files]
    try:
        dcp.merge(directory, sorted({s.rank for s in shards}))
        metadata = FileInfo(dcp.METADATA, (directory / dcp.METADATA).stat().st_size,
                            sha256_of(directory / dcp.METADATA))
    except OSError as e:
        raise io_error(f"merging the DCP metadata in {directory}", e) from None
    why = dcp.coverage_problem(directory, [f.name for f in files])
    if why is not None:
        raise CheckpointError(f"step {step} is not saved: its parts do not hold the whole state ({why})")
    # Sizes only: each saver hashed its files as it wrote them, and every load checks the checksums.
    store.finalize(step, files + [metadata] + list(extra),
                   layout={"world_size": world_size, "format": "dcp", "shards": [s.describe() for s in shards]},
                   meta=meta, rehash=False)


def is_dcp(found: Verified) -> bool:
    return found.manifest.get("layout", {}).get("format") == "dcp"


def load(found: Verified, train_state: Any) -> None:
    """Load this rank's part of the DCP checkpoint ``found`` (a sharded
    model its shards, a plain one whole tensors) into the model, the
    optimizer and the host objects.

    Raises:
        CheckpointError: it does not hold every tensor whole, or does not
            fit this state.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    why = dcp.coverage_problem(found.path, list(found.manifest.get("files", {})))
    if why is not None:
        raise CheckpointError(f"{found.path} does not hold the whole state: {why}")
    state = _dcp_state(train_state, {k: v.state_dict() for k, v in train_state.host.items()})
    dcp.read_into(found.path, state)
    module, optimizer = train_state.module, train_state.optimizer
    set_model_state_dict(module, state["model"])
    set_optimizer_state_dict(module, optimizer, state["optimizer"])
    for name, obj in train_state.host.items():
        obj.load_state_dict(state["trainguard"]["host"][name])
