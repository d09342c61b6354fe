"""Settings: one frozen dataclass per component, read from the environment once.

Every ``TRAINGUARD_*`` variable the project understands is listed in
:data:`ENV`; an unknown one is an error (a typo such as
``TRAINGUARD_STRATEGY`` must not silently leave a job unprotected).
Arguments given in code win over the environment only where a caller passes
them explicitly to :meth:`ControllerConfig.from_env`.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from .api import ConfigError, Strategy
from .config_env import ENV, Setting
from .faults import FaultSpec, faults_from_env
from .secret import TLS

__all__ = ["DEFAULT_MAX_RESTARTS", "ENV", "HEARTBEATS_PER_S", "ControllerConfig", "PersistConfig", "ProcessorConfig",
           "RankConfig", "Setting", "WatchdogConfig", "check_env", "launch_defaults", "parse_strategies"]

#: Heartbeats a second one controller is sized for (see heartbeat_interval_for).
HEARTBEATS_PER_S = 4096

#: The restart budget of a ``trainguard run`` launch without ``--max-restarts``
#: (see :func:`launch_defaults` and docs/recovery.md): enough for a long
#: job's faults between relaunches (each process restarted alone, or the
#: group after a dump, spends one), few enough that a fault that keeps coming
#: back ends the launch within minutes.
DEFAULT_MAX_RESTARTS = 10


def launch_defaults(max_restarts: int | None) -> tuple[int, tuple[Strategy, ...]]:
    """What ``trainguard run`` uses when the user named neither a restart
    budget (``None``: :data:`DEFAULT_MAX_RESTARTS`) nor strategies: a lost
    process is started again in place while the others keep running
    (``recover-in-place``), and a dump is the way out only when that cannot
    work; with no budget (``--max-restarts 0``) no process can be restarted,
    so the list leaves ``recover-in-place`` out rather than plan on it.

    Returns:
        ``(max_restarts, strategies)``.
    """
    budget = DEFAULT_MAX_RESTARTS if max_restarts is None else max_restarts
    if budget > 0:
        return budget, (Strategy.RETRY, Strategy.RECOVER_IN_PLACE, Strategy.DUMP, Strategy.EXIT)
    return budget, (Strategy.RETRY, Strategy.DUMP, Strategy.EXIT)


def check_env(environ: Mapping[str, str] | None = None) -> None:
    """Refuse unknown ``TRAINGUARD_*`` variables.

    Raises:
        ConfigError: naming the variable and the closest known one.
    """
    environ = os.environ if environ is None else environ
    for name in environ:
        if name.startswith("TRAINGUARD_") and name not in ENV:
            close = difflib.get_close_matches(name, list(ENV), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"unknown setting {name}{hint} (known: {', '.join(sorted(ENV))})")


def parse_strategies(text: str | tuple | list) -> tuple[Strategy, ...]:
    """Parse ``"retry,dump,exit"`` (or a list of names) into strategies.

    Raises:
        ConfigError: an empty list, an unknown name or a repeated one.
    """
    names = [n.strip() for n in text.split(",")] if isinstance(text, str) else [str(n).strip() for n in text]
    names = [n for n in names if n]
    if not names:
        raise ConfigError("the recover-strategy list is empty; give at least one of "
                          + ", ".join(s.value for s in Strategy))
    valid = {s.value: s for s in Strategy}
    out: list[Strategy] = []
    for name in names:
        if name not in valid:
            raise ConfigError(f"unknown recover strategy {name!r}; valid: {', '.join(valid)}")
        if valid[name] in out:
            raise ConfigError(f"recover strategy {name!r} is listed twice")
        out.append(valid[name])
    return tuple(out)


def _number(name: str, value: str, kind: type) -> Any:
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a valid {kind.__name__}") from None


@dataclass(frozen=True)
class WatchdogConfig:
    """When a rank's watchdog calls a step hung (:mod:`.rank.watchdog`)."""

    enabled: bool = True
    steps_factor: float = 3.0
    min_limit_s: float = 2.0
    first_step_s: float = 600.0
    first_section_s: float = 600.0
    section_factor: float = 3.0
    benign_pause_steps: float = 5.0  # a peer may pause this long without blame
    window: int = 50  # recent steps the median is taken over
    poll_s: float = 0.25

    def __post_init__(self) -> None:
        for name in ("steps_factor", "min_limit_s", "first_step_s", "first_section_s", "section_factor",
                     "benign_pause_steps", "poll_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"watchdog {name} must be > 0, got {getattr(self, name)!r}")
        if self.steps_factor < 1 or self.section_factor < 1:
            raise ConfigError("watchdog factors must be >= 1 (a limit below the typical time alarms every step)")


@dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    """How the controller detects, decides and drives recoveries."""

    strategies: tuple[Strategy, ...] = (Strategy.RETRY, Strategy.DUMP, Strategy.EXIT)
    host: str = "127.0.0.1"
    port: int = 0
    heartbeat_interval_s: float | None = None  # None: see heartbeat_interval_for
    heartbeat_misses: int = 3
    # Before a rank has a step time: MindSpore's graph compile of ResNet-152
    # held the GIL (so the heartbeat thread) for 5.5 s at a stretch.
    first_step_silence_s: float = 600.0
    prelock_timeout_s: float = 30.0
    handler_timeout_s: float = 180.0
    save_timeout_s: float = 1800.0
    max_message_bytes: int = 1 << 20
    job_id: str = "trainguard"
    max_restarts: int = 0  # process restarts the job may make (torchrun's --max-restarts)
    restart_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if isinstance(self.strategies, (str, list)):
            object.__setattr__(self, "strategies", parse_strategies(self.strategies))
        if self.max_restarts < 0:
            raise ConfigError(f"max_restarts must be >= 0, got {self.max_restarts}")
        for f in ("heartbeat_interval_s", "first_step_silence_s", "prelock_timeout_s", "handler_timeout_s",
                  "save_timeout_s", "restart_timeout_s"):
            if getattr(self, f) is not None and not getattr(self, f) > 0:
                raise ConfigError(f"{f} must be > 0, got {getattr(self, f)!r}")
        if self.heartbeat_misses < 1:
            raise ConfigError(f"heartbeat_misses must be >= 1, got {self.heartbeat_misses}")
        if not 1024 <= self.max_message_bytes <= 64 << 20:
            raise ConfigError(f"max_message_bytes must be in [1 KiB, 64 MiB], got {self.max_message_bytes}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if not (0 < len(self.job_id) <= 200 and self.job_id.isprintable() and not any(
                c.isspace() or c in "/\\" for c in self.job_id)):  # it names files, and every log line has it
            raise ConfigError(f"job id {self.job_id[:80]!r}: 1 to 200 printable characters, no blank, / or \\")

    def heartbeat_interval_for(self, world_size: int) -> float:
        """The heartbeat interval for a job of ``world_size`` ranks: the
        configured one, else 1 s, stretched above 4096 ranks so that one
        controller receives at most ~4096 heartbeats a second (each costs
        ~70 us of its event loop in grpc.aio)."""
        if self.heartbeat_interval_s is not None:
            return self.heartbeat_interval_s
        return max(1.0, world_size / HEARTBEATS_PER_S)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "ControllerConfig":
        """Build from ``TRAINGUARD_*`` variables; explicit ``overrides`` win.

        Raises:
            ConfigError: an unknown variable or an invalid value.
        """
        environ = os.environ if environ is None else environ
        check_env(environ)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(overrides) - set(fields)
        if unknown:
            raise ConfigError(f"unknown controller settings: {sorted(unknown)}")
        values: dict[str, Any] = {}
        for name, f in fields.items():
            raw = environ.get(f"TRAINGUARD_{name.upper()}")
            if raw is None:
                continue
            kind = str(f.type)
            if name == "strategies":
                values[name] = parse_strategies(raw)
            elif kind.startswith("int"):
                values[name] = _number(f"TRAINGUARD_{name.upper()}", raw, int)
            elif kind.startswith("float"):
                values[name] = _number(f"TRAINGUARD_{name.upper()}", raw, float)
            else:
                values[name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class ProcessorConfig:
    """Where a rank's processor connects and how long it waits."""

    controller: str
    token: str
    rank: int
    world_size: int
    max_message_bytes: int = 1 << 20
    connect_timeout_s: float = 60.0
    exit_grace_s: float = 10.0  # after an exit command, before forcing the exit
    watchdog: WatchdogConfig = WatchdogConfig()
    tls: TLS | None = None  # when the rank talks to a controller that serves TLS (msrun's workers)

    def __post_init__(self) -> None:
        host, sep, port = self.controller.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"controller address must be host:port, got {self.controller!r}")
        if not self.token:
            raise ConfigError("the job token is empty; the launcher must set TRAINGUARD_TOKEN")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside a world of {self.world_size}")

    @classmethod
    def from_env(cls, *, rank: int, world_size: int,
                 environ: Mapping[str, str] | None = None) -> "ProcessorConfig | None":
        """The processor settings the launcher left in the environment, or
        ``None`` when no controller was started for this job.

        Raises:
            ConfigError: an unknown variable, or a controller without a token.
        """
        environ = os.environ if environ is None else environ
        check_env(environ)
        address = environ.get("TRAINGUARD_CONTROLLER")
        if not address:
            return None
        size = environ.get("TRAINGUARD_MAX_MESSAGE_BYTES")
        return cls(
            controller=address,
            token=environ.get("TRAINGUARD_TOKEN", ""),
            rank=rank,
            world_size=world_size,
            watchdog=watchdog_from_env(environ),
            tls=TLS.from_env(environ),
            **({"max_message_bytes": _number("TRAINGUARD_MAX_MESSAGE_BYTES", size, int)} if size else {}),
        )


