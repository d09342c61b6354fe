"""Verified checkpoints for ``model.fit``: a Keras callback.

::

    with strategy.scope():
        model = build(); model.compile(optimizer=..., loss=...)
    model.fit(dataset, epochs=20, steps_per_epoch=50,
              callbacks=[Checkpointing("ckpt", every_epochs=1)])

At the start of ``fit`` the callback loads the newest verified checkpoint
(:mod:`.state`): the model's variables (Keras layers' seed-generator states
among them), the optimizer's, each worker's Python, NumPy and ``tf.random``
global streams, and the epoch, which ``fit`` then starts from (Keras's own
``BackupAndRestore`` does the same with ``_initial_epoch``). It saves at the
end of every ``every_epochs``-th epoch, reports each batch to the launcher
(the heartbeat) and strikes injected faults before a batch.

``fit`` resumes at an epoch boundary only (it has no way to start inside
an epoch) and creates its own data iterator, which cannot be checkpointed;
the data position is therefore the epoch: give ``fit`` data whose batches
in epoch ``e`` are a function of ``e`` (a dataset without reshuffling, or
one you build per epoch), and choose ``steps_per_epoch`` as the save
interval. For positions inside an epoch use :class:`.CheckpointManager` in
a custom loop.
"""

from __future__ import annotations

import os
from pathlib import Path

import keras
import tensorflow as tf

from .state import Checkpointer
from .worker import WorkerInfo, refuse_restart_on_error

__all__ = ["Checkpointing"]


class Checkpointing(keras.callbacks.Callback):
    """Args:
        directory: the checkpoint directory.
        every_epochs: save at the end of every this many epochs.
        keep: complete checkpoints kept (0: all).
    """

    def __init__(self, directory: str | os.PathLike, *, every_epochs: int = 1, keep: int = 3) -> None:
        super().__init__()
        if every_epochs < 1:
            raise ValueError(f"every_epochs must be >= 1, got {every_epochs}")
        self.directory = Path(directory)
        self.every_epochs = every_epochs
        self.keep = keep
        self.worker = WorkerInfo.from_env(self.directory)
        if self.worker.pipe is not None:
            refuse_restart_on_error()
        self._state: Checkpointer | None = None
        self.resumed_step = 0

    def _step(self) -> int:
        return int(self.model.optimizer.iterations.numpy())

    def on_train_begin(self, logs=None) -> None:
        model = self.model
        if not model.optimizer.built:  # its variables must exist to be loaded into
            with model.distribute_strategy.scope():
                model.optimizer.build(model.trainable_variables)
        self._state = Checkpointer(tf.train.Checkpoint(model=model, optimizer=model.optimizer), self.directory,
                                   worker=self.worker, strategy=model.distribute_strategy, keep=self.keep)
        found = self._state.restore()
        if found is not None:
            model._initial_epoch = int(found.manifest["meta"]["epoch"])  # as keras.callbacks.BackupAndRestore
        self.resumed_step = found.step if found is not None else 0
        self.worker.send("resumed", self.resumed_step)

    def on_train_batch_begin(self, batch, logs=None) -> None:
        self.worker.strike("forward", self._step())

    def on_train_batch_end(self, batch, logs=None) -> None:
        self.worker.send("step", self._step())

    def on_train_end(self, logs=None) -> None:
        self.worker.send("done", self._step())

    def on_epoch_end(self, epoch, logs=None) -> None:
        if (epoch + 1) % self.every_epochs == 0:
            self._state.save(self._step(), meta={"epoch": epoch + 1})
