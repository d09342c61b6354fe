"""The ``trainguard`` command.

* ``trainguard run [torchrun flags] SCRIPT [ARGS]`` -- launch a protected job;
  ``trainguard run --framework mindspore [msrun flags] SCRIPT [ARGS]`` -- the same with msrun;
  ``trainguard run --framework tensorflow --workers-per-node N SCRIPT [ARGS]`` -- a multi-worker
  TensorFlow job, restarted whole on a fault.
* ``trainguard rehearse [--quick] [--json FILE] [--strategies LIST] [launcher flags] SCRIPT [ARGS]`` --
  inject every kind of fault into your own script and check each run ends
  bit-identical to a fault-free one (:mod:`trainguard.rehearse`).
* ``trainguard status [--controller HOST:PORT] [--watch [--interval S]]`` -- a
  running job's state (``--watch``: each rank's step and state and the last
  fault, redrawn every S seconds until the job ends).
* ``trainguard report RUN_DIR [--out PNG]`` -- a picture of a job's timeline
  and a text summary, from the run directory ``trainguard run --run-dir``
  wrote (:mod:`trainguard.report`).
* ``trainguard ckpt list|verify DIR [--layout auto|torch|megatron|mindspore]`` -- the checkpoints in a
  directory (its layout found from its tracker file unless given) and whether each passes verification.
* ``trainguard slow-nodes DIR [--job ID] [--json] [--plot PNG]`` -- the slow
  ranks of a job from its profiling records, with the evidence.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Sequence

__all__ = ["main"]

USAGE = """usage: trainguard {run,rehearse,status,report,ckpt,slow-nodes} ...

  run     launch a training script like torchrun, protected by trainguard
          (--framework mindspore: like msrun, with msrun's flags;
           --framework tensorflow: TF_CONFIG per worker, the whole job restarted on a fault)
  rehearse  run your script once per fault kind and check each ends bit-identical
          to a fault-free run (--quick: one case per kind)
  status  show a running job's controller state (--watch: live, per rank)
  report  draw a job's timeline from its run directory (--run-dir) and summarise it
  ckpt    list or verify checkpoints in a directory
  slow-nodes  find slow ranks in a job's profiling records (table, JSON, plot)
