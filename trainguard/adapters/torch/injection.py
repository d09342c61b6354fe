"""Where an injected fault (``TRAINGUARD_FAULT``: :class:`trainguard.core.FaultInjector`)
strikes a torch step's forward and backward pass: ``phase=forward`` before
the model's forward pass, ``phase=backward`` halfway through the backward
pass (a gradient hook on the middle parameter, so some of DDP's buckets are
already reduced; a sharded model's own hook, :func:`.fsdp.backward_hook`).
``phase=optimizer`` strikes at the end of the update (:mod:`.update`),
``phase=gc`` as a step begins (the Guard's ``_begin``)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from trainguard.core import FaultInjector

from .fsdp import backward_hook

__all__ = ["fault_hooks"]


def fault_hooks(module: torch.nn.Module, injector: FaultInjector, sharding: Any, step: Callable[[], int]) -> list:
    """The hooks that strike ``injector``'s forward and backward faults in
    ``module`` (``sharding``: a sharded model's layout, or ``None``) at the
    step ``step()`` returns; each has ``remove()``."""
    hooks = []
    if injector.wants("forward"):
        hooks.append(module.register_forward_pre_hook(lambda mod, args: injector.strike("forward", step())))
    if injector.wants("backward") and sharding is not None:
        hooks.append(backward_hook(sharding, lambda: injector.strike("backward", step())))
    elif injector.wants("backward"):
        params = [p for p in module.parameters() if p.requires_grad]
        middle = params[len(params) // 2]  # mid-backward: some buckets already reduced

        def hook(grad: torch.Tensor) -> torch.Tensor:
            injector.strike("backward", step())
            return grad

        hooks.append(middle.register_hook(hook))
    return hooks
