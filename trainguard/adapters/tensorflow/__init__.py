"""trainguard for TensorFlow 2: verified checkpoints for job-level restarts.

``trainguard run --framework tensorflow`` restarts the whole job on a fault
(:mod:`trainguard.launcher.tfrun`); these resume it from the newest verified
checkpoint:

* :class:`Checkpointing` -- a Keras callback for ``model.fit``;
* :class:`CheckpointManager` -- ``tf.train.CheckpointManager``'s arguments,
  for a custom loop, with the worker's ``tf.data`` iterator saved too.

Importing this package does not import TensorFlow; the first use of either
name does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CheckpointManager", "Checkpointing"]

_WHERE = {"CheckpointManager": ".manager", "Checkpointing": ".callback"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value
