"""Verified checkpoints for a custom TensorFlow training loop.

:class:`CheckpointManager` takes the arguments of ``tf.train.CheckpointManager``
(the ``tf.train.Checkpoint`` to save, a directory, ``max_to_keep``) plus this
worker's ``tf.data`` iterator, and writes the core's verified layout
(:mod:`.state`)::

    ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer)
    it = iter(dataset.shard(workers, index))         # this worker's own iterator
    manager = CheckpointManager(ckpt, "ckpt", max_to_keep=3, data=it, save_every=10)
    for step in manager.steps(1000):                 # starts after the resumed step
        train_step(next(it))                         # strategy.run(...) inside
    manager.close()

``steps`` loads the newest verified checkpoint first (:meth:`restore_or_initialize`),
then after each step tells the launcher (the heartbeat), saves every
``save_every`` steps and strikes injected faults. ``save`` and
``restore_or_initialize`` can be called by hand, as with TensorFlow's manager.

The iterator is this worker's own ``tf.data`` iterator: TensorFlow 2.21
cannot checkpoint ``tf.distribute``'s distributed iterators
(``tf.train.Checkpoint`` raises ``ValueError`` for a
``MultiWorkerMirroredStrategy`` one), so feed ``strategy.run`` from a local
iterator of the worker's shard.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator

import tensorflow as tf

from .state import Checkpointer
from .worker import WorkerInfo, refuse_restart_on_error

__all__ = ["CheckpointManager"]

log = logging.getLogger("trainguard.tensorflow")


class CheckpointManager:
    """Args:
        checkpoint: the ``tf.train.Checkpoint`` of the replicated state.
        directory: the checkpoint directory.
        max_to_keep: complete checkpoints kept (0 or ``None``: all).
        data: this worker's ``tf.data`` iterator (its position is saved per worker).
        save_every: :meth:`steps` saves every this many steps (0: never by itself).
        strategy: the job's strategy (default: the current one).
        local: more per-worker trackables to save beside ``data``.
    """

    def __init__(self, checkpoint: tf.train.Checkpoint, directory: str | os.PathLike, max_to_keep: int | None = 3,
                 *, data: Any = None, save_every: int = 0, strategy: tf.distribute.Strategy | None = None,
                 local: dict | None = None) -> None:
        if save_every < 0:
            raise ValueError(f"save_every must be >= 0, got {save_every}")
        self.directory = Path(directory)
        self.worker = WorkerInfo.from_env(self.directory)
        if self.worker.pipe is not None:
            refuse_restart_on_error()
        extra = dict(local or {})
        if data is not None:
            extra["data"] = data
        self._state = Checkpointer(checkpoint, self.directory, worker=self.worker,
                                   strategy=strategy or tf.distribute.get_strategy(), local=extra,
                                   keep=max_to_keep or 0)
        self.save_every = save_every
        self.step: int | None = None  # completed steps; None until restored or initialised

    def restore_or_initialize(self) -> int:
        """Load the newest verified checkpoint (see :mod:`.state`) and return
        its step; 0 when there is none (a fresh start).

        Raises:
            ResumeError: no verified checkpoint every worker can load.
        """
        found = self._state.restore()
        self.step = found.step if found is not None else 0
        self.worker.send("resumed", self.step)
        return self.step

    def save(self, checkpoint_number: int | None = None) -> str | None:
        """Save now, as step ``checkpoint_number`` (default: the completed
        steps). Every worker calls it; the chief returns the path."""
        step = self.step if checkpoint_number is None else int(checkpoint_number)
        if step is None:
            raise ValueError("save() before restore_or_initialize(): the step is not known yet")
        path = self._state.save(step)
        return None if path is None else str(path)

    def steps(self, total: int) -> Iterator[int]:
        """The steps still to run up to ``total`` (each value: the steps
        completed before it), restoring first if not done yet."""
        if self.step is None:
            self.restore_or_initialize()
        while self.step < total:
            step = self.step
            self.worker.strike("forward", step)
            started = time.perf_counter()
            yield step
            self.step = step + 1
            if self.worker.faults is not None:
                self.worker.faults.after_step(self.step, time.perf_counter() - started)
            self.worker.send("step", self.step)
            if self.save_every and self.step % self.save_every == 0:
                self.save(self.step)
        self.worker.send("done", self.step)

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest complete checkpoint directory (verified when loaded)."""
        steps = self._state.store.steps()
        return str(self._state.store.final_path(steps[0])) if steps else None

    @property
    def checkpoints(self) -> list[str]:
        """Complete checkpoint directories, oldest first."""
        return [str(self._state.store.final_path(s)) for s in reversed(self._state.store.steps())]

    def close(self) -> None:
        if self.worker.pipe is not None:
            self.worker.pipe.close()
