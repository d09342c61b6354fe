"""The processor: a rank's link to the controller.

It keeps the rank's status (step, run status, data status), sends it as a
heartbeat, sends fault reports and command results at once, and receives
commands on a background thread. A STOP command sets :attr:`stop_event` and
runs the stop listeners on that thread (the adapters use them to release
collectives stuck on a faulty peer); every command is also queued for the
training thread, which executes it in :mod:`trainguard.core.rank.recovery`.

The per-step calls :meth:`start_update` and :meth:`end_update` only change a
field (after checking the transition); they never touch the network (the
rank's standing: :mod:`.standing`).

The same thread polls the rank's :class:`~.watchdog.ProgressWatchdog` a few
times a second and reports a hang the moment the training loop has gone too
long without completing a step (the controller then ends this process and
handles it as lost). The watchdog is paused while a recovery runs.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import grpc

from ..api import (EXIT_HUNG, ControllerLostError, FaultKind, ProtocolError, RankStatus, RunStatus, Severity,
                   TransitionError)
from .. import forks
from ..checkpoint_parts import FileInfo, SavedShard
from ..commands import Command, CommandResult, Exit, Stop
from ..config import ProcessorConfig
from ..control import wire
from ..protocol import trainguard_pb2 as pb
from ..replicas import ReplicaGroup
from ..handshake import Impostor, login
from ..rpc import SERVICE, client_channel, status_to_pb
from . import messages
from .standing import Standing
from .watchdog import ProgressWatchdog, WatchdogConfig

if TYPE_CHECKING:
    from ..snapshot.health import Failing

__all__ = ["Processor"]

log = logging.getLogger("trainguard.processor")

_CLOSE = object()
_LOST = object()
#: Session errors worth another try while connecting (the server was busy).
_RETRYABLE = ("CANCELLED", "UNAVAILABLE", "RESOURCE_EXHAUSTED")
_WAKE = object()  # re-arm the heartbeat timer (the interval arrives with Welcome)


class Processor(Standing):
    """One per training process.

    Args:
        config: controller address, token, rank and world size; ``None``
            makes an offline processor (no controller: statuses are kept,
            nothing is sent, and a recovery cannot be coordinated).
        rank: this rank, when ``config`` is ``None``.
        force_exit: how the process is ended when the training thread does
            not leave within the grace time after an exit command.
        clock: unix seconds, for fault timestamps.
    """

    def __init__(self, config: ProcessorConfig | None, *, rank: int = 0,
                 force_exit: Callable[[int], None] = os._exit, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.rank = config.rank if config is not None else rank
        self.world_size = config.world_size if config is not None else 1
        super().__init__(self.rank)
        self.stops = 0  # STOP commands received; a handler compares it to notice a new one
        self.stop_event = threading.Event()
        self.job_id = ""
        self._force_exit = force_exit
        self._clock = clock
        self._outbox: queue.Queue = queue.Queue()
        self._commands: queue.Queue = queue.Queue()
        self._stop_listeners: list[Callable[[], None]] = []
        self._welcome = threading.Event()
        self._lost = threading.Event()
        self._error: str = ""
        self._heartbeat_s = 1.0
        self._call = None
        self._channel = None
        self._reader: threading.Thread | None = None
        self._exit_timer: threading.Timer | None = None
        wd = config.watchdog if config is not None else WatchdogConfig(enabled=False)
        self.watchdog = ProgressWatchdog(wd, track_gc=wd.enabled)
        self.watchdog.on_section = self._section_opened

    # ---------------------------------------------------------- connection
    def connect(self, *, step: int = 0, replicas: Sequence[ReplicaGroup] = (), device: str = "cpu",
                device_repairable: bool = True, restart_count: int = 0, joining: bool = False,
                resumed_after_dump: str = "", join_refused: str = "") -> None:
        """Register with the controller and start the background thread
        (``joining``: this process replaces a lost one in a recovery;
        ``resumed_after_dump``: the cause of the dying gasp it resumed from, or "";
        ``join_refused``: why no new process can join this job, if so).

        A session the controller's server cancels or cannot accept yet
        (thousands of ranks registering at once) is retried with jitter until
        ``connect_timeout_s``.

        Raises:
            ControllerLostError: the controller did not answer in time.
            ProtocolError: it refused the registration (wrong token, ...).
        """
        if self.config is None:
            raise ControllerLostError("an offline processor cannot connect")
        self.step = step
        hello = messages.hello(self.rank, self.config.world_size, self._status(), replicas,
                               device=device, device_repairable=device_repairable, restart_count=restart_count,
                               joining=joining, resumed_after_dump=resumed_after_dump,
                               join_refused=join_refused)
        # A forked child (a DataLoader worker) keeping this connection open
        # would outlive the rank: its replacement would be refused as a rank
        # already connected (see :mod:`..forks`).
        forks.keep_peer_from_children(self.config.controller)
        self._channel = client_channel(self.config.controller, self.config.max_message_bytes, self.config.tls)
        session = self._channel.stream_stream(
            f"/{SERVICE}/Session",
            request_serializer=pb.RankMessage.SerializeToString,
            response_deserializer=pb.ControllerMessage.FromString,
        )
        deadline = time.monotonic() + self.config.connect_timeout_s
        while True:
            self._lost.clear()
            self._outbox = queue.Queue()
            self._commands = queue.Queue()  # a refused attempt leaves its end-of-session marker behind
            metadata = self._login()
            if metadata is not None:
                self._call = session(self._requests(hello), metadata=metadata)
                self._reader = threading.Thread(target=self._receive, name=f"trainguard-processor-{self.rank}",
                                                daemon=True)
                self._reader.start()
            while not self._welcome.wait(0.05) and not self._lost.is_set() and time.monotonic() < deadline:
                pass
            if self._welcome.is_set():
                break
            if self._lost.is_set() and not self._error.startswith(_RETRYABLE):
                raise ProtocolError(f"controller at {self.config.controller} refused rank {self.rank}: {self._error}")
            if time.monotonic() >= deadline:
                self.close(finished=False)
                raise ControllerLostError(
                    f"no answer from the controller at {self.config.controller} "
                    f"within {self.config.connect_timeout_s:g} s ({self._error or 'no reply'})")
            if self._reader is not None:
                self._reader.join(timeout=5)
            time.sleep(random.uniform(0.1, 1.0))
        if not joining:
            # A replacement has not trained: it stays STARTING until its
            # recovery's first command (recover), and trains after the resume.
            self.set_run(RunStatus.TRAINING, "registered")
        self.watchdog.arm()

    def _login(self) -> tuple | None:
        """The session's proof, made once the controller proved the secret (nothing is sent that could open an
        impostor); ``None``, the error kept, when the handshake failed."""
        try:
            return login(self._channel, self.config.token, self.config.controller, f"/{SERVICE}/Session")
        except Impostor as e:
            raise ProtocolError(f"rank {self.rank}: {e}") from None
        except grpc.RpcError as e:
            self._error = f"{e.code().name}: {e.details()}"
            self._lost.set()
            return None

    def _requests(self, hello: pb.RankMessage) -> Iterable[pb.RankMessage]:
        yield hello
        poll = self.watchdog.config.poll_s if self.watchdog.config.enabled else float("inf")
        sent = time.monotonic()
        while True:
            wait = max(0.0, min(poll, sent + self._heartbeat_s - time.monotonic()))
            try:
                msg = self._outbox.get(timeout=wait)
            except queue.Empty:
                alarm = self.watchdog.check() if self.watchdog.config.enabled else None
                if alarm is not None:  # the controller's one WARNING line says it, with what came of it
                    log.info("rank %d: %s", self.rank, alarm.describe())
                    msg = messages.hang_report(alarm, self._clock(), self._status())
                elif time.monotonic() - sent >= self._heartbeat_s:
                    msg = pb.RankMessage(heartbeat=self._status())
                else:
                    continue
            if msg is _CLOSE:
                return
            if msg is _WAKE:
                continue
            if isinstance(msg, tuple):  # a section's heartbeat: its sender waits until it is taken
                msg, taken = msg
                taken.set()
            sent = time.monotonic()
            yield msg

    def _receive(self) -> None:
        try:
            for msg in self._call:
                if msg.HasField("welcome"):
                    self.job_id = msg.welcome.job_id
                    self._heartbeat_s = msg.welcome.heartbeat_interval_s or self._heartbeat_s
                    self._outbox.put(_WAKE)
                    self._welcome.set()
                    continue
                try:
                    cmd = wire.command(msg.command)
                except ProtocolError as e:
                    log.error("rank %d refused a command from the controller: %s", self.rank, e)
                    self.send_result(msg.command.id, ok=False, message=f"refused: {e}")
                    continue
                if isinstance(cmd.action, Stop):
                    self.stops += 1
                    self.watchdog.disarm()
                    self.stop_event.set()
                    # A planned pause lets the step in hand finish.
                    for listener in [] if cmd.action.at_boundary else list(self._stop_listeners):
                        try:
                            listener()
                        except Exception:
                            log.exception("stop listener failed")
                elif isinstance(cmd.action, Exit):
                    # A hung loop will not leave by itself: no grace then.
                    code = cmd.action.code
                    self._arm_exit(code, grace_s=0.2 if code == EXIT_HUNG else None)
                self._commands.put(cmd)
        except grpc.RpcError as e:
            self._error = f"{e.code().name}: {e.details()}"
        finally:
            self._lost.set()
            self._commands.put(_LOST)
            if self._error and self.run not in (RunStatus.EXITING, RunStatus.FINISHED):
                log.error("rank %d lost the controller: %s", self.rank, self._error)

    def _arm_exit(self, code: int, grace_s: float | None = None) -> None:
        grace_s = self.config.exit_grace_s if grace_s is None else grace_s

        def force() -> None:
            # A hung loop is expected not to leave by itself (its fault is the controller's WARNING line).
            log.log(logging.INFO if code == EXIT_HUNG else logging.ERROR,
                    "rank %d did not exit within %g s of the exit command; forcing exit %d", self.rank, grace_s, code)
            self._force_exit(code)

        self._exit_timer = threading.Timer(grace_s, force)
        self._exit_timer.daemon = True
        self._exit_timer.start()

    def add_stop_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` on the processor thread whenever a STOP arrives."""
        self._stop_listeners.append(listener)

    @property
    def connected(self) -> bool:
        return self._welcome.is_set() and not self._lost.is_set()

    def close(self, *, finished: bool = True) -> None:
        """Say goodbye (when ``finished``) and end the session."""
        if self._call is None:
            return
        illegal: TransitionError | None = None
        if finished and self.connected:
            try:
                self.set_run(RunStatus.FINISHED, "close")
            except TransitionError as e:  # mid-recovery, say: no Goodbye claims it finished; raised at the end
                illegal = e
            else:
                self._outbox.put(pb.RankMessage(goodbye=pb.Goodbye(status=self._status())))
        self._outbox.put(_CLOSE)
        if self._reader is not None:
            self._reader.join(timeout=5)
        if self._reader is not None and self._reader.is_alive():
            log.warning("rank %d: the controller did not end the session after %s; cancelling it",
                        self.rank, "Goodbye" if finished else "close")
            self._call.cancel()
            self._reader.join(timeout=5)
        if self._exit_timer is not None:
            self._exit_timer.cancel()
        self.watchdog.disarm()
        self.watchdog.close()
        self._channel.close()
        self._call = None
        if illegal is not None:
            raise illegal

    # ----------------------------------------------------------- hot path
    def end_update(self, step: int) -> None:
        super().end_update(step)
        self.watchdog.step_done()

    # ----------------------------------------------------------- reports
    def status(self) -> RankStatus:
        """What this rank says of itself in each message."""
        return RankStatus(step=self.step, run=self.run, data=self.data, step_time_s=self.watchdog.median_step_s,
                          silence_s=self.watchdog.section_limit_s())

    def _status(self) -> pb.Status:
        return status_to_pb(self.status())

    def _section_opened(self) -> None:
        """Tell the controller now, before the section's work may hold the
        GIL (a compile) and with it the heartbeat thread: wait (briefly) for
        the sending thread to take the heartbeat."""
        if self._call is None:
            return
        taken = threading.Event()
        self._outbox.put((pb.RankMessage(heartbeat=self._status()), taken))
        taken.wait(0.5)

    def _post(self, msg: pb.RankMessage) -> None:
        if self._call is not None:
            self._outbox.put(msg)

    def report_fault(self, kind: FaultKind, severity: Severity, message: str, *, phase: str = "",
                     occurred_at: float | None = None) -> None:
        # The rank stopped itself: no STOP will come to disarm the watchdog,
        # and the controller times the recovery's phases from here on.
        self.watchdog.disarm()
        self._set_run_reporting(RunStatus.STOPPED, "fault report")
        self._post(messages.fault_report(kind, severity, message, phase=phase,
                                         occurred_at=occurred_at or self._clock(), status=self._status()))

    def report_stopped(self) -> None:
        self.watchdog.disarm()
        self._set_run_reporting(RunStatus.STOPPED, "stop answer")
        self._post(pb.RankMessage(stopped=self._status()))

    def report_persist(self, failing: Failing | None) -> None:
        """Tell the controller this rank's periodic saves stopped reaching
        storage (``None``: they reach it again), for ``trainguard status``."""
        self._post(messages.persist_health(failing))

    def send_result(self, command_id: int, *, ok: bool, code: int = 0, message: str = "",
                    shards: Sequence[SavedShard] = (), own: Sequence[FileInfo] = ()) -> None:
        """Answer command ``command_id`` (a save's answer lists the files written)."""
        result = CommandResult(command_id=command_id, ok=ok, status=self.status(), code=code, message=message[:2000],
                               shards=tuple(shards), own=tuple(own))
        self._post(pb.RankMessage(result=wire.result_to_pb(result)))

    def next_command(self, timeout: float | None = None) -> Command | None:
        """The next command for the training thread (``None`` on timeout).

        Raises:
            ControllerLostError: the session with the controller ended, or
                there never was one.
        """
        if self.config is None:
            raise ControllerLostError("no controller: start the job with `trainguard run` to recover from faults")
        try:
            cmd = self._commands.get(timeout=timeout)
        except queue.Empty:
            return None
        if cmd is _LOST:
            self._commands.put(_LOST)  # keep later callers from blocking
            raise ControllerLostError(f"rank {self.rank} lost the controller: {self._error or 'session ended'}")
        return cmd

    def resumed(self, *, new_processes: bool = False) -> None:
        """Training continues: clear the stop signal. After a recovery that
        started new processes the next step gets the first-step limit."""
        self.stop_event.clear()
        self.set_run(RunStatus.TRAINING, "resume")
        self.watchdog.arm(first=new_processes)
