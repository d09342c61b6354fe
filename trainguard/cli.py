"""The ``trainguard`` command.

* ``trainguard run [torchrun flags] SCRIPT [ARGS]`` -- launch a protected job;
  ``trainguard run --framework mindspore [msrun flags] SCRIPT [ARGS]`` -- the same with msrun.
* ``trainguard status [--controller HOST:PORT]`` -- a running job's state.
* ``trainguard ckpt list|verify DIR`` -- the checkpoints in a directory and
  whether each passes verification.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Sequence

__all__ = ["main"]

USAGE = """usage: trainguard {run,status,ckpt} ...

  run     launch a training script like torchrun, protected by trainguard
          (--framework mindspore: like msrun, with msrun's flags)
  status  show a running job's controller state
  ckpt    list or verify checkpoints in a directory
"""


def _status(argv: Sequence[str]) -> int:
    from trainguard.core.client import ControllerClient

    p = argparse.ArgumentParser(prog="trainguard status")
    p.add_argument("--controller", default=os.environ.get("TRAINGUARD_CONTROLLER"),
                   help="controller host:port (default: TRAINGUARD_CONTROLLER)")
    p.add_argument("--token", default=os.environ.get("TRAINGUARD_TOKEN"),
                   help="job token (default: TRAINGUARD_TOKEN)")
    args = p.parse_args(argv)
    if not args.controller or not args.token:
        p.error("give --controller and --token (or set TRAINGUARD_CONTROLLER and TRAINGUARD_TOKEN)")
    print(json.dumps(ControllerClient(args.controller, args.token).status(), indent=1))
    return 0


def _ckpt(argv: Sequence[str]) -> int:
    from trainguard.core import MEGATRON, TORCH, CheckpointError, CheckpointStore

    p = argparse.ArgumentParser(prog="trainguard ckpt")
    p.add_argument("action", choices=["list", "verify"])
    p.add_argument("directory", type=Path)
    p.add_argument("--layout", choices=["torch", "megatron"], default="torch")
    args = p.parse_args(argv)
    store = CheckpointStore(args.directory, TORCH if args.layout == "torch" else MEGATRON)
    steps = store.steps()
    if not steps:
        print(f"no complete checkpoints in {args.directory}")
        return 1
    bad = 0
    for step in steps:
        if args.action == "list":
            print(store.final_path(step))
            continue
        try:
            store.verify(store.final_path(step))
            print(f"ok      {store.final_path(step)}")
        except CheckpointError as e:
            bad += 1
            print(f"BROKEN  {e}")
    return 1 if bad else 0


def _framework(argv: list[str]) -> tuple[str, list[str]]:
    """``--framework NAME`` / ``--framework=NAME`` at the front of ``run``'s arguments."""
    first = argv[0]
    name, rest = (first.partition("=")[2], argv[1:]) if "=" in first else (argv[1] if len(argv) > 1 else "", argv[2:])
    if name not in ("torch", "mindspore"):
        raise SystemExit(f"trainguard run: --framework must be torch or mindspore, got {name!r}")
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
    if command == "run":
        from trainguard.launcher.run import main as run_main

        return run_main(rest)
    if command == "status":
        return _status(rest)
    if command == "ckpt":
        return _ckpt(rest)
    print(f"trainguard: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
