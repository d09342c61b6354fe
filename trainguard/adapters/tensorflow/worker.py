"""Who this TensorFlow worker is and what it tells its launcher (no
TensorFlow import): its task index and the number of workers from
``TF_CONFIG``, the progress pipe ``trainguard run --framework tensorflow``
gave it, the injected faults, and the exit code that stops the job
instead of restarting it.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from trainguard.core import EXIT_UNRECOVERABLE, ConfigError, FaultInjector, TrainguardError
from trainguard.core.config import check_env
from trainguard.core.faults import faults_from_env
from trainguard.core.step_pipe import StepPipe

__all__ = ["WorkerInfo", "numpy_state", "python_state", "refuse_restart_on_error", "set_numpy_state",
           "set_python_state"]

log = logging.getLogger("trainguard.tensorflow")

#: The fault phases this adapter strikes: before a step, inside a save, while resuming.
PHASES = ("forward", "save", "resume")


@dataclass
class WorkerInfo:
    """This worker's place in the job and its link to the launcher."""

    index: int = 0
    count: int = 1
    pipe: StepPipe | None = None
    faults: FaultInjector | None = field(default=None, repr=False)

    @property
    def chief(self) -> bool:
        return self.index == 0

    @classmethod
    def from_env(cls, checkpoint_dir: Path, environ: Mapping[str, str] | None = None) -> "WorkerInfo":
        """Read ``TF_CONFIG``, the progress pipe and ``TRAINGUARD_FAULT``.

        Raises:
            ConfigError: an unknown ``TRAINGUARD_*`` variable, a malformed
                ``TF_CONFIG`` or fault, a fault in a phase this adapter
                cannot strike.
        """
        environ = os.environ if environ is None else environ
        check_env(environ)
        index, count = _task(environ.get("TF_CONFIG", ""))
        try:
            pipe = StepPipe.from_env(environ)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        specs = faults_from_env(environ)
        faults = FaultInjector(specs, index, world_size=count,
                               log_path=checkpoint_dir / ".trainguard" / "faults.jsonl")
        faults.refuse(f"the TensorFlow adapter strikes faults in phases {', '.join(PHASES)} only",
                      phases=set(p for p in (s.phase for s in specs) if p not in PHASES))
        faults.refuse("the TensorFlow adapter has no collectives of its own to stall", kinds=("stall",))
        return cls(index, count, pipe, faults)

    def send(self, kind: str, step: int) -> None:
        if self.pipe is not None:
            self.pipe.send(kind, step)

    def strike(self, phase: str, step: int) -> None:
        if self.faults is not None:
            self.faults.strike(phase, step)


def _task(text: str) -> tuple[int, int]:
    """``(task index, number of workers)`` from ``TF_CONFIG`` (none: 0 of 1).
    A ``chief`` task counts as worker 0 and the workers after it, as
    ``MultiWorkerMirroredStrategy`` orders them."""
    if not text.strip():
        return 0, 1
    try:
        config = json.loads(text)
        cluster, task = config["cluster"], config["task"]
        chief = len(cluster.get("chief", []))
        count = chief + len(cluster.get("worker", []))
        kind, index = task["type"], int(task["index"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"TF_CONFIG is not a cluster and task ({e!r})") from None
    if kind not in ("chief", "worker") or count < 1:
        raise ConfigError(f"TF_CONFIG task type {kind!r}: trainguard supports chief and worker tasks "
                          f"(MultiWorkerMirroredStrategy)")
    return (index if kind == "chief" else chief + index), count


def refuse_restart_on_error() -> None:
    """Under the launcher, let an uncaught :class:`TrainguardError` (a
    checkpoint this worker cannot resume from, a setting it refused) end the
    process with ``EXIT_UNRECOVERABLE`` (76): the launcher then stops the job
    instead of restarting it into the same refusal."""
    previous = sys.excepthook
    if getattr(previous, "_trainguard", False):
        return

    def hook(kind, value, tb) -> None:
        previous(kind, value, tb)
        if isinstance(value, TrainguardError):
            sys.stderr.flush()
            os._exit(EXIT_UNRECOVERABLE)

    hook._trainguard = True  # type: ignore[attr-defined]
    sys.excepthook = hook


# --------------------------------------------------- host random streams
def python_state() -> list:
    """Python's ``random`` state as JSON values."""
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def set_python_state(state: Any) -> None:
    version, internal, gauss = state
    random.setstate((version, tuple(internal), gauss))


def numpy_state() -> list | None:
    """NumPy's global ``RandomState`` as JSON values (``None``: no NumPy)."""
    np = sys.modules.get("numpy")
    if np is None:
        return None
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return [name, [int(k) for k in keys], int(pos), int(has_gauss), float(gauss)]


def set_numpy_state(state: Any) -> None:
    if state is None:
        return
    import numpy as np

    name, keys, pos, has_gauss, gauss = state
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
