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
files as a periodic save. Megatron's ``torch_dist`` format is not used: its
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
from trainguard.core.checkpoint import MEGATRON, FileInfo, SavedShard

from .layout import ParallelRank, parallel_rank

__all__ = ["FILE", "load", "megatron_store", "rank_state", "save", "write_rank"]

log = logging.getLogger("trainguard.megatron")

FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0


def megatron_store(root) -> CheckpointStore:
    return CheckpointStore(root, MEGATRON)


def _chunks(model: Any) -> list[torch.nn.Module]:
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    return [getattr(m, "module", m) for m in chunks]  # torch / megatron DDP wrap the model in .module


def _refuse_sharded(optimizer: Any) -> None:
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    if any(type(o).__name__ in ("DistributedOptimizer", "ReplicatedOptimizer") for o in inner):
        raise CheckpointError("saving a distributed optimizer's shards in Megatron's layout is not implemented yet "
                              "(a dense optimizer is); see the README's Megatron section")


def _rng_state() -> dict:
    state = {"random_rng_state": random.getstate(), "torch_rng_state": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
        from megatron.core import tensor_parallel

        state["rng_tracker_states"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if "cuda_rng_state" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def rank_state(iteration: int, model: Any, optimizer: Any, scheduler: Any) -> dict:
    """What Megatron-LM's ``save_checkpoint`` puts in ``model_optim_rng.pt``."""
    chunks = _chunks(model)
    state: dict = {"iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION}
    if len(chunks) == 1:
        state["model"] = chunks[0].state_dict()
    else:
        state.update({f"model{i}": m.state_dict() for i, m in enumerate(chunks)})
    if optimizer is not None:
        _refuse_sharded(optimizer)
        state["optimizer"] = optimizer.state_dict()
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    state["rng_state"] = [_rng_state()]
    return state


def _here() -> ParallelRank:
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        return parallel_rank()
    world = tuple(range(dist.get_world_size())) if dist.is_initialized() else (0,)
    return ParallelRank(0, 0, 0, 1, 1, 1, world, world)


def write_rank(store: CheckpointStore, step: int, model: Any, optimizer: Any, scheduler: Any) -> FileInfo:
    """Write this rank's file of ``step`` under the temporary name."""
    state = rank_state(step, model, optimizer, scheduler)
    return store.write(step, f"{_here().subdir}/{FILE}", lambda f: torch.save(state, f))


def finalize(store: CheckpointStore, step: int, shards: Sequence[SavedShard], history: dict, rank: int) -> None:
    store.finalize(step, [f for s in shards for f in s.files],
                   layout={"world_size": dist.get_world_size() if dist.is_initialized() else 1,
                           "shards": [s.describe() for s in shards]},
                   meta={"history": history, "finalised_by": rank})


def save(store: CheckpointStore, step: int, model: Any, optimizer: Any, scheduler: Any, *,
         history: dict | None = None) -> None:
    """A periodic save (every rank calls it): the first rank of each
    data-parallel group writes its file, rank 0 finalises."""
    here, rank = _here(), dist.get_rank()
    mine = None
    if rank == min(here.dp_cp_ranks):
        info = write_rank(store, step, model, optimizer, scheduler)
        mine = {"copies": list(here.dp_cp_ranks), "file": [info.name, info.bytes, info.sha256]}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        shards = [SavedShard(kind=0, copies=tuple(s["copies"]), full=True, rank=min(s["copies"]),
                             files=(FileInfo(*s["file"]),)) for s in gathered if s]
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
    name = f"{_here().subdir}/{FILE}"
    if name not in found.manifest.get("files", {}):
        raise CheckpointError(f"{found.path} has no {name} (saved with another parallel layout?)")
    try:
        state = torch.load(found.file(name), map_location=device, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{found.file(name)} could not be loaded safely: {e}") from None
    if state.get("iteration") != found.step:
        raise CheckpointError(f"{found.file(name)} holds iteration {state.get('iteration')}, not {found.step}")
    chunks = _chunks(model)
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    try:
        for key, chunk in zip(keys, chunks):
            chunk.load_state_dict(state[key])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(state["opt_param_scheduler"])
    except (KeyError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"{found.file(name)} does not fit the model/optimizer: {e}") from None
    _set_rng_state(state["rng_state"][0])
    log.info("loaded %s at iteration %d", found.path, found.step)
    return found.step, found.manifest.get("meta", {}).get("history", {})
