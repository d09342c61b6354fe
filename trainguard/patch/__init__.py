"""``adapters-patch``: make a framework's own launcher start trainguard.

:mod:`.core` is the generic engine (locate, plan, write, revert); each target
(:mod:`.torchrun`) is a small :class:`~.core.Target` description; :mod:`.cli`
is the command. Nothing here imports a framework.
"""

from .core import PatchError, Target

__all__ = ["PatchError", "Target"]
