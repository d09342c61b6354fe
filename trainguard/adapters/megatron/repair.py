"""In-place recovery of a Megatron rank: clean, copy from a replica, roll back.

After a device memory error (UCE) or a communication fault the job goes on
without a restart: every rank drops the step it was in (:func:`clean`), a
rank whose state is lost receives it from data-parallel replicas that
completed the same step (:func:`send_replica` / :func:`receive_replica`),
and every rank puts back its random-number streams of that step
(:class:`RngHistory`), so the step is redone exactly as it would have run:
as they were when the rank committed the step or, on a rank caught inside
its update to that step (repaired from a replica that committed it), as
they were when that update began.

What travels: each model chunk's parameters and buffers, the optimizer's
state (with megatron's distributed optimizer: this rank's shard -- the fp32
main parameters and the inner optimizer's state -- which the replica holds
because it sits at the same place in another optimizer instance; and the
grad scaler's state) and the learning-rate scheduler's state. The
replicas' random streams are their own, so they do not travel.

With experts (MoE) a rank's state comes in two transfers, one per kind
(:mod:`.kinds`), from different ranks: the dense state from a replica in
the data-parallel group (which holds other experts), the expert state from
one in the expert data-parallel group. Each carries only its kind: the
model entries (expert parameters are megatron's ``allreduce=False`` ones),
the optimizers of that kind in megatron's chain -- or, for one torch
optimizer over the whole model, the state of that kind's parameters -- and
with a distributed optimizer that kind's shard. The scheduler travels with
the dense state.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch

from trainguard.core import CheckpointError, RecoveryError
from trainguard.core.rank.recovery import CLEAN_FAILED, CLEAN_OK

from ..torch.state import recv_state, send_state
from .kinds import DENSE, EXPERT, apply_shard, distributed, expert_keys, is_expert, kind_of, mains, members, \
    shard_state, sharded_kinds
from .state import chunks, load_scheduler, rng_state, set_rng_state

__all__ = ["RngHistory", "clean", "receive_replica", "send_replica"]

log = logging.getLogger("trainguard.megatron")


def clean(model: Any, optimizer: Any, uce: bool = False) -> int:
    """Drop the step in progress: gradients (megatron's grad buffers too).
    On the rank of a memory error (``uce``) the model and optimizer state is
    overwritten (NaN, zeros), as a device reset leaves it: only the copy
    from a replica makes it right again, never a stale value that happens
    to survive. ``CLEAN_FAILED`` when the GPU no longer runs work (a real
    uncorrectable error poisons the CUDA context: only a new process can
    recover)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        try:
            torch.cuda.synchronize()
        except RuntimeError as e:
            log.error("the GPU cannot run work any more (%s): this rank cannot be repaired in place", e)
            return CLEAN_FAILED
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        zero = getattr(chunk, "zero_grad_buffer", None)  # megatron's DDP
        if zero is not None:
            zero()
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    if uce:
        with torch.no_grad():
            for t in _device_state(model, optimizer):
                t.fill_(float("nan")) if t.is_floating_point() else t.zero_()
        log.warning("the state on this rank's device is discarded: it waits for a replica's copy")
    return CLEAN_OK


def _inner(optimizer: Any) -> list:
    """The torch optimizers holding the state (megatron's wrap theirs in ``.optimizer``)."""
    return [getattr(m, "optimizer", m) for m in members(optimizer)]


def _device_state(model: Any, optimizer: Any) -> list[torch.Tensor]:
    """The tensors themselves (not copies) of the model and optimizer state."""
    tensors = [t for c in chunks(model) for t in c.state_dict(keep_vars=True).values() if torch.is_tensor(t)]
    tensors += [p for o in distributed(optimizer) for p in mains(o)]
    tensors += [t for inner in _inner(optimizer) for s in inner.state.values() for t in s.values()
                if torch.is_tensor(t)]
    return [t.detach() for t in tensors]


# ------------------------------------------------------------- one kind of a torch optimizer's state
def _params(optimizer: Any) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _indices(optimizer: Any, kind: int) -> list[int]:
    """The ``state_dict`` indices of one torch optimizer's parameters of ``kind``."""
    return [i for i, p in enumerate(_params(optimizer)) if is_expert(p) == (kind == EXPERT)]


def _param_states(optimizer: Any, kind: int) -> dict:
    """The state of ``kind``'s parameters in one torch optimizer (keyed by
    their index, as ``state_dict`` keys them), and its param groups."""
    state = optimizer.state_dict()
    mine = _indices(optimizer, kind)
    return {"indices": mine, "state": {i: state["state"][i] for i in mine if i in state["state"]},
            "param_groups": state["param_groups"]}


def _load_param_states(optimizer: Any, kind: int, got: dict) -> None:
    state = optimizer.state_dict()
    mine = _indices(optimizer, kind)
    if got["indices"] != mine:
        raise RecoveryError(f"the replica's optimizer has parameters {got['indices'][:8]} of this kind, this rank "
                            f"{mine[:8]}")
    for i in mine:
        if i in got["state"]:
            state["state"][i] = got["state"][i]
        else:
            state["state"].pop(i, None)
    if kind == DENSE:
        state["param_groups"] = got["param_groups"]
    optimizer.load_state_dict(state)


# ------------------------------------------------------------- transfers
def _own_keys(chunk: torch.nn.Module, kind: int | None) -> set[str]:
    keys = set(chunk.state_dict(keep_vars=True))
    if kind is None:
        return keys
    experts = expert_keys(chunk)
    return experts & keys if kind == EXPERT else keys - experts


def _scalers(optimizer: Any, kind: int | None) -> list:
    """The grad scalers of the chain's optimizers of ``kind`` (all: ``None``)."""
    return [o.grad_scaler for o in members(optimizer) if getattr(o, "grad_scaler", None) is not None
            and (kind is None or kind_of(o) == kind)]


def _state(model: Any, optimizer: Any, scheduler: Any, kind: int | None) -> dict:
    """What a transfer carries: the whole state (``kind`` None: no experts)
    or one kind of it."""
    state: dict = {"kind": kind, "model": []}
    for c in chunks(model):
        own = _own_keys(c, kind)
        state["model"].append({k: v for k, v in c.state_dict().items() if k in own})
    sharded = sharded_kinds(optimizer)
    opts = members(optimizer)
    if sharded:
        state["shards"] = [shard_state(optimizer, k) for k in sharded if kind is None or k == kind]
        state["grad_scalers"] = [scaler.state_dict() for scaler in _scalers(optimizer, kind)]
    elif kind is None:
        state["optimizer"] = optimizer.state_dict() if optimizer is not None else None
    elif len(opts) > 1 or kind_of(optimizer) is not None:  # megatron's chain: one optimizer per kind
        state["optimizers"] = [o.state_dict() for o in opts if kind_of(o) == kind]
    elif optimizer is not None:  # one torch optimizer over both kinds
        state["param_states"] = _param_states(optimizer, kind)
    if scheduler is not None and kind in (None, DENSE):
        state["scheduler"] = scheduler.state_dict()
    return state


def send_replica(group: Any, dst: int, model: Any, optimizer: Any, scheduler: Any, *,
                 device: torch.device, kind: int | None = None) -> None:
    """Send this rank's state to ``dst`` (its number in ``group``): all of
    it (``kind`` None), or its dense or expert state."""
    send_state(group, _state(model, optimizer, scheduler, kind), dst, device=device)


def receive_replica(group: Any, src: int, model: Any, optimizer: Any, scheduler: Any, *,
                    device: torch.device, kind: int | None = None) -> None:
    """Replace this rank's state (all of it, or its ``kind``) with the one
    ``src`` sends.

    Raises:
        RecoveryError: the transfer failed its checksum or does not fit
            this rank's model and optimizer.
    """
    got = recv_state(group, src, device=device)
    parts = chunks(model)
    try:
        if got.get("kind") != kind:
            raise RecoveryError(f"rank {src} sent state of kind {got.get('kind')}, this rank asked for {kind}")
        if len(got["model"]) != len(parts):
            raise RecoveryError(f"rank {src} sent {len(got['model'])} model chunks, this rank has {len(parts)}")
        for saved, chunk in zip(got["model"], parts):
            own = _own_keys(chunk, kind)
            if set(saved) != own:
                raise RecoveryError(f"rank {src} sent model entries {sorted(set(saved) ^ own)[:4]} that this "
                                    f"rank does not have, or not those it has")
            chunk.load_state_dict(saved, strict=kind is None)
        opts = members(optimizer)
        if "shards" in got:
            for shard in got["shards"]:
                apply_shard(shard, optimizer, f"rank {src}'s copy")
            for scaler, saved in zip(_scalers(optimizer, kind), got["grad_scalers"]):
                scaler.load_state_dict(saved)
        elif "optimizer" in got:
            if optimizer is not None:
                optimizer.load_state_dict(got["optimizer"])
        elif "optimizers" in got:
            mine = [o for o in opts if kind_of(o) == kind]
            if len(mine) != len(got["optimizers"]):
                raise RecoveryError(f"rank {src} sent {len(got['optimizers'])} optimizers, this rank has "
                                    f"{len(mine)} of that kind")
            for o, saved in zip(mine, got["optimizers"]):
                o.load_state_dict(saved)
        elif "param_states" in got:
            _load_param_states(optimizer, kind, got["param_states"])
        if scheduler is not None and "scheduler" in got:
            load_scheduler(scheduler, got["scheduler"])
    except (KeyError, RuntimeError, ValueError, CheckpointError) as e:
        raise RecoveryError(f"the state rank {src} sent does not fit this rank: {e}") from None


class RngHistory:
    """This rank's random-number streams at the last ``keep`` committed
    steps, and as they were when the update in flight began.

    A rank caught inside its update to step N+1 -- it committed only N --
    may be repaired from a replica that committed N+1 and rolled back to
    it; the streams kept as that update began are then its streams at
    N+1. Only the latest update's are kept: a rank is caught in no other.
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.states: OrderedDict[int, dict] = OrderedDict()  # committed steps' only: the dying gasp saves these
        self.updating: tuple[int, dict] | None = None  # (the step the update will commit, the streams as it began)

    def start(self, step: int) -> None:
        """The update that will commit ``step`` begins (``start_updating_os``)."""
        self.updating = (step, rng_state())

    def commit(self, step: int) -> None:
        self.states[step] = rng_state()
        while len(self.states) > self.keep:
            self.states.popitem(last=False)

    def streams_at(self, step: int) -> dict | None:
        """The streams of ``step``: as it was committed, else as the update
        to it began, else ``None``.

        The committed record wins: taken at the step's boundary, after all
        the update drew, it is exact. The update's start misses only what
        the optimizer itself draws (torch's and megatron's draw nothing; a
        stochastic-rounding one would) -- the best a rank caught inside its
        update can know, since it never reached the boundary.
        """
        if step in self.states:
            return self.states[step]
        if self.updating is not None and self.updating[0] == step:
            return self.updating[1]
        return None

    def restore(self, step: int) -> bool:
        """Put back the streams of ``step`` (:meth:`streams_at`); False
        when this rank neither committed it nor began the update to it."""
        state = self.streams_at(step)
        if state is None:
            began = self.updating[0] if self.updating is not None else None
            log.warning("no random-number state kept for step %d on this rank (committed steps kept: %s; update "
                        "begun to step %s): its streams are left as they are, so the steps redone from %d draw "
                        "other random numbers than a run without the fault would", step, list(self.states), began,
                        step)
            return False
        if step not in self.states:
            log.info("step %d was not committed on this rank (caught inside its update): its streams are put back "
                     "as that update began", step)
            self.states[step] = state  # this rank now stands at step: a dying gasp before its next commit saves these
        set_rng_state(state)
        return True
