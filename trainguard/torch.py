"""Short name for :mod:`trainguard.adapters.torch`: ``from trainguard.torch import Guard``."""

from trainguard.adapters.torch import *  # noqa: F401,F403
from trainguard.adapters.torch import __all__  # noqa: F401
