"""trainguard for MindSpore: the optimizer wrapper, the Guard for
hand-written loops and the ``TrainFaultTolerance`` callback for ``Model.train``.

The MindSpore processes never import torch.
"""

from .callback import TFTRegister, TrainFaultTolerance, wrap_model_train
from .guard import Guard
from .optimizer import OptTFTWrapper

wrap_model_train()  # as MindSpore's _handle_tft: a fault in Model.train is recovered when the callback is given

__all__ = ["Guard", "OptTFTWrapper", "TFTRegister", "TrainFaultTolerance"]
