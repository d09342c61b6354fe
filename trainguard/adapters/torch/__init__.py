"""The PyTorch adapter: :class:`Guard` protects a training loop (DDP on
gloo/NCCL, any optimizer, LR scheduler, GradScaler, data position).

``import trainguard.torch`` is the short name for this package.
"""

from .guard import Guard
from .optimizer import GuardedOptimizer
from .process_group import AbortableProcessGroup
from .state import state_sha256

__all__ = ["AbortableProcessGroup", "Guard", "GuardedOptimizer", "state_sha256"]
