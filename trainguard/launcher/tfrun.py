"""``trainguard run --framework tensorflow``: a multi-worker TensorFlow job,
restarted whole on a fault (job-level rescheduling).

TensorFlow has no launcher of its own: a ``MultiWorkerMirroredStrategy``
job is one process per worker, each told the cluster and its own place in
it by ``TF_CONFIG``. This launcher starts ``--workers-per-node`` workers of
the script on this host, each with its ``TF_CONFIG`` (worker 0 is the chief,
as TensorFlow takes it when the cluster names no ``chief`` task) and the
write end of a progress pipe (:mod:`trainguard.core.step_pipe`), and watches
every worker (:class:`~.tf_watch.TFWorker`): an exit other than 0, a signal,
a process found stopped, or no step within the learned hang limit. On the
first fault it logs the reason once, kills every worker and starts the
whole job again, with fresh ports, up to ``--max-restarts`` times; the
training script resumes from its newest verified checkpoint
(:mod:`trainguard.adapters.tensorflow`).

Exit codes, as ``trainguard run`` for torch: 0 when every worker finished;
2 when a setting was refused before any worker started (a bad flag, an
unknown ``TRAINGUARD_*`` variable, a malformed fault or one for a worker the
job does not have); 1 otherwise: the restart budget is spent, or a worker
refused to go on (it exits 76, ``EXIT_UNRECOVERABLE``: a checkpoint it
cannot resume from, a setting it refused), which no restart would change.
A job-level restart writes no dying-gasp checkpoint, so 75 is never the
launcher's code here; a hung worker is killed by the launcher (the ``77``
a torch rank ends itself with does not apply).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Sequence

from trainguard.core import ConfigError, TrainguardError, logs
from trainguard.core.config import watchdog_from_env
from trainguard.core.config_launch import LaunchConfig
from trainguard.core.events import note
from trainguard.core.faults import check_ranks
from trainguard.core.step_pipe import ENV_FD, StepReader

from .tf_watch import TFWorker, hang_config
from .watch import FrozenWatch

__all__ = ["Job", "main", "parser"]

log = logging.getLogger("trainguard.launcher")

#: How long workers that all reported the end of training may take to exit
#: before they are killed (TensorFlow's shutdown of a multi-worker job can
#: wait on peers that already left).
DONE_GRACE_S = 30.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trainguard run --framework tensorflow",
        description="Launch a multi-worker TensorFlow 2 job (MultiWorkerMirroredStrategy; TF_CONFIG built for each "
                    "worker) and restart it whole when a worker fails or hangs.")
    p.add_argument("--workers-per-node", "--worker_num", type=int, default=1, dest="workers",
                   help="worker processes on this host, task indices 0.. (worker 0 is the chief; default 1)")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=3, dest="max_restarts",
                   help="how many times the whole job may be restarted after a fault (default 3)")
    p.add_argument("--monitor-interval", "--monitor_interval", type=float, default=0.1, dest="monitor_interval",
                   help="seconds between checks of the workers (default 0.1)")
    p.add_argument("--host", default="localhost", help="the address in TF_CONFIG's cluster (default localhost)")
    p.add_argument("--job-id", default=None, help="job id in logs (default: TRAINGUARD_JOB_ID, else tf-<pid>)")
    p.add_argument("--run-dir", default=None,
                   help="append the job's events to RUN_DIR/events.jsonl (sets TRAINGUARD_RUN_DIR)")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    return p


@dataclass(frozen=True)
class Outcome:
    """How one attempt ended: ``done`` (every worker exited 0), else the
    first fault's reason, and whether a restart can help."""

    done: bool
    reason: str = ""
    restartable: bool = True
    step: int = -1  # the highest step a worker reached