@dataclass(frozen=True, kw_only=True)
class RankConfig:
    """What the launcher and the environment tell a rank's Guard, read once
    when the Guard starts: a bad value is an error before step 0, and the
    Guard's parts are handed these values instead of reading the
    environment behind its arguments."""

    job_id: str = ""
    save_timeout_s: float = 1800.0  # a dying-gasp save, and the last persists at the end
    node_dir: str | None = None  # the node agent's snapshot directory (own-part records, repairs)
    snapshot_peer: str | None = None  # host:port of the next node's snapshot copies
    snapshot_overlap: bool = True  # torch: copy a snapshot beside the next step
    shm_repair: bool = True  # MindSpore: a repair on one machine goes through /dev/shm
    restart_count: int = 0  # torchrun's restarts of this worker so far
    snapshot_root: str | None = None  # where a directory of the process's own goes (None: /dev/shm)
    token: str = field(default="", repr=False)  # the job secret the snapshot copies on the peer node are fetched with
    checkpoint_dir: str | None = None  # Megatron's TTP flow, when Megatron-LM's args.save/args.load are not there
    controller: str | None = None  # the launcher's controller (host:port), when it serves one
    join: str | None = None  # what a replacement process joins (JSON from the node agent; None: not one)
    faults: tuple[FaultSpec, ...] = ()  # the whole job's injected faults: every rank checks them alike
    inner_backend: str = "gloo"  # torch: what runs inside the groups of init_process_group("trainguard")
    run_id: str = "run"  # torchrun's rendezvous id; with the round below, it names the workers' store prefix
    store_round: str | None = None  # the node agent's name of this round's worker store (None: restart_count)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "RankConfig":
        """The rank's settings from the environment.

        Raises:
            ConfigError: an unknown variable, or a value that does not parse.
        """
        environ = os.environ if environ is None else environ
        check_env(environ)
        inner = environ.get("TRAINGUARD_INNER_BACKEND", "gloo")
        if inner not in ("gloo", "nccl"):
            raise ConfigError(f"TRAINGUARD_INNER_BACKEND={inner!r}: choose gloo or nccl")
        return cls(
            job_id=environ.get("TRAINGUARD_JOB_ID", ""),
            save_timeout_s=_positive("TRAINGUARD_SAVE_TIMEOUT_S", environ.get("TRAINGUARD_SAVE_TIMEOUT_S", "1800")),
            node_dir=environ.get("TRAINGUARD_SNAPSHOT_DIR") or None,
            snapshot_peer=environ.get("TRAINGUARD_SNAPSHOT_PEER") or None,
            snapshot_overlap=_switch("TRAINGUARD_SNAPSHOT_OVERLAP", environ.get("TRAINGUARD_SNAPSHOT_OVERLAP", "1"),
                                     "use 1 (copy beside the next step) or 0 (in line)"),
            shm_repair=_switch("TRAINGUARD_SHM_REPAIR", environ.get("TRAINGUARD_SHM_REPAIR", "1"), "use 0 or 1"),
            restart_count=_number("TORCHELASTIC_RESTART_COUNT", environ.get("TORCHELASTIC_RESTART_COUNT", "0"), int),
            snapshot_root=environ.get("TRAINGUARD_SNAPSHOT_ROOT") or None,
            token=environ.get("TRAINGUARD_TOKEN", ""),
            checkpoint_dir=environ.get("TRAINGUARD_CHECKPOINT_DIR") or None,
            controller=environ.get("TRAINGUARD_CONTROLLER") or None,
            join=environ.get("TRAINGUARD_JOIN") or None,
            faults=faults_from_env(environ), inner_backend=inner,
            run_id=environ.get("TORCHELASTIC_RUN_ID", "run"),
            store_round=environ.get("TRAINGUARD_STORE_ROUND") or None,
        )


