"""Megatron's checkpoint layout, written so that a reader never sees it half done.

A checkpoint is Megatron-LM's ``torch`` format: ``iter_{:07d}/`` holding one
``mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt`` per model-parallel
rank (``iteration``, ``checkpoint_version``, ``model`` or ``model0``,
``model1``... per virtual-pipeline chunk, ``optimizer``,
``opt_param_scheduler``, ``rng_state``), and ``latest_checkpointed_iteration.txt``
beside it. trainguard writes it through :class:`~trainguard.core.CheckpointStore`:
under ``iter_{:07d}_tmp`` first, with every file's SHA-256 in
``manifest.json``, renamed and tracked by one rank; loading verifies the
manifest and falls back to the newest complete checkpoint.

Only one rank per data-parallel group writes each file (any replica holds
the same state), so the dying gasp, where one rank is gone, writes the same
files as a periodic save. With experts (MoE), each rank's file holds its
dense and its expert parameters, so one copy per expert data-parallel group
writes it (``mp_rank_TT_EEE``: one file per expert-parallel rank) and the
dense saves write nothing more. With megatron's distributed optimizer (kept in
``r`` instances: :mod:`.optimizer`) the parameter state is sharded: one copy
of each shard ``j`` writes ``distrib_optim_shard_{j:03d}.pt`` beside
``model_optim_rng.pt`` (the fp32 main parameters and the inner optimizer's
``state_dict``, for that shard alone; written by shard 0's saver, the
model file carries megatron's ``optimizer.state_dict()``, as Megatron-LM's
does). No collective is needed, so a job with a dead rank can write it; it
loads back into the same data-parallel and instance layout. Megatron's ``torch_dist`` format is not used: its
save is a collective of the whole world, which a job with a lost rank
cannot run.
"""

from __future__ import annotations

import logging
import random
import sys
from typing import Any, Sequence

import torch
import torch.distributed as dist

from trainguard.core import CheckpointError, CheckpointStore
from trainguard.core.checkpoint import MEGATRON, FileInfo, SavedShard, Verified

from .layout import ParallelRank, parallel_rank

__all__ = ["FILE", "apply_shard", "load", "megatron_store", "parallel_rank_or_world", "rank_state", "save", "shard_file",
           "write_rank"]

log = logging.getLogger("trainguard.megatron")

FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
SHARD_FORMAT = "trainguard-distrib-optim-1"


def shard_file(index: int) -> str:
    return f"distrib_optim_shard_{index:03d}.pt"


def megatron_store(root) -> CheckpointStore:
    return CheckpointStore(root, MEGATRON)


def _chunks(model: Any) -> list[torch.nn.Module]:
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    out = []
    for m in chunks:  # DDP (torch's, megatron's) and megatron's Float16Module wrap the model in .module
        while isinstance(getattr(m, "module", None), torch.nn.Module):
            m = m.module
        out.append(m)
    return out


def _distributed(optimizer: Any) -> list:
    """The distributed optimizers inside ``optimizer`` (megatron chains one per
    parameter kind); empty for a dense optimizer."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer]) if optimizer is not None else []
    found = [o for o in inner if any(c.__name__ == "DistributedOptimizer" for c in type(o).__mro__)]
    if found and len(found) != len(inner):
        raise CheckpointError("a chain of distributed and dense optimizers (MoE experts?) is not supported by the "
                              "sharded save yet")
    return found


def _shard() -> tuple[int, int, int]:
    """(shard index, data-parallel size, instances) of this rank's distributed-optimizer state."""
    from megatron.core import parallel_state as ps

    size = ps.get_data_parallel_world_size(with_context_parallel=True)
    intra = ps.get_data_parallel_world_size(with_context_parallel=True, partial_data_parallel=True)
    return ps.get_data_parallel_rank(with_context_parallel=True, partial_data_parallel=True), size, size // intra


def _mains(opt: Any) -> list[torch.Tensor]:
    return [p for g in opt.optimizer.param_groups for p in g["params"]]


def shard_state(optimizer: Any) -> dict:
    """This rank's shard of a distributed optimizer: the fp32 main parameters
    (copied: some are views into the whole parameter buffer) and the inner
    optimizer's state, per optimizer in the chain."""
    index, size, instances = _shard()
    return {"format": SHARD_FORMAT, "shard": index, "data_parallel": size, "instances": instances,
            "optimizers": [{"main": [p.detach().clone() for p in _mains(o)], "inner": o.optimizer.state_dict()}
                           for o in _distributed(optimizer)]}


