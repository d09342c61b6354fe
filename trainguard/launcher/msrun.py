"""msrun with a controller: trainguard as msrun's process-control plugin.

MindSpore's msrun hands its workers to a plugin when one registers in
``_ProcessManager._check_taskd`` (MindCluster TaskD's hook): msrun still
starts its scheduler, then calls ``handler.start()`` instead of starting and
joining the workers itself. ``adapters-patch msrun`` inserts a call to
:func:`attach` there; ``trainguard run --framework mindspore`` builds msrun's
process manager with msrun's own parser and attaches the same way.

:class:`MsrunPlugin` starts the job's controller (on the master node), points
the workers at it (``TRAINGUARD_CONTROLLER``/``TOKEN``/``JOB_ID``), starts
them through msrun's own ``start_workers`` (the ``START_ALL_WORKER`` role),
watches their processes (the ``MONITOR`` role) and reports every
unexpected exit to the controller at once, so a lost process is known in
well under a second. It ends the way ``trainguard run`` does: 0 when training
finished, 75 after a dying-gasp checkpoint, 1 otherwise.

The strategies come from ``TRAINGUARD_STRATEGIES`` or, when it is unset,
from MindSpore's ``MS_ENABLE_TFT``: ``UCE:1`` -> ``retry``, ``ARF:1`` ->
``recover-in-place`` (not available for MindSpore yet: the controller
falls back), ``TTP:1`` -> ``dump``; ``exit`` always last; else from the
pod's ``recover-strategy`` annotation (``TRAINGUARD_ANNOTATIONS``, see
:mod:`trainguard.core.annotations`). The first log line says which.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import subprocess
import sys
import time
from typing import Any

from trainguard.core import EXIT_AFTER_DUMP, Controller, ControllerConfig, ControllerState, TrainguardError, logs
from trainguard.core.annotations import StrategyChoice, from_annotations, resolve_strategies
from trainguard.core.control.client import ControllerClient
from trainguard.core.config import parse_strategies
from trainguard.core.config_launch import LaunchConfig
from trainguard.core.faults import check_ranks
from trainguard.core import integrity
from trainguard.core.secret import TLS, job_secret
from trainguard.core.snapshot import SnapshotDir

from .watch import FrozenWatch, report_exit, stop_controller

__all__ = ["MsrunPlugin", "attach", "main", "msrun_argv", "strategies_from_env"]

log = logging.getLogger("trainguard.launcher")

POLL_S = 0.1
#: After the controller ended the job, how long workers get to leave before
#: they are killed (a processor forces its own exit 10 s after the command).
STRAGGLER_GRACE_S = 15.0
#: How long the others of a job in which a rank failed before every rank
#: registered may take to leave by themselves before they are ended.
STARTING_GRACE_S = 3.0
#: MindSpore's CPU collective timeout trainguard sets when the job does not:
#: how long the survivors of a killed worker stay inside a collective. It
#: must stay below the controller's prelock timeout (30 s by default), or
#: they answer the stop too late to save a dying-gasp checkpoint.
COMM_TIMEOUT_S = 15
#: Exit codes a rank ends with on the controller's own order.
_ORDERED = (0, EXIT_AFTER_DUMP)


def strategies_from_env(environ=os.environ) -> str | None:
    """The recover strategies a job asked for, in TaskD's words (``None``: none)."""
    choice = strategy_choice(environ)
    return None if choice is None else choice.text


def strategy_choice(environ=os.environ) -> StrategyChoice | None:
    """The strategies a job asked for and where from: ``TRAINGUARD_STRATEGIES``,
    ``MS_ENABLE_TFT``, the pod's ``recover-strategy`` annotation (``None``: none).

    Raises:
        ConfigError: the deciding source is invalid (a malformed annotations file included).
    """
    if environ.get("TRAINGUARD_STRATEGIES"):
        return resolve_strategies(None, environ)
    items = re.split(r"[,\s]+", environ.get("MS_ENABLE_TFT", "").strip().strip("{}"))
    on = {key.strip() for key, _, value in (i.partition(":") for i in items) if value.strip() == "1"}
    if not on & {"TTP", "UCE", "ARF"}:
        return from_annotations(environ)
    if "ARF" in on:  # as in MindSpore: process-level rescheduling turns the dying gasp on
        on.add("TTP")
    chosen = [s for key, s in (("UCE", "retry"), ("ARF", "recover-in-place"), ("TTP", "dump")) if key in on]
    return StrategyChoice(parse_strategies(chosen + ["exit"]), "MS_ENABLE_TFT")