@dataclass(frozen=True, kw_only=True)
class PersistConfig:
    """What a persist worker process (:mod:`.snapshot.persist`) is told by
    the trainer that starts it, read once in its ``main``."""

    parent_pid: int  # the trainer's: a worker started after its trainer died has another parent already
    token: str = field(default="", repr=False)  # the job secret its pushes to the peer node carry
    log_level: str = "INFO"
    rank: str = "?"  # for its log lines

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "PersistConfig":
        """The worker's settings (no :func:`check_env`: the trainer's
        environment, checked there; the worker must not die on it, or it
        is restarted for every request).

        Raises:
            ConfigError: a ``TRAINGUARD_PERSIST_PARENT`` that is not a pid.
        """
        environ = os.environ if environ is None else environ
        parent = environ.get("TRAINGUARD_PERSIST_PARENT")
        return cls(parent_pid=_number("TRAINGUARD_PERSIST_PARENT", parent, int) if parent else os.getppid(),
                   token=environ.get("TRAINGUARD_TOKEN", ""), log_level=environ.get("TRAINGUARD_LOG_LEVEL", "INFO"),
                   rank=environ.get("RANK", "?"))


def _positive(name: str, value: str) -> float:
    number = _number(name, value, float)
    if not number > 0:
        raise ConfigError(f"{name}={value!r} must be > 0")
    return number


def _switch(name: str, value: str, hint: str) -> bool:
    if value not in ("0", "1"):
        raise ConfigError(f"{name}={value!r}: {hint}")
    return value == "1"


def watchdog_from_env(environ: Mapping[str, str]) -> WatchdogConfig:
    switch = environ.get("TRAINGUARD_WATCHDOG", "on").strip().lower()
    if switch not in ("on", "off", "1", "0", "true", "false"):
        raise ConfigError(f"TRAINGUARD_WATCHDOG must be on or off, got {switch!r}")
    fields = {"TRAINGUARD_HANG_STEPS": ("steps_factor",), "TRAINGUARD_HANG_MIN_S": ("min_limit_s",),
              "TRAINGUARD_FIRST_STEP_TIMEOUT_S": ("first_step_s", "first_section_s")}
    values = {field: _number(name, environ[name], float)
              for name, names in fields.items() if environ.get(name) for field in names}
    return WatchdogConfig(enabled=switch in ("on", "1", "true"), **values)