def apply_shard(state: dict, optimizer: Any, source: str) -> None:
    """Put a shard (:func:`shard_state`'s, from ``source``: a file, a
    replica) into this rank's distributed optimizer.

    Raises:
        CheckpointError: it is another rank's shard, or does not fit.
    """
    index, size, instances = _shard()
    if state.get("format") != SHARD_FORMAT or (state.get("shard"), state.get("data_parallel"),
                                               state.get("instances")) != (index, size, instances):
        raise CheckpointError(f"{source} holds shard {state.get('shard')} of {state.get('data_parallel')} "
                              f"ranks in {state.get('instances')} instances; this rank holds shard {index} of "
                              f"{size} in {instances}: load it with the layout it was saved with")
    opts = _distributed(optimizer)
    if len(state["optimizers"]) != len(opts):
        raise CheckpointError(f"{source} holds {len(state['optimizers'])} optimizers, the chain here has {len(opts)}")
    with torch.no_grad():
        for saved, opt in zip(state["optimizers"], opts):
            mains = _mains(opt)
            if [tuple(t.shape) for t in saved["main"]] != [tuple(p.shape) for p in mains]:
                raise CheckpointError(f"{source}: the shard's main parameters do not fit this model")
            for p, t in zip(mains, saved["main"]):
                p.copy_(t)
            opt.optimizer.load_state_dict(saved["inner"])


