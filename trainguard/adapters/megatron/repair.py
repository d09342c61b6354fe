"""In-place recovery of a Megatron rank: clean, copy from a replica, roll back.

After a device memory error (UCE) or a communication fault the job goes on
without a restart: every rank drops the step it was in (:func:`clean`), a
rank whose state is lost receives it from a data-parallel replica that
completed the same step (:func:`send_replica` / :func:`receive_replica`),
and every rank puts back its random-number streams as they were when that
step was committed (:class:`RngHistory`), so the step is redone exactly as
it would have run.

What travels: each model chunk's parameters and buffers, the optimizer's
state (with megatron's distributed optimizer: this rank's shard -- the fp32
main parameters and the inner optimizer's state -- which the replica holds
because it sits at the same place in another optimizer instance; and the
grad scaler's state) and the learning-rate scheduler's state. The
replicas' random streams are their own, so they do not travel.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch

from trainguard.core import CheckpointError, RecoveryError
from trainguard.core.recovery import CLEAN_FAILED, CLEAN_OK

from ..torch.state import recv_state, send_state
from .checkpoint import _chunks, _distributed, _mains, _rng_state, _set_rng_state, apply_shard, shard_state

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


def _device_state(model: Any, optimizer: Any) -> list[torch.Tensor]:
    """The tensors themselves (not copies) of the model and optimizer state."""
    tensors = [t for c in _chunks(model) for t in c.state_dict(keep_vars=True).values() if torch.is_tensor(t)]
    opts = _distributed(optimizer)
    if opts:
        tensors += [p for o in opts for p in _mains(o)]
        inners = [o.optimizer for o in opts]
    else:
        inners = [optimizer] if optimizer is not None else []
    tensors += [t for inner in inners for s in inner.state.values() for t in s.values() if torch.is_tensor(t)]
    return [t.detach() for t in tensors]


def _state(model: Any, optimizer: Any, scheduler: Any) -> dict:
    state: dict = {"model": [c.state_dict() for c in _chunks(model)]}
    if _distributed(optimizer):
        state["shard"] = shard_state(optimizer)
        scaler = getattr(optimizer, "grad_scaler", None)
        if scaler is not None:
            state["grad_scaler"] = scaler.state_dict()
    elif optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    return state


def send_replica(group: Any, dst: int, model: Any, optimizer: Any, scheduler: Any, *,
                 device: torch.device) -> None:
    """Send this rank's state to ``dst`` (its number in ``group``)."""
    send_state(group, _state(model, optimizer, scheduler), dst, device=device)


def receive_replica(group: Any, src: int, model: Any, optimizer: Any, scheduler: Any, *,
                    device: torch.device) -> None:
    """Replace this rank's state with the one ``src`` sends.

    Raises:
        RecoveryError: the transfer failed its checksum or does not fit
            this rank's model and optimizer.
    """
    got = recv_state(group, src, device=device)
    chunks = _chunks(model)
    try:
        if len(got["model"]) != len(chunks):
            raise RecoveryError(f"rank {src} sent {len(got['model'])} model chunks, this rank has {len(chunks)}")
        for saved, chunk in zip(got["model"], chunks):
            chunk.load_state_dict(saved)
        if "shard" in got:
            apply_shard(got["shard"], optimizer, f"rank {src}'s copy")
            if "grad_scaler" in got:
                optimizer.grad_scaler.load_state_dict(got["grad_scaler"])
        elif optimizer is not None:
            optimizer.load_state_dict(got["optimizer"])
        if scheduler is not None:
            if hasattr(scheduler, "num_steps"):  # megatron's load_state_dict steps from where it stands, made for a new one
                scheduler.num_steps = 0
            scheduler.load_state_dict(got["scheduler"])
    except (KeyError, RuntimeError, ValueError, CheckpointError) as e:
        raise RecoveryError(f"the state rank {src} sent does not fit this rank: {e}") from None


class RngHistory:
    """This rank's random-number streams at the last ``keep`` committed steps."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.states: OrderedDict[int, dict] = OrderedDict()

    def commit(self, step: int) -> None:
        self.states[step] = _rng_state()
        while len(self.states) > self.keep:
            self.states.popitem(last=False)

    def restore(self, step: int) -> bool:
        """Put back the streams of ``step``; False when they were not kept."""
        state = self.states.get(step)
        if state is None:
            log.warning("no random-number state kept for step %d (kept: %s): the streams go on from here",
                        step, list(self.states))
            return False
        _set_rng_state(state)
        return True
