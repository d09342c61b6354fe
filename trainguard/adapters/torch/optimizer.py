"""The optimizer wrapper: reports the start and end of every update.

It behaves as the optimizer it wraps (``param_groups``, ``state``,
``state_dict``, ``zero_grad``...), so LR schedulers, ``GradScaler`` and
gradient clipping work unchanged; only ``step`` is bracketed by two calls
that cost a field write each. A closure given to ``step`` (Lightning,
LBFGS) runs its forward and backward pass before the bracket opens.

``lr_factor`` scales every group's learning rate for the update only (the
value the user and the LR scheduler see is left alone): elastic training
sets it when the job runs with fewer data-parallel replicas.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["GuardedOptimizer"]


class GuardedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` so each ``step()`` calls ``on_start()`` before the
    update and ``on_end()`` after it."""

    def __init__(self, optimizer: torch.optim.Optimizer, on_start: Callable[[], None],
                 on_end: Callable[[], None]) -> None:
        # Deliberately no super().__init__: all state lives in the wrapped optimizer.
        if isinstance(optimizer, GuardedOptimizer):
            raise TypeError("the optimizer is already wrapped by trainguard")
        self.optimizer = optimizer
        self._on_start, self._on_end = on_start, on_end
        self.lr_factor = 1.0

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The update, bracketed by ``on_start``/``on_end``. A ``closure``
        (Lightning's automatic optimization, LBFGS) computes the forward and
        backward pass: its first call runs before the update is reported
        started, so a fault in it leaves the state consistent; later calls
        (LBFGS re-evaluates) are part of the update."""
        if closure is not None:
            with torch.enable_grad():
                first = closure()
            closure = _Replay(first, closure)
        self._on_start()
        if self.lr_factor == 1.0:
            loss = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        else:
            saved = [group["lr"] for group in self.optimizer.param_groups]
            for group in self.optimizer.param_groups:
                group["lr"] = group["lr"] * self.lr_factor
            try:
                loss = self.optimizer.step() if closure is None else self.optimizer.step(closure)
            finally:
                for group, lr in zip(self.optimizer.param_groups, saved):
                    group["lr"] = lr
        self._on_end()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    def __repr__(self) -> str:
        return f"GuardedOptimizer({self.optimizer!r})"


class _Replay:
    """A closure whose first call returns the result computed before the
    update began; later calls evaluate again."""

    def __init__(self, first: Any, closure: Callable[[], Any]) -> None:
        self._first, self._closure, self._fresh = first, closure, True

    def __call__(self) -> Any:
        if self._fresh:
            self._fresh = False
            return self._first
        return self._closure()