class _SafeSpawn:
    """``subprocess`` for msrun's process manager in a launcher with threads.

    msrun starts each worker with ``preexec_fn=os.setsid``: Python code that
    runs in the child between fork and exec, which can deadlock in a process
    with other threads (the controller's gRPC threads here; seen as a worker
    that never started). ``start_new_session=True`` does the same ``setsid``
    in C."""

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    @staticmethod
    def Popen(*args: Any, preexec_fn: Any = None, **kwargs: Any) -> subprocess.Popen:  # noqa: N802 - subprocess's name
        if preexec_fn is os.setsid:
            preexec_fn, kwargs["start_new_session"] = None, True
        return subprocess.Popen(*args, preexec_fn=preexec_fn, **kwargs)


def attach(manager: Any, *, force: bool = False) -> bool:
    """Take over ``manager``'s workers (msrun's ``_ProcessManager``) when
    the job asks for fault tolerance (``force``: always); the settings are
    read here, once."""
    try:
        choice = strategy_choice()
        if choice is None and not force:
            return False
        manager.handler = MsrunPlugin(manager, choice or resolve_strategies(None, {}), LaunchConfig.from_env())
    except TrainguardError as e:  # before any worker: the setting is refused, as `trainguard run` does
        print(f"trainguard msrun: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    manager.enable_mindx = True
    sys.modules[type(manager).__module__].subprocess = _SafeSpawn()
    # msrun starts its scheduler and workers as `python SCRIPT`: make that the
    # launcher's own interpreter, the one trainguard and MindSpore are in.
    here = os.path.dirname(sys.executable)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != here:
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
    return True


class MsrunPlugin:
    """One node's msrun, driven by trainguard (``handler.start()`` in msrun),
    with the strategies and the launcher's settings :func:`attach` read."""

    def __init__(self, manager: Any, strategies: StrategyChoice, launch: LaunchConfig) -> None:
        self.manager = manager
        self.nodes = max(1, manager.worker_num // max(1, manager.local_worker_num))
        self.strategy_choice = strategies
        self.launch = launch
        self.config = ControllerConfig.from_env(strategies=strategies.strategies,
                                                job_id=launch.job_id or f"msrun-{manager.master_port}")
        self.controller: Controller | None = None
        self.client: ControllerClient | None = None
        self._reported: set[int] = set()
        self.last_status: dict | None = None

    def start(self) -> None:
        """msrun's entry: run the job, then leave msrun with its exit code."""
        logs.setup("msrun")
        try:
            code = self.run()
        except TrainguardError as e:
            print(f"trainguard msrun: {e}", file=sys.stderr)
            code = 2
        sys.exit(code)

    def run(self) -> int:
        log.info("%s", self.strategy_choice.describe())  # the first line: where the strategies came from
        # A malformed fault, or one for a rank the job does not have, is refused before any worker starts.
        check_ranks(self.launch.faults, self.manager.worker_num)
        self._start_controller()
        # The node's snapshot directory: the workers' snapshots outlive them
        # until msrun ends, which removes it.
        snapshots = SnapshotDir.create(f"{self.config.job_id}-n{self.manager.node_rank}", self.launch.snapshot_root)
        os.environ["TRAINGUARD_SNAPSHOT_DIR"] = str(snapshots.path)
        try:
            self.manager.start_workers()
            self._watch()
        finally:
            self._stop()
            snapshots.remove()
        return self._summary()

    # ------------------------------------------------------------ control
    def _start_controller(self) -> None:
        m = self.manager
        token, tls = job_secret(nodes=self.nodes), TLS.from_env()  # several nodes: a shared secret, or refused
        os.environ[integrity.KEY_ENV] = integrity.key_for_workers()  # before TRAINGUARD_TOKEN is this job's (below)
        if self.nodes > 1 and not self.config.port:
            raise TrainguardError("a multi-node msrun job needs the same TRAINGUARD_PORT on every node (and "
                                  "TRAINGUARD_HOST on the master: an address the others reach)")
        if m.is_master:
            self.controller = Controller(self.config, m.worker_num, token=token, tls=tls)
            address = self.controller.start()
        else:
            address = f"{m.master_addr}:{self.config.port}"
            self.client = ControllerClient(address, token, tls=tls)
        os.environ.update(TRAINGUARD_CONTROLLER=address, TRAINGUARD_TOKEN=token,
                          TRAINGUARD_JOB_ID=self.config.job_id)
        comm_timeout = os.environ.setdefault("MS_CPU_COMM_OP_TIMEOUT", str(COMM_TIMEOUT_S))
        if float(comm_timeout) >= self.config.prelock_timeout_s:
            log.warning("MS_CPU_COMM_OP_TIMEOUT=%s s is not below the prelock timeout (%g s): the survivors of a lost "
                        "worker would answer the stop too late for a dying-gasp save; raise "
                        "TRAINGUARD_PRELOCK_TIMEOUT_S above it", comm_timeout, self.config.prelock_timeout_s)
        log.info("trainguard controls msrun's %d local workers (controller %s)", m.local_worker_num, address)

    def _global_rank(self, local_rank: int) -> int:
        m = self.manager
        return local_rank if m.node_rank < 0 else m.node_rank * m.local_worker_num + local_rank

    def _watch(self) -> None:
        """Poll every worker (msrun's MONITOR role) until all have exited;
        report each unexpected exit the moment it is seen, and kill (the
        KILL_WORKER role) and report a worker found frozen."""
        frozen = FrozenWatch()
        self._exited_at: float | None = None
        self._failed_starting: float | None = None  # when a rank failed before every rank registered
        while True:
            running = 0
            for local_rank, code, pid in self._workers():
                rank = self._global_rank(local_rank)
                if code is None:
                    reason = frozen.stopped(pid)
                    if not reason:
                        running += 1
                        continue
                    # Report before killing: the kill also ends the rank's session.
                    self._reported.add(pid)
                    report_exit(self.controller, self.client, rank, pid, -9, reason, frozen.running_at.get(pid, 0.0))
                    self.manager.kill_workers([pid])
                elif pid not in self._reported and code not in _ORDERED:
                    self._reported.add(pid)
                    report_exit(self.controller, self.client, rank, pid, code, last_running=frozen.last_poll)
                    if self._failed_starting is None and self._not_started():
                        log.error("rank %d failed before every rank had registered with the controller (while "
                                  "starting or resuming); ending the others", rank)
                        self._failed_starting = time.monotonic()
            if not running:
                return
            if self._failed_starting is not None and time.monotonic() - self._failed_starting > STARTING_GRACE_S:
                self.manager.kill_workers([p for _, c, p in self._workers() if c is None])
            self._end_stragglers()
            frozen.last_poll = time.time()
            time.sleep(POLL_S)

    def _not_started(self) -> bool:
        """Whether some rank never registered: a failure now cannot be
        recovered in place, and the others may wait for it in a collective
        until its timeout (as torchrun, end them: a relaunch resumes)."""
        try:
            state = self.controller.state.name if self.controller is not None else self.client.status()["state"]
        except Exception:  # noqa: BLE001 - a controller that cannot be reached gives no orders either
            return False
        return state == ControllerState.INIT.name

    def _end_stragglers(self) -> None:
        """Once the controller ended the job, kill the workers that did not
        leave: a rank still inside a collective when the exit command went
        out never received it."""
        if self.controller is None or not self._reported:
            return
        if self._exited_at is None:
            if self.controller.state is not ControllerState.EXITED:
                return
            self._exited_at = time.monotonic()
        if time.monotonic() - self._exited_at < STRAGGLER_GRACE_S:
            return
        left = [pid for _, code, pid in self._workers() if code is None]
        log.warning("the job ended %.0f s ago; killing workers that did not leave: %s", STRAGGLER_GRACE_S, left)
        self.manager.kill_workers(left)

    def _workers(self) -> list[tuple[int, int | None, int]]:
        """``(local rank, exit code or None, pid)`` of every worker msrun started.

        From msrun's own Popen objects: its ``monitor_rank_status`` (the
        MONITOR role) answers 300 instead of the exit code once a worker was
        reaped, so a deliberate exit (75 after a dump) would look like a crash."""
        return [(local, p.poll(), p.pid) for local, p in sorted(self.manager.proc_rank_map.items())]

    def _stop(self) -> None:
        self.last_status = stop_controller(self.controller, self.last_status)
        if self.client is not None:
            self.client.close()
        self.manager.kill_tail_log_processes()  # `tail -f` of each worker log (--join=True) would outlive msrun
        scheduler = self.manager.msn_process
        if scheduler is not None and scheduler.poll() is None:
            # Every worker has left (one node): the scheduler has nothing more
            # to do, yet it looks for nodes still registered only every 5 s,
            # and waits for killed ones that will never unregister. With
            # other nodes, their workers get those 5 s to unregister.
            if self.nodes == 1:
                scheduler.terminate()
            try:
                scheduler.wait(timeout=5)
            except subprocess.TimeoutExpired:
                scheduler.kill()
                scheduler.wait()

    def _summary(self) -> int:
        records = (self.last_status or {}).get("recoveries", [])
        for r in records:
            log.info("recovery: %s on rank %d at step %d -> %s (recover %s s, lost %d steps): %s",
                     r["fault"], r["rank"], r["step"], r["strategy"], r["recover_s"], r["lost_steps"], r["reason"])
        codes = {self._global_rank(local): code for local, code, _ in self._workers()}
        if all(c == 0 for c in codes.values()):
            return 0
        if records and records[-1]["strategy"] == "dump":
            print(f"trainguard: the job saved a dying-gasp checkpoint at step {records[-1]['step']} and stopped "
                  f"({records[-1]['reason']}); relaunch the same command to resume from it.", file=sys.stderr)
            return EXIT_AFTER_DUMP
        for rank, code in sorted(codes.items()):
            if code:
                print(f"trainguard: rank {rank} failed with exit code {code}", file=sys.stderr)
        if records and records[-1]["strategy"] == "exit":
            print(f"trainguard: the job stopped ({records[-1]['reason']})", file=sys.stderr)
        return 1


#: torchrun's flags ``trainguard run --framework mindspore`` also takes -> msrun's.
_TORCHRUN_FLAGS = {"--nproc-per-node": "--local_worker_num", "--nproc_per_node": "--local_worker_num",
                   "--nnodes": "--nnodes", "--node-rank": "--node_rank", "--node_rank": "--node_rank",
                   "--master-addr": "--master_addr", "--master_addr": "--master_addr",
                   "--master-port": "--master_port", "--master_port": "--master_port"}
#: msrun's default worker count (``--worker_num`` and ``--local_worker_num``).
MSRUN_DEFAULT_WORKERS = 8


def msrun_argv(argv: list[str]) -> list[str]:
    """``trainguard run --framework mindspore``'s flags as msrun's parser takes them.

    msrun's own flags pass unchanged; torchrun's ``--nproc-per-node N`` (with ``--nnodes M``)
    becomes ``--local_worker_num=N --worker_num=N*M``, and ``--node-rank``, ``--master-addr``,
    ``--master-port`` msrun's spellings. Only the flags before the script are read.

    Raises:
        TrainguardError: a torchrun flag and its msrun counterpart both given, or a count that is
            not a whole number.
    """
    flags: dict[str, str] = {}
    order: list[str] = []
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        name, eq, value = argv[i].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise TrainguardError(f"{name} needs a value")
            value, i = argv[i + 1], i + 1
        target = _TORCHRUN_FLAGS.get(name, name)
        if target in flags:
            raise TrainguardError(f"{name} is given twice (or with its msrun spelling {target})")
        flags[target] = value
        order.append(target)
        i += 1
    script = argv[i:]
    nnodes = flags.pop("--nnodes", None)
    if nnodes is not None:
        order.remove("--nnodes")
    if "--local_worker_num" in flags and "--worker_num" not in flags:
        for what, n in (("--nproc-per-node", flags["--local_worker_num"]), ("--nnodes", nnodes or "1")):
            if not n.isdigit() or int(n) < 1:
                raise TrainguardError(f"{what} {n!r}: give a whole number >= 1 (a node range is msrun's to refuse)")
        flags["--worker_num"] = str(int(flags["--local_worker_num"]) * int(nnodes or 1))
        order.append("--worker_num")
    elif nnodes is not None:
        raise TrainguardError("--nnodes needs --nproc-per-node (or give msrun's --worker_num and --local_worker_num)")
    return [f"{k}={flags[k]}" for k in order] + script


def main(argv: list[str]) -> int:
    """``trainguard run --framework mindspore [msrun flags] SCRIPT [ARGS]``."""
    from mindspore.parallel.cluster.process_entity._api import _ProcessManager
    from mindspore.parallel.cluster.run import get_args

    try:
        argv = msrun_argv(list(argv))
    except TrainguardError as e:
        print(f"trainguard run --framework mindspore: {e}", file=sys.stderr)
        return 2
    if not any(a.startswith(("--worker_num", "--local_worker_num")) for a in argv if a.startswith("--")):
        print(f"trainguard run --framework mindspore: {MSRUN_DEFAULT_WORKERS} workers on this node, msrun's "
              f"default (give --nproc-per-node N, or msrun's --worker_num and --local_worker_num)", file=sys.stderr)
    saved = sys.argv
    sys.argv = ["trainguard run --framework mindspore", *argv]
    try:
        args = get_args()  # msrun's own parser, which reads sys.argv
    finally:
        sys.argv = saved
    manager = _ProcessManager(args)
    attach(manager, force=True)
    try:
        manager.run()  # ends in MsrunPlugin.start -> sys.exit
    except SystemExit as done:
        return int(done.code or 0)
    finally:
        gc.freeze()  # the process ends: skip the last full collection of MindSpore's heap (~1 s of CPU)
    return 0
