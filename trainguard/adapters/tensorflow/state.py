"""Verified TensorFlow checkpoints: written whole or not at all, loaded
only after their checksums pass, an older one when the newest does not.

A checkpoint of step N is the core's layout (:class:`~trainguard.core.CheckpointStore`,
directory ``step_{N:08d}``, tracker ``latest_step.txt``)::

    step_00000010/
      manifest.json                 files, sizes, XXH3-64, step, world
      model.index, model.data-*     the model's tf.train.Checkpoint (the chief's write)
      worker_0/state.index, ...     worker 0's own state: its data iterator, tf.random's
                                    global generator (when the program made or set one)
      worker_0/host_rng.json        Python's and NumPy's random streams
      worker_1/...

Every worker calls :meth:`Checkpointer.save` (``MultiWorkerMirroredStrategy``
may need a collective to read a variable, so TensorFlow's own rule is that all
workers write; the non-chief workers' model copies go to a scratch directory
and are deleted). Each writes its own ``worker_<i>/`` state, then all meet in a
barrier (one all-reduce) and the chief hashes every file and finalises the
directory: manifest, atomic rename, tracker. A crash anywhere before the rename
leaves only a ``_tmp`` directory, which no reader takes and the next save
prunes.

:meth:`Checkpointer.restore` verifies the checkpoints newest first (the
core's :meth:`~trainguard.core.CheckpointStore.latest`: a flipped byte, a
truncated or missing file, a missing manifest are each skipped with the
reason logged), the workers agree on one step (an all-gather of each one's
choice; they take the oldest chosen, verified by all), and each loads the
model and its own state. A checkpoint written by another number of workers,
or one that does not load after passing its checksums, is refused
(``ResumeError``) and nothing is written.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

import tensorflow as tf
import xxhash

from trainguard.core import TORCH, CheckpointError, CheckpointStore, FileInfo, ResumeError
from trainguard.core.checkpoint import Verified

from .worker import WorkerInfo, numpy_state, python_state, set_numpy_state, set_python_state

__all__ = ["Checkpointer"]

log = logging.getLogger("trainguard.tensorflow")

MODEL = "model"
HOST_RNG = "host_rng.json"
#: Each worker's list of the files it wrote (names, sizes, XXH3), written last.
LISTING = "files.json"
#: How long the chief waits for a worker's list after the barrier.
LISTING_TIMEOUT_S = 300.0
_CHUNK = 8 << 20


class Checkpointer:
    """Args:
        model_state: the ``tf.train.Checkpoint`` of the replicated state
            (model, optimizer, step variables).
        directory: where checkpoints go (created on the first save).
        worker: this worker's place in the job and its launcher link.
        strategy: the job's strategy (its collectives are the barrier and
            the agreement).
        local: this worker's own trackables (its ``tf.data`` iterator...).
        keep: complete checkpoints kept (0: all).
    """

    def __init__(self, model_state: tf.train.Checkpoint, directory: str | os.PathLike, *, worker: WorkerInfo,
                 strategy: tf.distribute.Strategy, local: Mapping[str, Any] | None = None, keep: int = 3) -> None:
        self.model_state = _with_seed_states(model_state)
        self.store = CheckpointStore(directory, TORCH, keep=keep)
        self.worker = worker
        self.strategy = strategy
        local = dict(local or {})
        generator = _global_generator()
        if generator is not None:
            local.setdefault("generator", generator)
        self.local_state = tf.train.Checkpoint(**local)
        self.loaded: Verified | None = None

    @property
    def root(self) -> Path:
        return self.store.root

    # ------------------------------------------------------------------ save
    def save(self, step: int, meta: Mapping[str, Any] | None = None) -> Path | None:
        """Write step ``step`` on every worker; the chief finalises it and
        gets its path (the others ``None``).

        Raises:
            CheckpointError: the chief could not finalise it (the previous
                checkpoint stays the newest).
        """
        w = self.worker
        w.send("save", step)
        tmp = self.store.tmp_path(step)
        mine = Path(tmp, f"worker_{w.index}")
        for directory in (self.root, tmp, mine, self.root / ".trainguard"):  # 0700: TensorFlow's files are 0644
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        (mine / LISTING).unlink(missing_ok=True)  # a crashed attempt's, at the same step
        if w.chief:
            self.model_state.write(str(tmp / MODEL))
        else:
            scratch = self.root / ".trainguard" / f"scratch_worker_{w.index}"
            self.model_state.write(str(scratch / MODEL))
            shutil.rmtree(scratch, ignore_errors=True)
        self.local_state.write(str(mine / "state"))
        (mine / HOST_RNG).write_text(json.dumps({"python": python_state(), "numpy": numpy_state()}))
        records = {}
        for path in sorted(mine.iterdir()):
            if path.name != LISTING:
                _fsync(path)
                records[path.relative_to(tmp).as_posix()] = _info(tmp, path).record()
        _write_atomic(mine / LISTING, json.dumps({"attempt": _attempt(), "files": records}).encode())
        w.strike("save", step)
        self._barrier()
        path = None
        if w.chief:
            files = [_info(tmp, p) for p in sorted(tmp.glob(f"{MODEL}.*"))]
            layout = {"world_size": w.count,
                      "shards": [{"kind": 0, "copies": list(range(w.count)), "full": True, "saved_by": 0,
                                  "files": [f.name for f in files]}]}
            for index in range(w.count):
                files += self._listing(tmp, index)
            path = self.store.finalize(step, files, layout=layout, rehash=False,
                                       meta={"framework": "tensorflow", "workers": w.count,
                                             "tensorflow": tf.__version__, **dict(meta or {})})
        w.send("saved", step)
        return path

    def _listing(self, tmp: Path, index: int) -> list[FileInfo]:
        """Worker ``index``'s files in ``tmp``, as it listed them once they
        were written and synced (waited for: the barrier orders the
        collectives, not another process's files)."""
        listing = tmp / f"worker_{index}" / LISTING
        deadline = time.monotonic() + LISTING_TIMEOUT_S
        while _read_attempt(listing) != _attempt():
            if time.monotonic() > deadline:
                raise CheckpointError(f"cannot finalise {tmp}: worker {index} did not list its files within "
                                      f"{LISTING_TIMEOUT_S:.0f} s")
            time.sleep(0.01)
        try:
            records = json.loads(listing.read_text())["files"]
            return [FileInfo(name, r["bytes"], "", r["xxh3"]) for name, r in records.items()]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"cannot finalise {tmp}: worker {index}'s {LISTING} is unreadable ({e})") from None

    # ------------------------------------------------------------- restore
    def restore(self) -> Verified | None:
        """Load the newest checkpoint every worker verified (``None``: none:
        a fresh start).

        Raises:
            ResumeError: the workers cannot agree on a verified checkpoint,
                it was written by another number of workers, or it does not
                load; nothing is loaded or written.
        """
        w = self.worker
        found = self.store.latest()
        steps = self._gather(found.step if found else -1)
        chosen = min(steps)
        if chosen != max(steps):
            if chosen < 0:
                raise ResumeError(f"worker {w.index}: some workers found no verified checkpoint in {self.root} and "
                                  f"others did (steps {steps}): refusing to start over beside them")
            log.warning("the workers' newest verified checkpoints differ (steps %s): all take step %d",
                        steps, chosen)
            found = self._verify(chosen)
        oks = self._gather(0 if chosen >= 0 and found is None else 1)
        if min(oks) == 0:
            raise ResumeError(f"worker {w.index}: the workers found different verified checkpoints in "
                              f"{self.root} (steps {steps}) and not every worker can read step {chosen}")
        if found is None:
            if self.store.steps():
                raise ResumeError(f"worker {w.index}: no checkpoint in {self.root} passes verification (each "
                                  f"reason is logged above); refusing to start over from step 0 beside them: move "
                                  f"them away to start fresh")
            log.info("no checkpoint in %s: starting from step 0", self.root)
            return None
        world = found.manifest["layout"]["world_size"]
        if world != w.count:
            raise ResumeError(f"checkpoint {found.path} was written by {world} workers and this job has {w.count}: "
                              f"each worker's data position and random streams are its own; run {world} workers "
                              f"or start from another directory")
        w.strike("resume", found.step)
        mine = f"worker_{w.index}"
        # TensorFlow reads a checkpoint by its prefix: it gets a private directory of links to the files as
        # they were verified (whatever is at their names by now: see trainguard.core.verified).
        names = [n for n in found.manifest["files"] if n.startswith((f"{MODEL}.", f"{mine}/"))]
        try:
            with found.linked(names) as verified:
                self.model_state.read(str(verified / MODEL)).assert_existing_objects_matched()
                self.local_state.read(str(verified / mine / "state")).assert_existing_objects_matched()
                rng = json.loads((verified / mine / HOST_RNG).read_text())
            set_python_state(rng["python"])
            set_numpy_state(rng["numpy"])
        except CheckpointError as e:
            raise ResumeError(f"worker {w.index}: checkpoint {found.path}: {e}; nothing was loaded") from None
        except (tf.errors.OpError, AssertionError, ValueError, KeyError, TypeError, OSError) as e:
            raise ResumeError(f"worker {w.index}: checkpoint {found.path} passed its checksums but does not load "
                              f"into this program ({type(e).__name__}: {e}); nothing was written") from None
        log.info("worker %d resumed from %s", w.index, found.path)
        self.loaded = found
        return found

    def _verify(self, step: int) -> Verified | None:
        try:
            return self.store.verify(self.store.final_path(step))
        except CheckpointError as e:
            log.warning("worker %d cannot use checkpoint step %d: %s", self.worker.index, step, e)
            return None

    # ------------------------------------------------------------ collectives
    def _gather(self, value: int) -> list[int]:
        """Every worker's ``value``, in task order (a collective: every
        worker calls it at the same point)."""
        if self.worker.count == 1:
            return [value]
        local = self.strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant([value], tf.int64))
        return [int(v) for v in self.strategy.gather(local, axis=0).numpy()]

    def _barrier(self) -> None:
        self._gather(0)


