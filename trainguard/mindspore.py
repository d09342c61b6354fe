"""Short name for :mod:`trainguard.adapters.mindspore`: ``from trainguard.mindspore import Guard``."""

from trainguard.adapters.mindspore import *  # noqa: F401,F403
from trainguard.adapters.mindspore import __all__  # noqa: F401
