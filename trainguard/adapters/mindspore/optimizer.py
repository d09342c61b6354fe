"""``OptTFTWrapper``: the optimizer wrapper that marks every update.

The role of MindSpore's ``nn.OptTFTWrapper``, on any device: before the
update every replica all-reduces a health flag, so the update runs only when
every replica reached it healthy; the update window is reported to the
controller (``start_update`` before, the step end after). A rank that failed
earlier in the step joins the flag all-reduce with 0, so no replica applies a
step that one of them could not finish, and no collective is left half done
by a failure in a forward or backward pass: a MindSpore CPU collective cannot
be aborted and resumed (a timed-out one leaves the communicator misaligned).

In PyNative mode the wrapper hands the gradients to its Guard, which votes
first and then reduces the gradients and updates, all from Python. In graph mode the wrapper's ``construct`` is compiled
into ``Model``'s train step, so the vote is compiled in too (see
:meth:`OptTFTWrapper.compile_vote`): Python sets the ``health`` parameter
before the step, the graph all-reduces it, updates only when every replica
voted 1, and records the outcome in the ``updated`` parameter, which Python
reads after the step.

Outside a :class:`~.guard.Guard` the wrapper simply calls the optimizer.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

__all__ = ["OptTFTWrapper", "Updater"]


class Updater(Protocol):
    """Where the wrapper hands the gradients (its :class:`~.guard.Guard`)."""

    def update(self, gradients: Any) -> Any:
        """Vote and reduce unless done, then update; ``False`` when skipped."""


class OptTFTWrapper(nn.Optimizer):
    """Wrap ``opt`` (an ``nn.Optimizer``); use the wrapper where the
    optimizer was used (``Model(..., optimizer=wrapper)`` or a hand-written
    loop's update call). An ``nn.Optimizer`` itself, as MindSpore's
    wrapper, because ``Model`` accepts nothing else."""

    def __init__(self, opt: nn.Optimizer) -> None:
        if not isinstance(opt, nn.Optimizer):
            raise TypeError(f"OptTFTWrapper wraps a mindspore.nn.Optimizer, got {type(opt).__name__}")
        super().__init__(opt.learning_rate, opt.parameters)
        self.opt = opt
        # What TrainOneStepCell and Model read from an optimizer.
        self.parameters = opt.parameters
        self.learning_rate = opt.learning_rate
        self.global_step = opt.global_step
        self.guard: Updater | None = None
        self.voting = False  # a compile-time constant of construct: the vote is in the graph
        self.world_size = 1.0

    def compile_vote(self, world_size: int) -> None:
        """Put the health vote into ``construct`` (graph mode; call before
        the train step is first compiled). Adds two non-trainable
        parameters, outside the optimizer's state: ``health`` (this rank's
        vote, set by :meth:`set_health` before each step) and ``updated``
        (1 after a step that updated, 0 after one every replica skipped)."""
        if self.voting:
            return
        self.health = Parameter(Tensor(np.ones(1, np.float32)), name="trainguard_health", requires_grad=False)
        self.updated = Parameter(Tensor(np.zeros(1, np.float32)), name="trainguard_updated", requires_grad=False)
        self.world_size = float(world_size)
        # CPU AllReduce takes floats only; a sum of 1.0s is exact.
        self.all_reduce = ops.AllReduce() if world_size > 1 else ops.Identity()
        self.voting = True

    def set_health(self, healthy: bool) -> None:
        """This rank's vote in the next compiled step."""
        ops.assign(self.health, Tensor(np.array([1.0 if healthy else 0.0], np.float32)))
        ops.assign(self.updated, Tensor(np.zeros(1, np.float32)))

    def did_update(self) -> bool:
        """Whether the last compiled step updated (every replica voted 1)."""
        return bool(self.updated.asnumpy()[0] == 1.0)

    def construct(self, gradients):
        if self.voting:
            vote = self.all_reduce(self.health)
            if vote[0] > self.world_size - 0.5:
                self.opt(gradients)
                ops.assign(self.updated, ops.ones_like(self.updated))
            else:
                ops.assign(self.updated, ops.zeros_like(self.updated))
            return self.updated
        if self.guard is None:
            return self.opt(gradients)
        return self.guard.update(gradients)
