"""The PyTorch adapter: :class:`Guard` protects a training loop (DDP on
gloo/NCCL, any optimizer, LR scheduler, GradScaler, data position:
:class:`ResumableLoader` for a plain ``DataLoader``, torchdata's ``StatefulDataLoader`` as it is).

``import trainguard.torch`` is the short name for this package.
"""

from .data import ResumableLoader
from .guard import Guard
from .optimizer import GuardedOptimizer
from .process_group import AbortableProcessGroup
from .state import state_sha256

__all__ = ["AbortableProcessGroup", "Guard", "GuardedOptimizer", "ResumableLoader", "state_sha256"]
