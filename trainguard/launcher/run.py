"""``trainguard run``: torchrun with a controller.

Takes every torchrun flag (``--nproc-per-node``, ``--nnodes``,
``--rdzv-*``, ``--max-restarts``, ...) plus trainguard's own, parses them
with torch's own parser and launches the workers through torch's elastic
launcher pieces, with :class:`~.agent.TrainguardAgent` as the agent.

Exit codes: 0 when training finished; 75 when the job stopped after a
dying-gasp checkpoint (relaunch the same command to resume); 2 when a
setting was refused before any worker started (``TRAINGUARD_FAULT`` that is
malformed or names a rank the job does not have, an unknown setting, a job
of several nodes without a shared secret); 1
otherwise (a worker's start-up refusal included: its message is in the log).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import sys
import uuid
from typing import Sequence

from trainguard.core import EXIT_AFTER_DUMP, ConfigError, ControllerConfig, TrainguardError, logs
from trainguard.core.annotations import resolve_strategies
from trainguard.core.config import launch_defaults
from trainguard.core.config_launch import LaunchConfig, unrunnable
from trainguard.core.events import note
from trainguard.core.faults import check_ranks
from trainguard.core import integrity
from trainguard.core.private import make_directory
from trainguard.core.secret import TLS, job_secret

__all__ = ["main", "parser"]

LOOPBACK = ("127.0.0.1", "localhost", "::1")

log = logging.getLogger("trainguard.launcher")


def parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    p = get_args_parser()
    # None: not given, so trainguard's default budget applies (see launch_defaults).
    p.set_defaults(max_restarts=None)
    p.set_defaults(master_port=None)  # as torch 2.13 has it: a single-node job without one gets a free port
    # (_standalone_defaults); torch 2.11's 29500 made two such jobs on one host collide
    p.prog = "trainguard run"
    p.description = "Launch a training script like torchrun, protected by trainguard."
    tg = p.add_argument_group("trainguard")
    tg.add_argument("--strategies", default=None,
                    help="ordered recover strategies, comma-separated (default: TRAINGUARD_STRATEGIES, else the "
                         "pod's recover-strategy annotation in TRAINGUARD_ANNOTATIONS, else "
                         "retry,recover-in-place,dump,exit; retry,dump,exit with --max-restarts 0)")
    tg.add_argument("--controller-host", default=None,
                    help="address the controller binds to (default: TRAINGUARD_HOST or 127.0.0.1)")
    tg.add_argument("--controller-port", type=int, default=None,
                    help="port the controller binds to (default: any free port)")
    tg.add_argument("--token-file", default=None,
                    help="a file holding the job secret, the same on every node (sets TRAINGUARD_TOKEN_FILE; "
                         "needed, or TRAINGUARD_TOKEN, by a job of several nodes)")
    for part, what in (("cert", "this node's PEM certificate"), ("key", "its PEM private key"),
                       ("ca", "the PEM certificate of the authority that signed every node's")):
        tg.add_argument(f"--tls-{part}", default=None,
                        help=f"mutual TLS on the control plane: {what} (sets TRAINGUARD_TLS_{part.upper()})")
    tg.add_argument("--job-id", default=None, help="job id in logs, reports and profiling directories (default: "
                                                   "TRAINGUARD_JOB_ID, else the rendezvous id)")
    tg.add_argument("--run-dir", default=None,
                    help="append the job's events (faults, decisions, recoveries, checkpoints, per-rank steps) to "
                         "RUN_DIR/events.jsonl for `trainguard report RUN_DIR` (sets TRAINGUARD_RUN_DIR)")
    tg.add_argument("--spare-slots", type=int, default=None,
                    help="workers this node may start for other nodes' ranks under the `recover` strategy "
                         "(default: TRAINGUARD_SPARE_SLOTS or 0)")
    return p


def _standalone_defaults(args: argparse.Namespace) -> None:
    """torchrun's own defaulting for single-node runs (``run()`` does it
    inline; repeated here because we do not call ``run()``)."""
    from torch.distributed.run import parse_min_max_nnodes

    if args.standalone or (args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
                           and parse_min_max_nnodes(args.nnodes)[1] == 1):
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def launch(argv: Sequence[str]) -> int:
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry
    from torch.distributed.launcher.api import _get_addr_and_port
    from torch.distributed.run import config_from_args, determine_local_world_size

    from .agent import TrainguardAgent

    args = parser().parse_args(argv)  # first: --help works whatever the environment holds
    # Read and checked before anything starts (the faults' ranks below, once the job's size is known).
    launch = LaunchConfig.from_env()
    if args.spare_slots is not None:  # the flag wins
        launch = dataclasses.replace(launch, spare_slots=args.spare_slots)
    # The restart budget: --max-restarts, else trainguard's default (printed: it decides what a lost process
    # costs); the default strategies follow from it.
    given = args.max_restarts is not None
    args.max_restarts, default_strategies = launch_defaults(args.max_restarts)
    # Flag, TRAINGUARD_STRATEGIES, the pod's recover-strategy annotation, default: the first log line says which.
    choice = resolve_strategies(args.strategies, default=default_strategies)
    log.info("%s", choice.describe())
    log.info("restart budget %d (%s)", args.max_restarts,
             "--max-restarts" if given else "default; --max-restarts N to change")
    _standalone_defaults(args)
    if "OMP_NUM_THREADS" not in os.environ and determine_local_world_size(args.nproc_per_node) > 1:
        # torchrun's own choice, made without its boxed warning: a clean run prints none
        log.info("OMP_NUM_THREADS=1 for every worker (torchrun's default with several per node; set it to tune)")
        os.environ["OMP_NUM_THREADS"] = "1"
    config, cmd, cmd_args = config_from_args(args)
    why = unrunnable(choice.strategies, max_restarts=config.max_restarts,
                     spare_slots=launch.spare_slots if config.max_nodes > 1 else 0)
    if why:  # before any worker starts: the strategy would only be passed over at the first fault
        raise ConfigError(f"{choice.describe()}: {why}")
    if config.min_nodes != config.max_nodes:
        raise TrainguardError(
            f"--nnodes {config.min_nodes}:{config.max_nodes}: trainguard run takes every torchrun flag but a node "
            f"range; give a fixed count such as --nnodes {config.max_nodes} (a job that loses a node goes on under "
            f"the recover, dump or elastic-training strategies instead of a new rendezvous of fewer nodes)")
    check_ranks(launch.faults, config.nproc_per_node * config.max_nodes)
    for name in ("token_file", "tls_cert", "tls_key", "tls_ca"):
        if getattr(args, name):
            os.environ[f"TRAINGUARD_{name.upper()}"] = getattr(args, name)
    if args.run_dir:  # the controller and the workers read it (trainguard.core.events)
        os.environ["TRAINGUARD_RUN_DIR"] = os.path.abspath(args.run_dir)
    if os.environ.get("TRAINGUARD_RUN_DIR"):  # another user's, or one others may rename in: refused before the start
        make_directory(os.environ["TRAINGUARD_RUN_DIR"], "run directory (--run-dir, TRAINGUARD_RUN_DIR)")
    # Before anything starts: a job of several nodes without a shared secret is refused (see core.secret).
    secret, tls = job_secret(nodes=config.max_nodes), TLS.from_env()
    # The workers' key for checkpoints and compile caches: a key file or a configured secret, never this
    # launch's fresh one (read now, before the agent puts that in TRAINGUARD_TOKEN; core.integrity).
    os.environ[integrity.KEY_ENV] = integrity.key_for_workers()
    for name in ("TRAINGUARD_TLS_CERT", "TRAINGUARD_TLS_KEY", "TRAINGUARD_TLS_CA"):
        os.environ.pop(name, None)  # the workers reach their node's relay on loopback, with the secret
    controller_config = ControllerConfig.from_env(
        strategies=choice.strategies, host=args.controller_host, port=args.controller_port,
        job_id=args.job_id or launch.job_id or config.run_id)
    if config.max_nodes == 1 and controller_config.host not in LOOPBACK:
        log.info("a single-node job: the controller listens on 127.0.0.1, not %s", controller_config.host)
        controller_config = dataclasses.replace(controller_config, host="127.0.0.1")
    params = RendezvousParameters(
        backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
        min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr,
        **config.rdzv_configs)
    master_addr, master_port = _get_addr_and_port(params)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    spec = WorkerSpec(
        role=config.role, local_world_size=config.nproc_per_node, entrypoint=cmd, args=tuple(cmd_args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(params), max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval, master_addr=master_addr, master_port=master_port,
        local_addr=config.local_addr)
    note("launch", argv=list(argv), nproc_per_node=config.nproc_per_node, nnodes=config.max_nodes)
    agent = TrainguardAgent(spec=spec, logs_specs=config.logs_specs, start_method=config.start_method,
                            log_line_prefix_template=config.log_line_prefix_template,
                            controller_config=controller_config, launch=launch, secret=secret, tls=tls)
    try:
        result = agent.run()
    finally:
        agent.shutdown_controller()
        spec.rdzv_handler.shutdown()
    code = _summarise(result, agent.last_status)
    note("exit", code=code)
    return code


def _summarise(result, status: dict | None) -> int:
    records = (status or {}).get("recoveries", [])
    for r in records:
        detect = "" if r["detect_s"] is None else f"detect {r['detect_s']} s, "  # known when the rank reported it
        log.info("recovery: %s on rank %d at step %d -> %s (%srecover %s s, lost %d steps): %s",
                    r["fault"], r["rank"], r["step"], r["strategy"], detect, r["recover_s"], r["lost_steps"],
                    r["reason"])
    if not result.is_failed():
        return 0
    if records and records[-1]["strategy"] == "dump":  # recorded once the checkpoint was finalised
        faulty = {r["rank"] for r in records}  # their ends are the faults: told already
        odd = {r: f.exitcode for r, f in result.failures.items() if f.exitcode != EXIT_AFTER_DUMP and r not in faulty}
        if odd:
            log.warning("after the dump, ranks ended with other exit codes (a hung rank is ended with 77): %s", odd)
        print(f"trainguard: the job saved a dying-gasp checkpoint at step {records[-1]['step']} and stopped "
              f"({records[-1]['reason']}); relaunch the same command to resume from it.", file=sys.stderr)
        return EXIT_AFTER_DUMP
    if not status and result.failures and all(f.exitcode == EXIT_AFTER_DUMP for f in result.failures.values()):
        # A node without the controller (it runs on node 0) has no records; its ranks exit 75 only when told
        # to after a dump.
        print("trainguard: this node's ranks stopped after the job's dying-gasp checkpoint (node 0's log says "
              "which step); relaunch the same command to resume from it.", file=sys.stderr)
        return EXIT_AFTER_DUMP
    for rank, failure in sorted(result.failures.items()):
        print(f"trainguard: rank {rank} failed with exit code {failure.exitcode}", file=sys.stderr)
    if records and records[-1]["strategy"] == "exit":
        print(f"trainguard: the job stopped ({records[-1]['reason']})", file=sys.stderr)
    return 1


class _NoTorchFailureLine(logging.Filter):
    """torchrun's "failed (exitcode: N) local_rank: ..." line, which trainguard
    says better (a dump's 75 is no failure; see _summarise)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed (exitcode:")


def main(argv: Sequence[str] | None = None) -> int:
    logs.setup("launcher")
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_NoTorchFailureLine())
    try:
        return launch(sys.argv[1:] if argv is None else argv)
    except TrainguardError as e:
        print(f"trainguard run: {e}", file=sys.stderr)
        return 2
    finally:
        gc.freeze()  # the process ends: skip the last full collection of torch's heap (~0.4 s of CPU)
