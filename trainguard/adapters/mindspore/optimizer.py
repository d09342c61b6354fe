"""``OptTFTWrapper``: the optimizer wrapper that marks every update.

The role of MindSpore's ``nn.OptTFTWrapper``, on any device: before the
update every replica all-reduces a health flag, so the update runs only when
every replica reached it healthy; the update window is reported to the
controller (``start_update`` before, the step end after). A rank that failed
earlier in the step joins the flag all-reduce with 0 (after replaying the
gradient all-reduce its peers wait in), so no replica applies a step that one
of them could not finish, and no collective is ever left half done: a
MindSpore CPU collective cannot be aborted and resumed (a timed-out one
leaves the communicator misaligned), so trainguard never abandons one.

Outside a :class:`~.guard.Guard` the wrapper simply calls the optimizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mindspore import nn

if TYPE_CHECKING:
    from .guard import Guard

__all__ = ["OptTFTWrapper"]


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
        self.guard: Guard | None = None

    def construct(self, gradients):
        if self.guard is None:
            return self.opt(gradients)
        return self.guard.update(gradients)
