"""trainguard for MindSpore: the optimizer wrapper, the Guard for
hand-written loops and the ``TrainFaultTolerance`` callback for ``Model.train``.

The MindSpore processes never import torch.
"""

from .guard import Guard
from .optimizer import OptTFTWrapper

__all__ = ["Guard", "OptTFTWrapper"]
