"""Fault injection: rehearse a failure exactly where and when you choose.

A fault is written as ``KIND:rank=R,step=N[,phase=P][,factor=F][,severity=S]``
and several are joined by ``;`` — in ``TRAINGUARD_FAULT``, in an example's
config, or built in code::

    FaultSpec.parse("uce:rank=1,step=5,phase=backward;crash:rank=2,step=9")

Kinds:

* ``uce``   raise a device memory error (``UCE ERROR ...``) in the chosen phase
* ``comm``  raise a communication error (``SUSPECT REMOTE ERROR ...``)
* ``crash`` SIGKILL the rank's own process
* ``hang``  stop making progress (sleep forever in Python)
* ``freeze`` hold the interpreter for good, as a call stuck in a driver
  does: no thread of the rank runs again (its heartbeats stop), yet the
  process lives
* ``stop``  SIGSTOP the rank's own process (frozen, as a stuck host makes it)
* ``stall`` from then on the rank's collectives are never sent (a
  black-holed link) until the group is rebuilt: every rank waits, alive
* ``slow``  from step N on, sleep ``(factor - 1) x`` each step's duration
* ``pause`` a benign pause of ``factor x`` the median step time so far: with
  ``phase=gc`` a garbage collection that holds every thread for that long,
  with ``phase=save`` a checkpoint save that slow

Phases: ``forward``, ``backward``, ``reduce`` (MindSpore Guard only: the
replicas agreed to update and wait in the gradient all-reduce), ``optimizer``
(inside the update, after the parameters changed), ``recovery`` (while
handling a recovery command; ``step`` is then the locked step), ``save``
(inside a checkpoint save), ``gc`` (at the start of a step; ``pause``
only) and ``resume`` (while the rank loads the state of ``step`` to resume
from it -- a relaunch's start, or a replacement process joining; ``uce``,
``comm``, ``crash`` or ``stop``). ``step`` counts completed updates, so ``step=5`` strikes the loop
iteration that would complete update 6.

Every rank checks the whole spec against the job before its first step: a
fault for a rank the job does not have (:func:`check_ranks`), or one an
adapter cannot strike (:meth:`FaultInjector.refuse`), is a ``ConfigError``
on every rank, so a rehearsal never passes without its fault and no rank
waits for a peer that refused.

Each fault strikes once per job. When a log path is given (the adapters use
``<checkpoint_dir>/.trainguard/faults.jsonl``) the strike is appended there
before it happens, so a relaunched job does not strike it again, and the
strike time is known for reporting detection latency.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

from .api import ConfigError, Severity

__all__ = ["FaultInjector", "FaultSpec", "KINDS", "PHASES", "check_ranks", "faults_from_env", "read_fault_log"]

KINDS = ("uce", "crash", "hang", "freeze", "stop", "stall", "comm", "slow", "pause")
PHASES = ("forward", "backward", "reduce", "optimizer", "recovery", "save", "gc", "resume")
_KEYS = {"rank", "step", "phase", "factor", "severity"}


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    rank: int
    step: int
    phase: str = "forward"
    factor: float = 1.0
    severity: Severity = Severity.HIGH

    @property
    def text(self) -> str:
        extra = f",factor={self.factor:g}" if self.kind in ("slow", "pause") else ""
        if self.kind == "uce" and self.severity is not Severity.HIGH:
            extra += f",severity={self.severity.name.lower()}"
        return f"{self.kind}:rank={self.rank},step={self.step},phase={self.phase}{extra}"

    @classmethod
    def parse(cls, text: str) -> list["FaultSpec"]:
        """Parse one or more ``;``-separated faults.

        Raises:
            ConfigError: naming the part that is wrong and the expected form.
        """
        specs = []
        for part in (p.strip() for p in text.split(";")):
            if part:
                specs.append(cls._parse_one(part))
        return specs

    @classmethod
    def _parse_one(cls, part: str) -> "FaultSpec":
        form = "KIND:rank=R,step=N[,phase=forward|backward|reduce|optimizer|recovery|save|gc|resume][,factor=F]"
        kind, sep, rest = part.partition(":")
        kind = kind.strip().lower()
        if not sep or kind not in KINDS:
            raise ConfigError(f"bad fault {part!r}: expected {form} with KIND in {', '.join(KINDS)}")
        fields: dict[str, str] = {}
        for item in filter(None, (i.strip() for i in rest.split(","))):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or key not in _KEYS:
                raise ConfigError(f"bad fault {part!r}: unknown or malformed item {item!r}; expected {form}")
            if key in fields:
                raise ConfigError(f"bad fault {part!r}: {key} given twice")
            fields[key] = value.strip()
        missing = {"rank", "step"} - set(fields)
        if missing:
            raise ConfigError(f"bad fault {part!r}: missing {', '.join(sorted(missing))}; expected {form}")
        try:
            rank, step = int(fields["rank"]), int(fields["step"])
            factor = float(fields.get("factor", "1"))
        except ValueError:
            raise ConfigError(f"bad fault {part!r}: rank and step must be integers, factor a number") from None
        if rank < 0 or step < 0:
            raise ConfigError(f"bad fault {part!r}: rank and step must be >= 0")
        phase = fields.get("phase", "forward").lower()
        if phase not in PHASES:
            raise ConfigError(f"bad fault {part!r}: phase must be one of {', '.join(PHASES)}")
        if "factor" in fields and kind not in ("slow", "pause"):
            raise ConfigError(f"bad fault {part!r}: factor only applies to slow and pause")
        if kind == "slow" and not factor >= 1.0:
            raise ConfigError(f"bad fault {part!r}: slow needs factor >= 1, got {factor}")
        if kind == "pause" and (phase not in ("gc", "save") or not factor > 0):
            raise ConfigError(f"bad fault {part!r}: pause needs phase=gc or phase=save and factor > 0")
        if phase == "gc" and kind != "pause":
            raise ConfigError(f"bad fault {part!r}: phase=gc is for pause only")
        if phase == "resume" and kind not in ("uce", "comm", "crash", "stop"):
            # Before a rank reports to the controller only its exit or a collective timeout can be seen.
            raise ConfigError(f"bad fault {part!r}: phase=resume takes uce, comm, crash or stop (a hang while "
                              f"resuming is found only at the collective's timeout)")
        severity = Severity.HIGH
        if "severity" in fields:
            if kind != "uce":
                raise ConfigError(f"bad fault {part!r}: severity only applies to uce")
            try:
                severity = Severity[fields["severity"].upper()]
            except KeyError:
                raise ConfigError(f"bad fault {part!r}: severity must be low, high or corrupted") from None
        return cls(kind, rank, step, phase, factor, severity)


def check_ranks(specs: Iterable[FaultSpec], world_size: int) -> None:
    """Refuse a fault for a rank outside ``range(world_size)``: it would never
    strike, and the rehearsal would end as if it had passed.

    Raises:
        ConfigError: naming the first such fault and the world size.
    """
    for spec in specs:
        if spec.rank >= world_size:
            raise ConfigError(f"fault {spec.text!r} is for rank {spec.rank}, but the world size is {world_size} "
                              f"(ranks 0-{world_size - 1}): it would never strike")


def read_fault_log(path: str | os.PathLike) -> list[dict]:
    """The strikes recorded in a fault log (missing file: none)."""
    try:
        lines = Path(path).read_text().splitlines()
    except (FileNotFoundError, NotADirectoryError):  # a checkpoint_dir below a file: its own check says so
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a strike cut short by the kill it announced
    return out


def faults_from_env(environ: Mapping[str, str]) -> tuple[FaultSpec, ...]:
    """The whole job's faults (``TRAINGUARD_FAULT``: the launcher checks
    them, every rank injects its own).

    Raises:
        ConfigError: a malformed fault (the message names the variable).
    """
    try:
        return tuple(FaultSpec.parse(environ.get("TRAINGUARD_FAULT", "")))
    except ConfigError as e:
        raise ConfigError(f"TRAINGUARD_FAULT: {e}") from None


class FaultInjector:
    """Strikes this rank's faults at the injection points adapters call.

    Args:
        specs: every fault of the job (only this rank's strike here).
        rank: this process's rank.
        world_size: the job's; a fault for a rank outside it is refused
            (``None``: not checked).
        log_path: where strikes are recorded (``None``: memory only).
        kill, sleep, clock: injected for tests.
    """

    def __init__(
        self,
        specs: Iterable[FaultSpec],
        rank: int,
        *,
        world_size: int | None = None,
        log_path: str | os.PathLike | None = None,
        kill: Callable[[int, int], None] = os.kill,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.time,
    ) -> None:
        #: The whole job's faults: what every rank checks alike.
        self.specs = tuple(specs)
        if world_size is not None:
            check_ranks(self.specs, world_size)
        self._log = Path(log_path) if log_path else None
        struck = {e.get("spec") for e in read_fault_log(self._log)} if self._log else set()
        self._pending = [s for s in self.specs if s.rank == rank and s.text not in struck]
        self._rank = rank
        self._kill, self._sleep, self._clock = kill, sleep, clock
        self._slow = [s for s in self._pending if s.kind == "slow"]
        self._pending = [s for s in self._pending if s.kind != "slow"]
        self._step_times: list[float] = []
        #: Called for ``stall``: the adapter drops the rank's next collective.
        self.on_stall: Callable[[], None] = lambda: None

    @classmethod
    def from_env(cls, rank: int, *, environ: Mapping[str, str] | None = None, **kwargs) -> "FaultInjector":
        """The faults of ``TRAINGUARD_FAULT``, for a script without a Guard
        (a Guard passes its :attr:`RankConfig.faults
        <trainguard.core.RankConfig.faults>`); pass ``world_size`` to have
        them checked.

        Raises:
            ConfigError: a malformed fault (the message names the variable).
        """
        return cls(faults_from_env(os.environ if environ is None else environ), rank, **kwargs)

    def refuse(self, why: str, *, phases: Iterable[str] = (), kinds: Iterable[str] = ()) -> None:
        """Refuse the job's faults in ``phases`` or of ``kinds``: those an
        adapter cannot strike. Any rank's fault counts, so every rank refuses
        the same spec before its first collective and none waits for a
        peer that refused.

        Raises:
            ConfigError: ``fault '<spec>': <why>``, for the first such fault.
        """
        phases, kinds = set(phases), set(kinds)
        spec = next((s for s in self.specs if s.phase in phases or s.kind in kinds), None)
        if spec is not None:
            raise ConfigError(f"fault {spec.text!r}: {why}")

    @property
    def armed(self) -> bool:
        return bool(self._pending or self._slow)

    def wants(self, phase: str) -> bool:
        """Whether any pending fault of this rank strikes in ``phase`` (lets
        adapters skip installing hooks they do not need; to refuse a phase
        use :meth:`refuse`, which every rank answers alike)."""
        return any(s.phase == phase for s in self._pending)

    def strike(self, phase: str, step: int) -> None:
        """Strike the pending fault for ``(phase, step)``, if any.

        Raises:
            RuntimeError: for ``uce`` and ``comm``, with the text real
                devices and networks produce.
        """
        spec = next((s for s in self._pending if s.phase == phase and s.step == step), None)
        if spec is None:
            return
        self._pending.remove(spec)
        seconds = spec.factor * (statistics.median(self._step_times) if self._step_times else 1.0)
        self._record(spec, step, **({"seconds": seconds} if spec.kind == "pause" else {}))
        where = f"rank {self._rank}, step {step}, {phase}"
        if spec.kind == "uce":
            raise RuntimeError(f"UCE ERROR [severity={spec.severity.name.lower()}]: trainguard injected "
                               f"device memory error ({where})")
        if spec.kind == "comm":
            raise RuntimeError(f"SUSPECT REMOTE ERROR: trainguard injected communication failure ({where})")
        if spec.kind == "crash":
            self._kill(os.getpid(), signal.SIGKILL)
        elif spec.kind == "stop":
            self._kill(os.getpid(), signal.SIGSTOP)
        elif spec.kind == "stall":
            self.on_stall()
        elif spec.kind == "hang":
            while True:
                self._sleep(3600)
        elif spec.kind == "freeze":
            _freeze()
        elif spec.kind == "pause":
            if phase == "gc":
                _gc_pause(seconds)
            else:
                self._sleep(seconds)

    def after_step(self, step: int, step_seconds: float) -> None:
        """Stretch the step that just completed ``step`` updates (``slow``)."""
        self._step_times.append(step_seconds)
        for spec in self._slow:
            if step > spec.step:
                self._sleep((spec.factor - 1.0) * step_seconds)

    def _record(self, spec: FaultSpec, step: int, **extra) -> None:
        if self._log is None:
            return
        entry = {"spec": spec.text, "rank": self._rank, "step": step, "phase": spec.phase,
                 "kind": spec.kind, "time": self._clock(), "pid": os.getpid(), **extra}
        self._log.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(entry) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)


def _freeze() -> None:
    """Hold the GIL for good: the switch interval is made a day long, and a
    loop without a call that releases it spins on (a core busy, as a stuck
    driver call often keeps one)."""
    import sys

    sys.setswitchinterval(86400.0)
    while True:
        pass


def _gc_pause(seconds: float) -> None:
    """A garbage collection that holds the interpreter for ``seconds``: a
    callback busy-waits inside the collection with the GIL kept (the switch
    interval stretched), so no other thread -- heartbeats included -- runs."""
    def hold(phase: str, info: dict) -> None:
        if phase != "start":
            return
        gc.callbacks.remove(hold)
        interval = sys.getswitchinterval()
        sys.setswitchinterval(seconds + 1.0)
        try:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass
        finally:
            sys.setswitchinterval(interval)

    gc.callbacks.append(hold)
    gc.collect()