def _with_seed_states(checkpoint: tf.train.Checkpoint) -> tf.train.Checkpoint:
    """``checkpoint`` with the seed-generator states of the Keras models in
    it (Dropout's and other random layers'): Keras 3 lists them among a
    model's variables, but a ``tf.train.Checkpoint`` of the model does not
    save them (measured with Keras 3.15: a resumed Dropout drew other masks)."""
    import keras

    seen: dict[int, Any] = {}
    for obj in tf.train.TrackableView(checkpoint).descendants():
        if isinstance(obj, keras.layers.Layer):
            for v in obj.variables:
                if v.path.endswith("seed_generator_state"):
                    seen.setdefault(id(v), v)
    seeds = tf.Module()
    seeds.states = list(seen.values())
    return tf.train.Checkpoint(state=checkpoint, keras_seed_states=seeds)


def _global_generator() -> tf.random.Generator | None:
    """``tf.random``'s global generator if the program made or set one
    (asking for it would make one, which op determinism forbids)."""
    from tensorflow.python.ops import stateful_random_ops

    return stateful_random_ops.global_generator


def _info(tmp: Path, path: Path) -> FileInfo:
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return FileInfo(path.relative_to(tmp).as_posix(), path.stat().st_size, "", digest.intdigest())


def _attempt() -> str:
    """This run of the job: a worker's listing from a crashed earlier run at
    the same step is not taken for this one's."""
    return f"{os.environ.get('TRAINGUARD_JOB_ID', '')}/{os.environ.get('TRAINGUARD_RESTART', '')}"


def _read_attempt(listing: Path) -> str | None:
    try:
        return json.loads(listing.read_text()).get("attempt")
    except (OSError, ValueError, AttributeError):
        return None


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
