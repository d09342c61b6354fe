"""The one table of settings: every ``TRAINGUARD_*`` environment variable, its meaning,
default and reader.

:func:`trainguard.core.config.check_env` refuses a variable missing here (a typo must not
silently leave a job unprotected); ``docs/settings.md`` is generated from :data:`ENV`
(``python scripts/gen_docs.py``), and ``tests/test_docs.py`` fails when it is stale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

__all__ = ["ENV", "Setting"]


@dataclass(frozen=True)
class Setting:
    """One environment variable: what it means, its default, and which part of trainguard reads it
    (``docs/settings.md`` is generated from :data:`ENV`)."""

    meaning: str
    default: str = "unset"
    read_by: str = ""


#: Every environment variable trainguard reads: the one table of settings.
ENV: Mapping[str, Setting] = {
    "TRAINGUARD_CONTROLLER": Setting(
        "controller address host:port",
        default="set by the launcher", read_by="rank (processor); `trainguard status`"),
    "TRAINGUARD_TOKEN": Setting(
        "per-job secret authenticating control messages (the same on every node of a multi-node job)",
        default="single node: made by the launcher", read_by="launcher, rank, persist worker"),
    "TRAINGUARD_TOKEN_FILE": Setting(
        "a file holding the job secret, mounted on every node (a Kubernetes Secret); read before "
        "TRAINGUARD_TOKEN",
        default="unset", read_by="launcher, rank, `trainguard status`"),
    "TRAINGUARD_KEY_FILE": Setting(
        "a project key file: checkpoint manifests and compile-cache entries carry an HMAC under it; it may stay "
        "the same while job secrets change (checked as the token file is)",
        default="the configured job secret, if any", read_by="launcher, rank, `trainguard ckpt`"),
    "TRAINGUARD_CHECKPOINT_KEY": Setting(
        "the integrity key the launcher found, in hex, or none, for its workers (do not set by hand)",
        default="set by the launcher", read_by="rank, persist worker"),
    "TRAINGUARD_ALLOW_SHARED_DIRS": Setting(
        "1: use directories (run dir, snapshot root, checkpoint dir, compile cache) of other users, or that "
        "others may write in",
        default="off", read_by="launcher, rank, `trainguard report`, `trainguard ckpt`"),
    "TRAINGUARD_TLS_CERT": Setting(
        "PEM certificate of this node for mutual TLS on the control plane (with _KEY and _CA)",
        default="off", read_by="launcher (controller, relay), `trainguard status`"),
    "TRAINGUARD_TLS_KEY": Setting(
        "PEM private key of TRAINGUARD_TLS_CERT",
        default="off", read_by="launcher (controller, relay), `trainguard status`"),
    "TRAINGUARD_TLS_CA": Setting(
        "PEM certificate of the authority that signed every node's certificate",
        default="off", read_by="launcher (controller, relay), `trainguard status`"),
    "TRAINGUARD_CHECKPOINT_DIR": Setting(
        "where trainguard.compat.mindio_ttp.megatron_ttp saves and loads when Megatron-LM's "
        "args.save/args.load are not there",
        default="unset", read_by="Megatron-LM (trainguard.compat.mindio_ttp)"),
    "TRAINGUARD_JOB_ID": Setting(
        "job id used in logs, checkpoints and profiling directories",
        default="the rendezvous id (msrun: its port)", read_by="launcher, rank, profiling"),
    "TRAINGUARD_STRATEGIES": Setting(
        "ordered recover strategies, comma-separated; `--strategies` wins",
        default="the pod's recover-strategy annotation, else (trainguard run) retry,recover-in-place,dump,exit with a "
                "restart budget, retry,dump,exit with --max-restarts 0", read_by="launcher (controller)"),
    "TRAINGUARD_ANNOTATIONS": Setting(
        "the pod's annotations file (Kubernetes Downward API, metadata.annotations), whose recover-"
        "strategy is used when neither --strategies nor TRAINGUARD_STRATEGIES is given",
        default="/etc/podinfo/annotations (read only if it exists)", read_by="launcher"),
    "TRAINGUARD_FAULT": Setting(
        "fault injection: KIND:rank=R,step=N[,phase=P];...",
        default="none", read_by="launcher (checks the ranks), rank (strikes)"),
    "TRAINGUARD_HOST": Setting(
        "address the controller binds to; `--controller-host` wins",
        default="127.0.0.1", read_by="launcher (controller); TaskD manager"),
    "TRAINGUARD_PORT": Setting(
        "port the controller binds to; `--controller-port` wins",
        default="any free port (TaskD manager: 9601)", read_by="launcher (controller); TaskD manager"),
    "TRAINGUARD_HEARTBEAT_INTERVAL_S": Setting(
        "seconds between rank heartbeats",
        default="1, or world_size/4096 above 4096 ranks", read_by="controller (tells the ranks)"),
    "TRAINGUARD_HEARTBEAT_MISSES": Setting(
        "missed heartbeats before a rank counts as lost",
        default="3", read_by="controller"),
    "TRAINGUARD_FIRST_STEP_SILENCE_S": Setting(
        "seconds a rank with no step time yet may go without a heartbeat (a graph compile holds the GIL, "
        "and the heartbeat thread, for seconds)",
        default="600", read_by="controller"),
    "TRAINGUARD_PRELOCK_TIMEOUT_S": Setting(
        "seconds healthy ranks get to stop at a consistent step",
        default="30", read_by="controller"),
    "TRAINGUARD_HANDLER_TIMEOUT_S": Setting(
        "seconds a stop/clean/repair/rollback handler may take",
        default="180", read_by="controller"),
    "TRAINGUARD_SAVE_TIMEOUT_S": Setting(
        "seconds a dying-gasp save may take",
        default="1800", read_by="controller, rank"),
    "TRAINGUARD_MAX_MESSAGE_BYTES": Setting(
        "largest control message accepted",
        default="1048576 (1 MiB)", read_by="controller, rank (processor)"),
    "TRAINGUARD_RESTART_TIMEOUT_S": Setting(
        "seconds a restarted process may take to start and join",
        default="300", read_by="controller"),
    "TRAINGUARD_SPARE_SLOTS": Setting(
        "workers a node agent may start for other nodes' ranks under `recover`; `--spare-slots` wins",
        default="0", read_by="launcher (node agent)"),
    "TRAINGUARD_STANDBY": Setting(
        "'off': restarted workers start cold instead of in a warm standby process",
        default="on", read_by="launcher (node agent)"),
    "TRAINGUARD_JOIN": Setting(
        "what a replacement process joins (do not set by hand)",
        default="set by the node agent", read_by="rank (a replacement process)"),
    "TRAINGUARD_SHM_REPAIR": Setting(
        "0: a MindSpore repair between ranks of one machine uses Broadcast, not /dev/shm",
        default="1", read_by="rank (MindSpore Guard)"),
    "TRAINGUARD_SNAPSHOT_EVERY": Setting(
        "copy each rank's state into shared memory every this many iterations; periodic saves then "
        "persist it in the background",
        default="0 (off)", read_by="Megatron-LM (trainguard.compat.mindio_ttp)"),
    "TRAINGUARD_SNAPSHOTS_IN_MEMORY": Setting(
        "snapshot slots per rank, each the size of the rank's state",
        default="2", read_by="Megatron-LM (trainguard.compat.mindio_ttp)"),
    "TRAINGUARD_SNAPSHOT_OVERLAP": Setting(
        "1 copies a snapshot beside the next step, whose optimizer update waits for it; 0 copies it in "
        "line (parameters changed outside updates)",
        default="1", read_by="rank (torch Guard)"),
    "TRAINGUARD_SNAPSHOT_ROOT": Setting(
        "where snapshot directories live in shared memory",
        default="/dev/shm", read_by="launcher (node agent), rank"),
    "TRAINGUARD_SNAPSHOT_STAGING_MB": Setting(
        "staging buffer of GPU snapshots, MiB on each GPU",
        default="64 (0: none)", read_by="rank (torch Guard, CUDA)"),
    "TRAINGUARD_INNER_BACKEND": Setting(
        "gloo or nccl inside the groups of the `trainguard` process-group backend",
        default="gloo", read_by="rank (torch, init_process_group('trainguard'))"),
    "TRAINGUARD_PERSIST_PARENT": Setting(
        "the trainer's pid, for its persist worker (do not set by hand)",
        default="set by the trainer", read_by="persist worker"),
    "TRAINGUARD_SNAPSHOT_DIR": Setting(
        "this node's snapshot directory (do not set by hand)",
        default="set by the node agent", read_by="rank"),
    "TRAINGUARD_SNAPSHOT_PEER": Setting(
        "host:port of the next node's snapshot copies (do not set by hand)",
        default="set by the node agent", read_by="rank"),
    "TRAINGUARD_STORE_ROUND": Setting(
        "names this round's worker store, the same on every node (do not set by hand)",
        default="set by the node agent", read_by="rank"),
    "TRAINGUARD_PROFILING_DIR": Setting(
        "where per-rank profiling markers are written (<dir>/<job id>/<rank>/<unix ts>)",
        default="unset: no markers", read_by="rank (markers); TaskD worker"),
    "TRAINGUARD_PROFILING_SWITCH": Setting(
        "the JSON switch file turning markers on and off at run time",
        default="<profiling dir>/profilingSwitch", read_by="rank (markers); TaskD worker"),
    "TRAINGUARD_PROFILING_CAP_MB": Setting(
        "size of the profiling directory past which each rank ages out its oldest record files",
        default="5000", read_by="rank (markers); TaskD worker"),
    "TRAINGUARD_COMPILE_CACHE": Setting(
        "directory of the job's compile cache, reached by every rank and relaunch; 'off': none",
        default="<checkpoint dir>/.trainguard/compile_cache", read_by="rank (torch.compile, MindSpore graph mode)"),
    "TRAINGUARD_REHEARSAL_DIR": Setting(
        "a rehearsal run's directory: the guards save checkpoints there and trace each step's "
        "fingerprints (do not set by hand)",
        default="set by `trainguard rehearse`", read_by="rank"),
    "TRAINGUARD_LOG_LEVEL": Setting(
        "log level of trainguard's loggers",
        default="INFO", read_by="every process (launcher, rank, persist worker)"),
    "TRAINGUARD_RUN_DIR": Setting(
        "the run directory: the job appends its events (faults, decisions, recoveries, checkpoints, per-"
        "rank steps) to <dir>/events.jsonl for `trainguard report`; `--run-dir` sets it",
        default="unset: none", read_by="controller, rank"),
    "TRAINGUARD_DISABLE": Setting(
        "1: a torchrun patched by `adapters-patch torchrun` runs as plain torchrun",
        default="unset", read_by="patched torchrun; Megatron-LM (trainguard.compat.mindio_ttp)"),
    "TRAINGUARD_WATCHDOG": Setting(
        "'off' turns the in-process hang watchdog off",
        default="on", read_by="rank (hang watchdog)"),
    "TRAINGUARD_HANG_STEPS": Setting(
        "a rank is hung after this many median step times without progress",
        default="3", read_by="rank (hang watchdog)"),
    "TRAINGUARD_HANG_MIN_S": Setting(
        "... but never sooner than this many seconds",
        default="2", read_by="rank (hang watchdog)"),
    "TRAINGUARD_FIRST_STEP_TIMEOUT_S": Setting(
        "limit for the first step after start or recovery, and for a section's first run",
        default="600", read_by="rank (hang watchdog)"),
    "TRAINGUARD_HEARTBEAT_FD": Setting(
        "the pipe a TensorFlow worker reports its steps on (do not set by hand)",
        default="set by `trainguard run --framework tensorflow`", read_by="TensorFlow worker"),
    "TRAINGUARD_RESTART": Setting(
        "how many times a TensorFlow job was restarted before this run (do not set by hand)",
        default="set by `trainguard run --framework tensorflow`", read_by="TensorFlow worker"),
}
