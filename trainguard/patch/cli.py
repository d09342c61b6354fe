"""The ``adapters-patch`` command.

* ``adapters-patch torchrun`` -- edit the installed ``torch/distributed/run.py``
  so plain ``torchrun`` launches through ``trainguard run``;
* ``adapters-patch msrun`` -- edit the installed
  ``mindspore/parallel/cluster/process_entity/_api.py`` so plain ``msrun``
  hands its workers to trainguard (through MindSpore's own taskd hook);
* ``--check`` says what would be done and whether it would succeed;
* ``--revert`` restores the original file byte for byte;
* ``--python PATH`` targets the environment of another interpreter.

Exit codes: 0 done (or nothing to do, or ``--check`` found it would
succeed); 2 refused, with the reason on stderr, and nothing changed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from . import core, msrun, torchrun
from .core import Located, PatchError, Target

__all__ = ["main"]

TARGETS: dict[str, Target] = {t.name: t for t in (torchrun.TARGET, msrun.TARGET)}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="adapters-patch", description="Make a framework's own launcher start trainguard, by editing its "
        "installed launcher file (idempotent, reversible byte for byte, version-checked).")
    sub = p.add_subparsers(dest="target", required=True, metavar="TARGET")
    for t in TARGETS.values():
        s = sub.add_parser(t.name, help=t.summary, description=f"{t.summary}. Supported: {t.supported}.")
        s.add_argument("--check", action="store_true",
                       help="print what would be done and whether it would succeed; change nothing")
        s.add_argument("--revert", action="store_true", help="restore the original file byte for byte")
        where = s.add_mutually_exclusive_group()
        where.add_argument("--python", metavar="PATH",
                           help="patch the environment of this Python interpreter (default: the one running "
                                "adapters-patch)")
        where.add_argument("--file", type=Path, metavar="PATH",
                           help=f"patch this copy of {t.package}/{t.relative_path} instead (testing, unusual "
                                f"installs); needs --{t.package}-version")
        s.add_argument(f"--{t.package}-version", dest="version", metavar="VERSION",
                       help=f"the {t.package} version the --file belongs to")
    return p


def _locate(target: Target, args: argparse.Namespace) -> Located:
    if args.file is None:
        if args.version is not None:
            raise PatchError(f"--{target.package}-version goes with --file; without it the version is read "
                             f"from the environment")
        return core.locate(target, args.python or sys.executable)
    if args.version is None:
        raise PatchError(f"--file needs --{target.package}-version (the version that file belongs to)")
    if not args.file.is_file():
        raise PatchError(f"{args.file} does not exist")
    return Located(args.file.resolve(), args.version)


def _row(target: Target, label: str, value: object) -> None:
    width = len(max("action", target.package, key=len)) + 3  # the longest label, its colon and a space
    print(f"  {label + ':':<{width}}{value}")


def _run(target: Target, args: argparse.Namespace) -> int:
    found = _locate(target, args)
    if args.check:
        print(f"adapters-patch {target.name}{' --revert' if args.revert else ''} --check (changes nothing)")
        _row(target, "file", found.path)
        _row(target, target.package, f"{found.version} (supported: {target.supported})")
    try:
        data = found.path.read_bytes()
    except OSError as e:
        raise PatchError(f"cannot read {found.path}: {e.strerror or e}") from None
    if args.check:
        _row(target, "state", core.state(data))
    core.check_version(target, found.version)
    plan = (core.plan_revert if args.revert else core.plan_apply)(target, found.path, data,
                                                                   core.read_backup(found.path))
    if plan.new is not None:
        core.check_writable(found.path)
    if found.has_trainguard is False and not args.revert:
        print(f"adapters-patch {target.name}: warning: trainguard is not installed in that environment; until "
              f"it is, the patched launcher warns and runs as before", file=sys.stderr)
    if args.check:
        _row(target, "action", plan.action)
        return 0
    core.execute(plan)
    print(f"{found.path}: {plan.action}" if plan.new is None else f"{found.path}: done: {plan.action}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    target = TARGETS[args.target]
    try:
        return _run(target, args)
    except PatchError as e:
        print(f"adapters-patch {target.name}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