"""


def _status(argv: Sequence[str]) -> int:
    from trainguard.core import ConfigError
    from trainguard.core.control.client import ControllerClient
    from trainguard.core.secret import TLS, configured_secret

    p = argparse.ArgumentParser(prog="trainguard status")
    p.add_argument("--controller", default=os.environ.get("TRAINGUARD_CONTROLLER"),
                   help="controller host:port (default: TRAINGUARD_CONTROLLER)")
    p.add_argument("--token", default=None, help="job secret (default: read from TRAINGUARD_TOKEN_FILE, else "
                                                 "TRAINGUARD_TOKEN)")
    p.add_argument("--watch", action="store_true",
                   help="redraw each rank's step and state and the last fault until the job ends (Ctrl-C stops)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between redraws with --watch (default 2)")
    args = p.parse_args(argv)
    if args.interval <= 0:
        p.error("--interval must be > 0")
    try:
        token = args.token or configured_secret()
    except ConfigError as e:  # an unreadable file, a short secret
        p.error(str(e))
    if not args.controller or not token:
        p.error("give --controller and the job secret (--token, TRAINGUARD_TOKEN_FILE or TRAINGUARD_TOKEN)")
    from trainguard.core.api import ControllerLostError, ProtocolError

    # the controller's TLS settings when it serves TLS (TRAINGUARD_TLS_CERT/KEY/CA)
    client = ControllerClient(args.controller, token, tls=TLS.from_env(), timeout_s=min(10.0, max(2.0, args.interval)))
    try:
        if args.watch:
            from trainguard.report.watch import watch

            return watch(client.status, interval=args.interval, address=args.controller,
                         lost=(ControllerLostError, ProtocolError))
        try:
            print(json.dumps(client.status(), indent=1))
        except (ControllerLostError, ProtocolError) as e:
            print(f"trainguard status: {e}", file=sys.stderr)
            return 1
        return 0
    finally:
        client.close()


def _report(argv: Sequence[str]) -> int:
    from trainguard.core import ConfigError
    from trainguard.report.timeline import RunDirError, load, summary

    p = argparse.ArgumentParser(prog="trainguard report",
                                description="Draw a job's timeline (one PNG) and summarise it, from the run "
                                            "directory `trainguard run --run-dir DIR` (TRAINGUARD_RUN_DIR) wrote.")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the job's run directory (holds events.jsonl)")
    p.add_argument("--out", type=Path, metavar="PNG", help="where to write the picture (default RUN_DIR/report.png)")
    p.add_argument("--no-picture", action="store_true", help="only the text summary")
    args = p.parse_args(argv)
    try:
        timeline = load(args.run_dir)
    except RunDirError as e:
        print(f"trainguard report: {e}", file=sys.stderr)
        return 1
    picture = None
    if not args.no_picture:
        out = args.out or args.run_dir / "report.png"
        try:
            from trainguard.report.plot import draw

            picture = draw(timeline, out)
        except ImportError:  # matplotlib is imported when drawing
            print(summary(timeline))
            print("trainguard report: the picture needs matplotlib (pip install 'trainguard[report]')",
                  file=sys.stderr)
            return 2
        except (OSError, ConfigError) as e:
            print(summary(timeline))
            print(f"trainguard report: cannot write {out}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
            return 1
    print(summary(timeline, picture))
    return 0


#: ``trainguard ckpt --layout`` -> the name of the naming in trainguard.core.
_LAYOUTS = {"torch": "TORCH", "megatron": "MEGATRON", "mindspore": "MINDSPORE"}


def _naming(directory: Path, layout: str):
    """The checkpoint naming of ``directory``: ``layout``'s, or with ``auto`` the first whose tracker file
    (``latest_step.txt``, ``latest_checkpointed_iteration.txt``, ``latest_tft_step.txt``) or step
    directories it holds (torch's when none)."""
    import trainguard.core as core

    namings = [getattr(core, _LAYOUTS[name]) for name in _LAYOUTS]
    if layout != "auto":
        return getattr(core, _LAYOUTS[layout])
    try:
        names = [p.name for p in directory.iterdir()]
    except OSError:
        return core.TORCH
    for naming in namings:
        if naming.tracker in names or any(naming.step_of(n) is not None for n in names):
            return naming
    return core.TORCH


def _ckpt(argv: Sequence[str]) -> int:
    from trainguard.core import TORCH, CheckpointError, CheckpointStore, ConfigError

    p = argparse.ArgumentParser(prog="trainguard ckpt")
    p.add_argument("action", choices=["list", "verify"])
    p.add_argument("directory", type=Path)
    p.add_argument("--layout", choices=["auto", *_LAYOUTS], default="auto",
                   help="the directory's naming (default auto: the one whose tracker file or step directories "
                        "are there)")
    args = p.parse_args(argv)
    naming = _naming(args.directory, args.layout)
    try:  # only read: a directory of another user may be inspected (its unkeyed checkpoints are refused)
        store = CheckpointStore(args.directory, naming, writer=False)
    except ConfigError as e:  # a key file that cannot be used
        print(f"trainguard ckpt: {e}", file=sys.stderr)
        return 2
    try:
        steps = store.steps()
    except OSError as e:
        print(f"cannot list {args.directory}: {e.strerror or e}")
        return 1
    if not steps:
        print(f"no complete checkpoints in {args.directory}")
        return 1
    bad = 0
    for step in steps:
        if args.action == "list":
            print(store.final_path(step))
            continue
        try:
            found = store.verify(store.final_path(step))
        except CheckpointError as e:
            bad += 1
            print(f"BROKEN  {e}")
            continue
        why = _content_problem(found) if naming is TORCH else None
        if why is not None:
            bad += 1
            print(f"BROKEN  {found.path.name}: {why}")
        else:
            print(f"ok      {store.final_path(step)}")
    return 1 if bad else 0


def _content_problem(found) -> str | None:
    """What the torch adapter finds wrong inside a checkpoint's files (the
    coverage of sharded state), imported only when there is one to check."""
    from trainguard.adapters.torch.coverage import content_problem
    return content_problem(found)


def _slow_nodes(argv: Sequence[str]) -> int:
    from trainguard.core import ConfigError
    from trainguard.core.profiling.detect import DetectorConfig
    from trainguard.core.profiling.records import find_job_dir
    from trainguard.core.profiling.report import analyse, plot, table

    p = argparse.ArgumentParser(prog="trainguard slow-nodes",
                                description="Find the slow ranks of a job from its profiling records.")
    p.add_argument("directory", type=Path, help="the profiling directory, or one job's directory in it")
    p.add_argument("--job", help="the job id, when the directory holds several jobs")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", type=Path, metavar="PNG", help="also draw the per-step times to this PNG file")
    p.add_argument("--baseline-steps", type=int, default=DetectorConfig.baseline_steps,
                   help="steps after warm-up that form each rank's baseline (default %(default)s)")
    p.add_argument("--consecutive", type=int, default=DetectorConfig.consecutive,
                   help="steps in a row a rank must exceed before it is named (default %(default)s)")
    args = p.parse_args(argv)
    try:
        config = DetectorConfig(baseline_steps=args.baseline_steps, consecutive=args.consecutive)
        job_dir = find_job_dir(args.directory, args.job)
        result = analyse(job_dir, config)
    except ConfigError as e:
        print(f"trainguard slow-nodes: {e}", file=sys.stderr)
        return 2
    if args.plot is not None:
        try:
            result["plot"] = str(plot(job_dir, result, args.plot))
        except ImportError:
            print("trainguard slow-nodes: --plot needs matplotlib (pip install 'trainguard[plot]')", file=sys.stderr)
            return 2
    print(json.dumps(result, indent=1) if args.json else table(result))
    return 0


def _framework(argv: list[str]) -> tuple[str, list[str]]:
    """``--framework NAME`` / ``--framework=NAME`` at the front of ``run``'s arguments."""
    first = argv[0]
    name, rest = (first.partition("=")[2], argv[1:]) if "=" in first else (argv[1] if len(argv) > 1 else "", argv[2:])
    if name not in ("torch", "mindspore", "tensorflow"):
        raise SystemExit(f"trainguard run: --framework must be torch, mindspore or tensorflow, got {name!r}")
    return name, rest


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "run" and rest and rest[0].startswith("--framework"):
        framework, rest = _framework(rest)
        if framework == "mindspore":
            from trainguard.launcher.msrun import main as msrun_main

            return msrun_main(rest)
        if framework == "tensorflow":
            from trainguard.launcher.tfrun import main as tf_main

            return tf_main(rest)
    if command == "run":
        from trainguard.launcher.run import main as run_main

        return run_main(rest)
    if command == "rehearse":
        from trainguard.rehearse import main as rehearse_main

        return rehearse_main(rest)
    if command == "status":
        return _status(rest)
    if command == "report":
        return _report(rest)
    if command == "ckpt":
        return _ckpt(rest)
    if command == "slow-nodes":
        return _slow_nodes(rest)
    print(f"trainguard: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
