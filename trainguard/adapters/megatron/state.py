"""What a Megatron rank's checkpoint file holds, and putting it back.

:func:`rank_state` is what Megatron-LM's ``save_checkpoint`` puts in
``model_optim_rng.pt``: ``iteration``, ``checkpoint_version``, ``model`` (or
``model0``, ``model1``... per virtual-pipeline chunk), ``optimizer`` (a
distributed optimizer's holds no parameter state: that is in its shards,
:mod:`.kinds`), ``opt_param_scheduler`` and ``rng_state``. :func:`apply`
loads one back.
"""

from __future__ import annotations

import random
import sys
from typing import Any, Mapping

import torch

from trainguard.core import CheckpointError

from .kinds import apply_shard, sharded_kinds

__all__ = ["CHECKPOINT_VERSION", "apply", "chunks", "load_scheduler", "rank_state", "rng_state", "set_rng_state"]

CHECKPOINT_VERSION = 3.0


def chunks(model: Any) -> list[torch.nn.Module]:
    """The model chunks, unwrapped: DDP (torch's, megatron's) and megatron's
    Float16Module hold the model in ``.module``."""
    out = []
    for m in list(model) if isinstance(model, (list, tuple)) else [model]:
        while isinstance(getattr(m, "module", None), torch.nn.Module):
            m = m.module
        out.append(m)
    return out


def rng_state() -> dict:
    """This process's random streams, under Megatron-LM's keys. NumPy's
    global stream (when NumPy is loaded) is held as tensors and scalars, so
    the file still loads with ``torch.load(weights_only=True)``."""
    state = {"random_rng_state": random.getstate(), "torch_rng_state": torch.get_rng_state()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["np_rng_state"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss),
                                 float(cached))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
        from megatron.core import tensor_parallel

        state["rng_tracker_states"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def set_rng_state(state: dict) -> None:
    cpu = lambda t: t.cpu() if torch.is_tensor(t) else t  # noqa: E731 (generator states are host tensors)
    random.setstate(state["random_rng_state"])
    torch.set_rng_state(cpu(state["torch_rng_state"]))
    if "np_rng_state" in state:
        import numpy

        name, keys, pos, has_gauss, cached = state["np_rng_state"]
        keys = cpu(keys).numpy() if torch.is_tensor(keys) else numpy.asarray(keys)  # Megatron-LM's: an array
        numpy.random.set_state((name, keys.astype(numpy.uint32), int(pos), int(has_gauss), float(cached)))
    if "cuda_rng_state" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(cpu(state["cuda_rng_state"]))
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states({k: cpu(v) for k, v in state["rng_tracker_states"].items()})


def rank_state(iteration: int, model: Any, optimizer: Any, scheduler: Any, *, rng: dict | None = None) -> dict:
    """What Megatron-LM's ``save_checkpoint`` puts in ``model_optim_rng.pt``;
    ``rng``: the random streams as they were at ``iteration`` (default:
    as they are now)."""
    parts = chunks(model)
    state: dict = {"iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION}
    if len(parts) == 1:
        state["model"] = parts[0].state_dict()
    else:
        state.update({f"model{i}": m.state_dict() for i, m in enumerate(parts)})
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    state["rng_state"] = [rng if rng is not None else rng_state()]
    return state


def load_scheduler(scheduler: Any, state: dict) -> None:
    if hasattr(scheduler, "num_steps"):  # megatron's load_state_dict steps on from where it stands
        scheduler.num_steps = 0
    scheduler.load_state_dict(state)


def _grad_scalers(optimizer: Any, state: Any) -> None:
    """The grad scaler in megatron's ``optimizer.state_dict()`` (one per
    optimizer of a chain: a list of their state dicts)."""
    opts = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    states = state if isinstance(state, list) else [state]
    for opt, saved in zip(opts, states):
        if getattr(opt, "grad_scaler", None) is not None and isinstance(saved, dict) and "grad_scaler" in saved:
            opt.grad_scaler.load_state_dict(saved["grad_scaler"])


def apply(state: dict, shards: Mapping[int, dict], model: Any, optimizer: Any, scheduler: Any, *,
          where: Any) -> None:
    """Put a rank's state (:func:`rank_state`'s) and, with a distributed
    optimizer, its shard of each kind, read from ``where``, into the
    objects, and set the random number generators.

    Raises:
        CheckpointError: they do not fit the objects.
    """
    parts = chunks(model)
    keys = ["model"] if len(parts) == 1 else [f"model{i}" for i in range(len(parts))]
    try:
        for key, chunk in zip(keys, parts):
            chunk.load_state_dict(state[key])
        sharded = sharded_kinds(optimizer)
        if sharded:
            for kind in sharded:
                if kind not in shards:
                    raise CheckpointError(f"{where} holds no {'expert' if kind else 'dense'} shard of a "
                                          f"distributed optimizer (saved without one?)")
                apply_shard(shards[kind], optimizer, str(where))
            _grad_scalers(optimizer, state["optimizer"])
        elif optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None:
            load_scheduler(scheduler, state["opt_param_scheduler"])
    except (KeyError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"{where} does not fit the model/optimizer: {e}") from None
    set_rng_state(state["rng_state"][0])
