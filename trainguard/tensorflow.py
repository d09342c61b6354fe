"""Short name for :mod:`trainguard.adapters.tensorflow`:
``from trainguard.tensorflow import Checkpointing, CheckpointManager``
(TensorFlow is imported at the first use of a name, not here)."""

from trainguard.adapters.tensorflow import __all__, __getattr__  # noqa: F401