class Job:
    """Runs a job's attempts until one finishes or the budget is spent.

    Args:
        command: the worker command (interpreter, script, its arguments).
        workers: how many workers.
        max_restarts: the restart budget.
        monitor_interval_s: the polling period.
        host: the address workers listen on.
        job_id: for logs and the workers' environment.
    """

    def __init__(self, command: Sequence[str], *, workers: int, max_restarts: int, monitor_interval_s: float,
                 host: str, job_id: str, watchdog) -> None:
        self.command = list(command)
        self.workers = workers
        self.max_restarts = max_restarts
        self.monitor_interval_s = monitor_interval_s
        self.host = host
        self.job_id = job_id
        self.watchdog = watchdog
        self.restarts = 0
        self.history: list[dict] = []  # one record per fault: what, when, the restart it led to

    def run(self) -> int:
        while True:
            started = time.monotonic()
            outcome = self._attempt()
            if outcome.done:
                log.info("job %s finished (%d restart%s)", self.job_id, self.restarts, "" if self.restarts == 1 else "s")
                note("exit", code=0, restarts=self.restarts)
                return 0
            record = {"reason": outcome.reason, "restart": None, "attempt_s": round(time.monotonic() - started, 2),
                      "signature": _signature(outcome.reason) if outcome.step < 0 else None}
            self.history.append(record)
            note("fault", reason=outcome.reason, step=outcome.step, restart=self.restarts)
            if outcome.step < 0 and self.history[:-1] and self.history[-2]["signature"] == record["signature"]:
                print(f"trainguard: {outcome.reason}, as in the attempt before, both before any step: a restart "
                      f"would fail the same way; not restarting", file=sys.stderr)
                return 1
            if not outcome.restartable:
                print(f"trainguard: {outcome.reason}; not restarting (a restart would meet the same refusal)",
                      file=sys.stderr)
                return 1
            if self.restarts >= self.max_restarts:
                print(f"trainguard: {outcome.reason}; the restart budget (--max-restarts {self.max_restarts}) is "
                      f"spent", file=sys.stderr)
                return 1
            self.restarts += 1
            record["restart"] = self.restarts
            log.warning("%s: stopped every worker; restarting the job (restart %d of %d)", outcome.reason,
                        self.restarts, self.max_restarts)

    def _attempt(self) -> Outcome:
        ports = _free_ports(self.workers, self.host)
        cluster = {"worker": [f"{self.host}:{p}" for p in ports]}
        frozen = FrozenWatch()
        workers: list[TFWorker] = []
        ended = 0.0  # when every worker had reported the end of training
        try:
            for index in range(self.workers):
                workers.append(self._start(index, cluster, frozen))
            while True:
                for w in workers:
                    w.poll()
                faults = [r for r in (w.fault() for w in workers) if r]
                if faults:
                    # A killed or hung worker's peers fail in their next collective: name it first.
                    faults.sort(key=lambda r: "exited with code" in r)
                    reason = faults[0] + (f" (then: {'; '.join(faults[1:])})" if faults[1:] else "")
                    step = max(x.step for x in workers)
                    return Outcome(False, reason, restartable="refused to go on" not in reason, step=step)
                if all(w.code == 0 or (w.done and w.code is not None) for w in workers):
                    for w in workers:
                        if w.code:
                            log.warning("worker %d exited with code %d after training ended", w.index, w.code)
                    return Outcome(True, step=max(w.step for w in workers))
                if all(w.done for w in workers):
                    ended = ended or time.monotonic()
                    if time.monotonic() - ended > DONE_GRACE_S:
                        log.warning("every worker ended training %.0f s ago; killing those still running: %s",
                                    DONE_GRACE_S, [w.index for w in workers if w.code is None])
                        return Outcome(True, step=max(w.step for w in workers))
                frozen.last_poll = time.time()
                time.sleep(self.monitor_interval_s)
        finally:
            _end(workers)

    def _start(self, index: int, cluster: dict, frozen: FrozenWatch) -> TFWorker:
        read, write = os.pipe()
        env = {**os.environ,
               "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
               ENV_FD: str(write), "TRAINGUARD_JOB_ID": self.job_id, "TRAINGUARD_RESTART": str(self.restarts)}
        try:
            proc = subprocess.Popen(self.command, env=env, pass_fds=(write,), start_new_session=True)
        except OSError:
            os.close(read)
            raise
        finally:
            os.close(write)  # the worker holds the only write end: its exit closes the pipe
        log.info("worker %d: pid %d, TF_CONFIG task index %d of %s", index, proc.pid, index,
                 ",".join(cluster["worker"]))
        return TFWorker(index, proc, StepReader(read), self.watchdog, frozen)


def _signature(reason: str) -> str:
    """What failed, without which worker or pid, nor what followed: two
    start-ups that end alike have one signature whichever worker went first."""
    first = reason.partition(" (then: ")[0]
    return re.sub(r"^worker \d+ \(pid \d+\) ", "", first)


def _end(workers: list[TFWorker]) -> None:
    """Kill every worker still running (each leads a session of its own:
    its children go too) and reap them."""
    for w in workers:
        if w.proc.poll() is None:
            try:
                os.killpg(w.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for w in workers:
        try:
            w.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # in the kernel (a D-state read): nothing more to do from here
            log.error("worker %d (pid %d) did not end 30 s after SIGKILL", w.index, w.proc.pid)
        w.close()


def _free_ports(n: int, host: str) -> list[int]:
    """``n`` ports free on ``host`` now (held open together, so distinct)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def launch(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    if args.workers < 1:
        raise ConfigError(f"--workers-per-node must be >= 1, got {args.workers}")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if not args.monitor_interval > 0:
        raise ConfigError(f"--monitor-interval must be > 0, got {args.monitor_interval}")
    if os.environ.get("TF_CONFIG"):
        raise ConfigError("TF_CONFIG is already set: this launcher builds it for each worker (one host); "
                          "unset it")
    launch_config = LaunchConfig.from_env()  # unknown TRAINGUARD_* variables, malformed faults: refused here
    check_ranks(launch_config.faults, args.workers)
    watchdog = hang_config(watchdog_from_env(os.environ), dict(os.environ))
    if args.run_dir:
        os.environ["TRAINGUARD_RUN_DIR"] = os.path.abspath(args.run_dir)
    job_id = args.job_id or launch_config.job_id or f"tf-{os.getpid()}"
    script_args = args.script_args[1:] if args.script_args[:1] == ["--"] else args.script_args
    note("launch", argv=list(argv), workers=args.workers, framework="tensorflow")
    job = Job([sys.executable, "-u", args.script, *script_args], workers=args.workers,
              max_restarts=args.max_restarts, monitor_interval_s=args.monitor_interval, host=args.host,
              job_id=job_id, watchdog=watchdog)
    return job.run()


def _terminate(signum: int, frame) -> None:  # noqa: ARG001 - signal handler signature
    raise SystemExit(128 + signum)  # unwinds through the attempt's finally: every worker is killed


def main(argv: Sequence[str]) -> int:
    """``trainguard run --framework tensorflow [flags] SCRIPT [ARGS]``."""
    logs.setup("launcher")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminate)
    try:
        return launch(argv)
    except TrainguardError as e:
        print(f"trainguard run: {e}", file=sys.stderr)
        return 2
