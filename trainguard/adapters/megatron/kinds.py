"""The two kinds of a Megatron rank's state, and the distributed optimizer's shards of each.

Kind 0 (dense) has its copies in the data-parallel x context-parallel group;
kind 1 (experts, MoE) in the expert data-parallel group. megatron-core marks
an expert parameter with ``allreduce=False`` and builds one optimizer per
kind, chained (``ChainedOptimizer.chained_optimizers``), each knowing its
kind from its param groups' ``is_expert_parallel``.

With megatron's distributed optimizer each kind's optimizer shards its state
(fp32 main parameters, moments) across that kind's group, cut into
``num_distributed_optimizer_instances`` contiguous instances: the dense
optimizer across ``get_data_parallel_group(with_context_parallel=True,
partial_data_parallel=True)``, the expert optimizer across
``get_expert_data_parallel_group(partial_expert_data_parallel=True)``.
:func:`shard_state` and :func:`apply_shard` carry one kind's shard.
"""

from __future__ import annotations

from typing import Any

import torch

from trainguard.core import CheckpointError

__all__ = ["DENSE", "EXPERT", "apply_shard", "distributed", "expert_keys", "is_expert", "kind_of", "mains",
           "members", "shard_of", "shard_state", "sharded_kinds"]

DENSE, EXPERT = 0, 1
SHARD_FORMAT = "trainguard-distrib-optim-2"
_DENSE_ONLY_FORMAT = "trainguard-distrib-optim-1"  # before experts were sharded: the dense shard, no kind


def is_expert(param: torch.Tensor) -> bool:
    return not getattr(param, "allreduce", True)


def expert_keys(chunk: torch.nn.Module) -> set[str]:
    """The ``state_dict`` keys of ``chunk`` that are expert state: its expert
    parameters, and the buffers and extra state of modules whose own
    parameters are all expert parameters."""
    keys: set[str] = set()
    for prefix, module in chunk.named_modules():
        own = dict(module.named_parameters(recurse=False))
        experts = {n for n, p in own.items() if is_expert(p)}
        if not experts:
            continue
        dot = f"{prefix}." if prefix else ""
        keys |= {dot + n for n in experts}
        if len(experts) == len(own):  # an expert module: its buffers and extra state go with it
            keys |= {dot + k for k in module.state_dict(keep_vars=True) if "." not in k}
    return keys


def kind_of(optimizer: Any) -> int | None:
    """The kind of a megatron optimizer (one of a chain): from its param
    groups' ``is_expert_parallel``; ``None`` when its groups mix kinds or
    it has no param groups of its own."""
    groups = getattr(getattr(optimizer, "optimizer", None), "param_groups", None)
    if groups is None:
        return None
    flags = {bool(g.get("is_expert_parallel", False)) for g in groups}
    return (EXPERT if flags == {True} else DENSE) if len(flags) == 1 else None


def members(optimizer: Any) -> list:
    """The optimizers of megatron's chain (the optimizer itself when it is no chain)."""
    if optimizer is None:
        return []
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(optimizer: Any) -> bool:
    return any(c.__name__ == "DistributedOptimizer" for c in type(optimizer).__mro__)


def distributed(optimizer: Any, kind: int | None = None) -> list:
    """The distributed optimizers inside ``optimizer`` (of ``kind``, or
    all); empty for a dense optimizer.

    Raises:
        CheckpointError: the chain mixes distributed and dense optimizers,
            or a distributed optimizer's param groups mix kinds.
    """
    inner = members(optimizer)
    found = [o for o in inner if _is_distributed(o)]
    if found and len(found) != len(inner):
        raise CheckpointError("a chain of distributed and dense optimizers is not supported: build every one "
                              "with use_distributed_optimizer=True")
    if kind is None:
        return found
    kinds = [kind_of(o) for o in found]
    if None in kinds:
        raise CheckpointError("a distributed optimizer whose param groups mix dense and expert parameters")
    return [o for o, k in zip(found, kinds) if k == kind]


def sharded_kinds(optimizer: Any) -> list[int]:
    """The kinds whose state a distributed optimizer shards, in order."""
    return [k for k in (DENSE, EXPERT) if distributed(optimizer, k)]


def shard_of(kind: int) -> tuple[int, int, int]:
    """(shard index, group size, instances) of this rank's ``kind`` shard."""
    from megatron.core import parallel_state as ps

    if kind == DENSE:
        size = ps.get_data_parallel_world_size(with_context_parallel=True)
        intra = ps.get_data_parallel_world_size(with_context_parallel=True, partial_data_parallel=True)
        index = ps.get_data_parallel_rank(with_context_parallel=True, partial_data_parallel=True)
    else:
        size = ps.get_expert_data_parallel_world_size()
        intra = ps.get_expert_data_parallel_world_size(partial_expert_data_parallel=True)
        index = ps.get_expert_data_parallel_rank(partial_expert_data_parallel=True)
    return index, size, size // intra


def mains(optimizer: Any) -> list[torch.Tensor]:
    return [p for g in optimizer.optimizer.param_groups for p in g["params"]]


def shard_state(optimizer: Any, kind: int = DENSE) -> dict:
    """This rank's ``kind`` shard of a distributed optimizer: the fp32 main
    parameters (copied: some are views into the whole parameter buffer) and
    the inner optimizer's state, per optimizer of that kind in the chain."""
    index, size, instances = shard_of(kind)
    return {"format": SHARD_FORMAT, "kind": kind, "shard": index, "data_parallel": size, "instances": instances,
            "optimizers": [{"main": [p.detach().clone() for p in mains(o)], "inner": o.optimizer.state_dict()}
                           for o in distributed(optimizer, kind)]}


def apply_shard(state: dict, optimizer: Any, source: str) -> None:
    """Put a shard (:func:`shard_state`'s, from ``source``: a file, a
    replica) into this rank's distributed optimizer.

    Raises:
        CheckpointError: it is another rank's shard, or does not fit.
    """
    kind = DENSE if state.get("format") == _DENSE_ONLY_FORMAT else state.get("kind")
    if state.get("format") not in (SHARD_FORMAT, _DENSE_ONLY_FORMAT) or kind not in (DENSE, EXPERT):
        raise CheckpointError(f"{source} holds no shard of a distributed optimizer in trainguard's format "
                              f"{SHARD_FORMAT!r} (format {state.get('format')!r})")
    here = shard_of(kind)
    saved = (state.get("shard"), state.get("data_parallel"), state.get("instances"))
    if saved != here:
        name = "expert" if kind == EXPERT else "dense"
        raise CheckpointError(f"{source} holds {name} shard {saved[0]} of {saved[1]} ranks in {saved[2]} "
                              f"instances; this rank holds shard {here[0]} of {here[1]} in {here[2]}: load it "
                              f"with the layout it was saved with")
    opts = distributed(optimizer, kind)
    if len(state["optimizers"]) != len(opts):
        raise CheckpointError(f"{source} holds {len(state['optimizers'])} optimizers of kind {kind}, the chain "
                              f"here has {len(opts)}")
    with torch.no_grad():
        for saved_opt, opt in zip(state["optimizers"], opts):
            params = mains(opt)
            if [tuple(t.shape) for t in saved_opt["main"]] != [tuple(p.shape) for p in params]:
                raise CheckpointError(f"{source}: the shard's main parameters do not fit this model")
            for p, t in zip(params, saved_opt["main"]):
                p.copy_(t)
            opt.optimizer.load_state_dict(saved_opt["inner"])

