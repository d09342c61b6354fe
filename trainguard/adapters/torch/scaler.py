"""The ``torch.amp`` GradScaler as the Guard carries it, exactly.

``GradScaler.state_dict()`` holds the scale and the growth tracker, but not
what a scaler keeps per optimizer between ``unscale_``/``step`` and
``update()``: the stage (ready, unscaled, stepped) and the found-inf flags.
Only ``update()`` clears them. A step that fails inside the update -- after
``unscale_``, before ``update()`` -- leaves them set, and a retry that loads
only ``state_dict()`` then trains on with them: ``unscale_`` raises
"unscale_() has already been called", or, without ``unscale_``, the next
``step`` skips the unscaling and applies gradients still multiplied by the
scale. :class:`ScalerState` saves and restores all of it, and reads the
scale and tracker as tensors (``state_dict()`` calls ``.item()``: on a GPU
a wait for the whole step at every commit).

:func:`stepping_scaler` finds the scaler behind ``scaler.step(optimizer)``
from the optimizer's ``step``, so a scaler the Guard was not given is found
at the first update.
"""

from __future__ import annotations

from collections import defaultdict
from types import FrameType
from typing import Any, Mapping

import torch
from torch.amp.grad_scaler import GradScaler, OptState, _refresh_per_optimizer_state

__all__ = ["ScalerState", "is_scaler", "stepping_scaler"]


def is_scaler(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch.amp`` GradScaler (``torch.cuda.amp``'s,
    ``torch.cpu.amp``'s and FSDP's ``ShardedGradScaler`` are ones)."""
    return isinstance(obj, GradScaler)


class ScalerState:
    """``state_dict``/``load_state_dict`` of a GradScaler, per-optimizer
    state included.

    Args:
        scaler: the GradScaler.
        optimizers: the optimizers it may be stepping, by a name that is the
            same in every process (the Guard's wrapper and the optimizer it
            wraps): a scaler keys its per-optimizer state by ``id()``.
    """

    def __init__(self, scaler: GradScaler, optimizers: Mapping[str, Any]) -> None:
        self.scaler = scaler
        self.optimizers = dict(optimizers)

    def state_dict(self) -> dict:
        s = self.scaler
        if not s._enabled:
            return {"enabled": False}
        names = {id(opt): name for name, opt in self.optimizers.items()}
        return {
            "enabled": True,
            "scale": _scalar(s._scale, s._init_scale, torch.float32),
            "growth_tracker": _scalar(s._growth_tracker, s._init_growth_tracker, torch.int32),
            "growth_factor": float(s._growth_factor),
            "backoff_factor": float(s._backoff_factor),
            "growth_interval": int(s._growth_interval),
            "optimizers": {names[key]: {"stage": state["stage"].value,
                                        "found_inf": {str(device): t.detach().clone()
                                                      for device, t in state["found_inf_per_device"].items()}}
                           for key, state in s._per_optimizer_states.items() if key in names},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load a state of :meth:`state_dict`, or of ``GradScaler.state_dict()``
        (a checkpoint written before this class: no per-optimizer state,
        which is then ready, as after ``update()``)."""
        s = self.scaler
        s._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        if "enabled" not in state:
            s.load_state_dict(dict(state))
            return
        if not s._enabled:  # as GradScaler.load_state_dict: nothing to load into
            return
        if not state["enabled"]:
            raise RuntimeError("the scaler's state was saved from a disabled GradScaler; this one is enabled")
        for name, tensor, init in (("scale", "_scale", "_init_scale"),
                                   ("growth_tracker", "_growth_tracker", "_init_growth_tracker")):
            value = torch.as_tensor(state[name])
            mine = getattr(s, tensor)
            if mine is None:  # not made yet (no scale() since the scaler was made): made from this value
                setattr(s, init, value.item())
            else:
                mine.copy_(value)
        s._growth_factor = float(state["growth_factor"])
        s._backoff_factor = float(state["backoff_factor"])
        s._growth_interval = int(state["growth_interval"])
        for name, saved in state.get("optimizers", {}).items():
            opt = self.optimizers.get(name)
            if opt is None:
                continue
            per = s._per_optimizer_states[id(opt)]
            per["stage"] = OptState(int(saved["stage"]))
            per["found_inf_per_device"] = {torch.device(d): t.to(d) for d, t in saved["found_inf"].items()}


def _scalar(tensor: torch.Tensor | None, init: float | int, dtype: torch.dtype) -> torch.Tensor:
    """A scaler's scale or growth tracker: a copy of its tensor (no wait on a
    device), or the value it will be made from."""
    return tensor.detach().clone() if tensor is not None else torch.tensor(init, dtype=dtype)


def stepping_scaler(frame: FrameType | None, depth: int = 4) -> GradScaler | None:
    """The GradScaler whose ``step()`` called the code of ``frame`` (or of
    one of the ``depth`` frames above it): ``scaler.step(optimizer)`` calls
    ``optimizer.step()`` from ``GradScaler._maybe_opt_step``. ``None``: the
    update was not started by a scaler."""
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code.co_name == "_maybe_opt_step":
            scaler = frame.f_locals.get("self")
            return scaler if isinstance(scaler, GradScaler) else None
        frame = frame.f_back
    return None