def _rng_state() -> dict:
    state = {"random_rng_state": random.getstate(), "torch_rng_state": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
        from megatron.core import tensor_parallel

        state["rng_tracker_states"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict) -> None:
    cpu = lambda t: t.cpu() if torch.is_tensor(t) else t  # noqa: E731 (generator states are host tensors)
    random.setstate(state["random_rng_state"])
    torch.set_rng_state(cpu(state["torch_rng_state"]))
    if "cuda_rng_state" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(cpu(state["cuda_rng_state"]))
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states({k: cpu(v) for k, v in state["rng_tracker_states"].items()})


def rank_state(iteration: int, model: Any, optimizer: Any, scheduler: Any) -> dict:
    """What Megatron-LM's ``save_checkpoint`` puts in ``model_optim_rng.pt``."""
    chunks = _chunks(model)
    state: dict = {"iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION}
    if len(chunks) == 1:
        state["model"] = chunks[0].state_dict()
    else:
        state.update({f"model{i}": m.state_dict() for i, m in enumerate(chunks)})
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()  # a distributed optimizer's holds no parameter state
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    state["rng_state"] = [_rng_state()]
    return state


def parallel_rank_or_world() -> ParallelRank:
    """This rank's place in megatron's layout, or plain data parallelism over
    the world when parallel_state is not initialised."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        return parallel_rank()
    world = tuple(range(dist.get_world_size())) if dist.is_initialized() else (0,)
    return ParallelRank(0, 0, 0, 1, 1, 1, world, world)


def write_rank(store: CheckpointStore, step: int, model: Any, optimizer: Any, scheduler: Any, *,
               kind: int = 0) -> list[FileInfo]:
    """Write this rank's files of ``step`` under the temporary name, as the
    saver of a ``kind`` shard (0: dense, 1: experts): the model file, and
    with a distributed optimizer this rank's shard file (the model file only
    from shard 0's saver). With experts the dense saver writes nothing: the
    expert savers' files hold the dense state too."""
    here, files = parallel_rank_or_world(), []
    subdir = here.subdir
    sharded = bool(_distributed(optimizer))
    if here.moe:
        if sharded:
            raise CheckpointError("saving the shards of a distributed optimizer with experts (MoE) is not "
                                  "implemented yet; a dense optimizer with experts is")
        if kind == 0:
            return []
    if not sharded or _shard()[0] == 0:
        state = rank_state(step, model, optimizer, scheduler)
        files.append(store.write(step, f"{subdir}/{FILE}", lambda f: torch.save(state, f)))
    if sharded:
        shard = shard_state(optimizer)
        files.append(store.write(step, f"{subdir}/{shard_file(shard['shard'])}", lambda f: torch.save(shard, f)))
    return files


def finalize(store: CheckpointStore, step: int, shards: Sequence[SavedShard], history: dict, rank: int) -> None:
    store.finalize(step, [f for s in shards for f in s.files],
                   layout={"world_size": dist.get_world_size() if dist.is_initialized() else 1,
                           "shards": [s.describe() for s in shards]},
                   meta={"history": history, "finalised_by": rank})


def saved_copies(here: ParallelRank, optimizer: Any) -> list[list[int]]:
    """The copies of each shard of this rank's group that a save writes
    (its first rank saves it): with a dense optimizer the data-parallel
    group (the expert data-parallel group with experts), with a distributed
    optimizer each shard's ranks."""
    if not _distributed(optimizer):
        return [list(here.expert_dp_ranks if here.moe else here.dp_cp_ranks)]
    _, size, instances = _shard()
    span = size // instances  # megatron's instances are contiguous blocks of the group
    return [list(here.dp_cp_ranks[j::span]) for j in range(span)]


def save(store: CheckpointStore, step: int, model: Any, optimizer: Any, scheduler: Any, *,
         history: dict | None = None) -> None:
    """A periodic save (every rank calls it): one copy of each shard writes
    it (with a dense optimizer the first rank of each data-parallel group,
    of each expert data-parallel group with experts), rank 0 finalises."""
    here, rank = parallel_rank_or_world(), dist.get_rank()
    sharded = bool(_distributed(optimizer))
    mine = next(({"copies": c, "files": []} for c in saved_copies(here, optimizer) if c[0] == rank), None)
    if mine is not None:
        files = write_rank(store, step, model, optimizer, scheduler, kind=1 if here.moe else 0)
        mine["files"] = [[f.name, f.bytes, f.sha256] for f in files]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        shards = [SavedShard(kind=1 if here.moe else 0, copies=tuple(s["copies"]), full=not sharded,
                             rank=s["copies"][0],
                             files=tuple(FileInfo(*f) for f in s["files"])) for s in gathered if s]
        finalize(store, step, shards, history or {}, rank)
    dist.barrier()


def load(store: CheckpointStore, model: Any, optimizer: Any, scheduler: Any, *,
         device: torch.device | str = "cpu") -> tuple[int, dict]:
    """Load the newest complete checkpoint into the objects; every rank must
    find the same one. Returns ``(iteration, history)``, ``(0, {})`` when
    there is none.

    Raises:
        CheckpointError: ranks disagree, this rank's file is missing, or it
            does not fit the objects.
    """
    found = store.latest()
    step = found.step if found is not None else 0
    if dist.is_initialized():
        steps: list = [None] * dist.get_world_size()
        dist.all_gather_object(steps, step)
        if len(set(steps)) != 1:
            raise CheckpointError(f"ranks disagree on the newest complete checkpoint: {steps}")
    if found is None:
        return 0, {}
    load_found(found, model, optimizer, scheduler, device=device)
    return found.step, found.manifest.get("meta", {}).get("history", {})


def _read_pt(path: Any, device: Any) -> dict:
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path} could not be loaded safely: {e}") from None


def load_found(found: Verified, model: Any, optimizer: Any, scheduler: Any, *,
               device: torch.device | str = "cpu") -> None:
    """Load this rank's part of the verified checkpoint ``found`` into the
    objects (no collective): its saver's persisted snapshot
    (``.safetensors``, see :mod:`.snapshot`) where there is one, else
    Megatron's ``.pt`` files.

    Raises:
        CheckpointError: this rank's file is missing, or does not fit the objects.
    """
    from .snapshot import read_file, snapshot_file  # built on this module

    here, files = parallel_rank_or_world(), found.manifest.get("files", {})
    index = _shard()[0] if _distributed(optimizer) else None
    name, snapshot = f"{here.subdir}/{FILE}", snapshot_file(here.subdir, index)
    if snapshot in files:
        where = found.file(snapshot)
        state, shard = read_file(where, device)
    elif name in files:
        where, shard = found.file(name), None
        state = _read_pt(where, device)
        if index is not None:
            shard_name = f"{here.subdir}/{shard_file(index)}"
            if shard_name not in files:
                raise CheckpointError(f"{found.path} has no {shard_name} (saved without a distributed optimizer, "
                                      f"or with another layout?)")
            shard = _read_pt(found.file(shard_name), device)
    else:
        raise CheckpointError(f"{found.path} has no {name} (saved with another parallel layout?)")
    if state.get("iteration") != found.step:
        raise CheckpointError(f"{where} holds iteration {state.get('iteration')}, not {found.step}")
    apply(state, shard, model, optimizer, scheduler, where=where)
    log.info("loaded %s at iteration %d", found.path, found.step)


def apply(state: dict, shard: dict | None, model: Any, optimizer: Any, scheduler: Any, *, where: Any) -> None:
    """Put a rank's state (:func:`rank_state`'s) and, with a distributed
    optimizer, its shard (:func:`shard_state`'s), both read from ``where``,
    into the objects, and set the random number generators.

    Raises:
        CheckpointError: they do not fit the objects.
    """
    chunks = _chunks(model)
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    try:
        for key, chunk in zip(keys, chunks):
            chunk.load_state_dict(state[key])
        if _distributed(optimizer):
            if shard is None:
                raise CheckpointError(f"{where} holds no shard of a distributed optimizer (saved without one?)")
            apply_shard(shard, optimizer, str(where))
            if getattr(optimizer, "grad_scaler", None) is not None and "grad_scaler" in state["optimizer"]:
                optimizer.grad_scaler.load_state_dict(state["optimizer"]["grad_scaler"])
        elif optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None:
            if hasattr(scheduler, "num_steps"):  # megatron's load_state_dict steps on from where it stands
                scheduler.num_steps = 0
            scheduler.load_state_dict(state["opt_param_scheduler"])
    except (KeyError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"{where} does not fit the model/optimizer: {e}") from None
    _set_rng_state(state["rng_state"][0])
