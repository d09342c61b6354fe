"""``trainguard rehearse``: prove on your own script that every fault ends
bit-identical to a fault-free run.

::

    trainguard rehearse [--quick] [--kinds LIST] [--json FILE] [--strategies LIST] [--dir DIR] [--seed N]
                        [--keep] [--framework mindspore] [launcher flags] SCRIPT [ARGS]

It runs the script, unedited, once without faults and then once per case
(:mod:`.cases`), each in a directory of its own (its checkpoints and
snapshots too: :mod:`trainguard.core.rehearsal`), relaunching after a dying
gasp or a stop as a user would. It prints a table -- case, strategy taken,
lost steps, detection and recovery seconds, bit-identical or why not -- and
exits 0 only when every case that applies ended bit-identical. ``--kinds``
keeps the cases of some kinds only (uce, comm, crash, hang, stop, kill,
resume, save, recovery); ``--keep`` keeps the runs' directories of a
rehearsal that passed (one that did not is always kept).

Exit codes: 0 every case passed; 1 some case did not; 2 a usage error or a
fault-free run that failed.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from trainguard.core.rehearsal import read_final, read_launches, read_trace

from .cases import Case, plan_cases
from .runs import first_error, launcher, run, saved_steps, strikes
from .verdict import judge

__all__ = ["main"]

USAGE = __doc__.split("::")[1].split("It runs")[0].strip()
_OWN = {"--json": 1, "--strategies": 1, "--dir": 1, "--seed": 1, "--framework": 1, "--kinds": 1, "--quick": 0,
        "--keep": 0}


class _Help(Exception):
    """``-h``/``--help`` among rehearse's own options."""


def _options(argv: list[str]) -> tuple[dict, list[str]]:
    """Rehearse's own options (they come first), then the launcher's argv."""
    opts: dict = {"quick": False, "keep": False, "framework": "torch", "seed": None}
    while argv and (argv[0].split("=")[0] in _OWN or argv[0] in ("-h", "--help")):
        if argv[0] in ("-h", "--help"):
            raise _Help
        name, _, value = argv.pop(0).partition("=")
        if _OWN[name] and not value:
            if not argv:
                raise SystemExit(f"trainguard rehearse: {name} needs a value\nusage: {USAGE}")
            value = argv.pop(0)
        opts[name[2:]] = value if _OWN[name] else True
    if opts["framework"] not in ("torch", "mindspore"):
        raise SystemExit(f"trainguard rehearse: --framework must be torch or mindspore, got {opts['framework']!r}")
    if not argv:
        raise SystemExit(f"trainguard rehearse: no script given\nusage: {USAGE}")
    return opts, argv


def main(argv: Sequence[str]) -> int:
    try:
        opts, rest = _options(list(argv))
    except _Help:  # rehearse's own help, before anything is launched (not the launcher's)
        print(f"usage: {USAGE}\n\nIt runs{__doc__.split('It runs', 1)[1]}", end="")
        return 0
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    seed = int(opts["seed"]) if opts["seed"] is not None else random.randrange(1 << 30)
    root = Path(opts["dir"]) if opts.get("dir") else Path(tempfile.mkdtemp(prefix="trainguard-rehearse-"))
    command, strategies = launcher(rest, opts["framework"]), opts.get("strategies")
    print(f"trainguard rehearse: runs in {root} (seed {seed})", flush=True)

    reference = run(root / "fault-free", command, strategies=strategies)
    final = read_final(reference.directory)
    if not reference.finished or not final:
        print(f"trainguard rehearse: the fault-free run failed (exit {reference.launches[-1].rc}); see "
              f"{reference.launches[-1].log}", file=sys.stderr)
        return 2
    flaw = _not_fault_free(reference, final)
    if flaw:  # every case would be compared with a run that went through a recovery itself
        print(f"trainguard rehearse: the fault-free run was not free of faults: {flaw}; a rehearsal compares each "
              f"case with a run that needed no recovery (on a busy machine a step slower than the hang limit reads "
              f"as a hang: TRAINGUARD_HANG_MIN_S raises its floor); see {reference.launches[-1].log}", file=sys.stderr)
        return 2
    world, steps = len(final), final[0]["steps_completed"]
    cases = plan_cases(world, steps, saved_steps(reference.directory), quick=opts["quick"])
    if opts.get("kinds"):
        kinds = set(opts["kinds"].split(","))
        unknown = kinds - {c.kind for c in cases}
        if unknown:
            print(f"trainguard rehearse: unknown --kinds {sorted(unknown)}; known: "
                  f"{', '.join(dict.fromkeys(c.kind for c in cases))}", file=sys.stderr)
            return 2
        cases = [c for c in cases if c.kind in kinds]
    print(f"fault-free: {world} ranks, {steps} steps in {reference.launches[0].seconds:.1f} s; "
          f"{len(cases)} cases", flush=True)
    ref_traces = {r: read_trace(reference.directory, r) for r in final}
    rows = []
    for i, case in enumerate(cases):
        rows.append(_one(case, root, command, strategies, steps, seed + i, final, ref_traces))
        print(_line(rows[-1]), flush=True)
    passed = all(r["identical"] or r["skipped"] for r in rows)
    print("\n" + table(rows))
    print(f"\n{'every case' if passed else 'NOT every case'} ended bit-identical to the fault-free run"
          f" ({sum(r['identical'] for r in rows)} of {sum(not r['skipped'] for r in rows)})")
    if opts.get("json"):
        Path(opts["json"]).write_text(json.dumps({
            "command": command, "seed": seed, "world_size": world, "steps": steps, "passed": passed,
            "fault_free_s": round(reference.launches[0].seconds, 2), "cases": rows}, indent=1))
    if not opts["keep"] and passed and not opts.get("dir"):
        shutil.rmtree(root, ignore_errors=True)
    return 0 if passed else 1


def _not_fault_free(reference, final: dict) -> str:
    """Why the fault-free run cannot stand as the reference ("" when it can):
    it needed more than one launch, or recorded a recovery."""
    if len(reference.launches) > 1:
        first = reference.launches[0]
        why = first_error(first.log)
        return f"launch 1 of {len(reference.launches)} exited {first.rc}{': ' + why if why else ''}"
    for rank in sorted(final):
        for rec in final[rank].get("recoveries", []):
            what = rec.get("message") or rec.get("reason") or ""
            return (f"it recovered ({rec.get('strategy')}) from a {rec.get('fault')} on rank {rec.get('rank')} at "
                    f"step {rec.get('step')}{': ' + what if what else ''}")
    return ""


def _one(case: Case, root: Path, command: list[str], strategies: str | None, steps: int, seed: int,
         reference: dict, ref_traces: dict) -> dict:
    row = {"case": case.name, "kind": case.kind, "fault": case.fault, "skipped": bool(case.skip),
           "identical": False, "reason": case.skip, "strategy": "", "lost_steps": None, "detect_s": None,
           "recover_s": None, "exits": []}
    if case.skip:
        return row
    r = run(root / case.slug, command, fault=case.fault, strategies=strategies, outside=case.outside,
            rank=max(reference), steps=steps, seed=seed)
    final = read_final(r.directory)
    row["exits"] = [launch.rc for launch in r.launches]
    verdict = judge(reference, final, {k: read_trace(r.directory, k) for k in reference}, ref_traces, row["exits"],
                    launches={k: read_launches(r.directory, k) for k in reference},
                    planned_exits=case.planned_exits, errors=[first_error(launch.log) for launch in r.launches])
    row.update(identical=verdict.identical, reason=verdict.reason, dir=str(r.directory))
    records = final[0].get("recoveries", []) if final else []
    if records:
        row.update(strategy=" -> ".join(rec["strategy"] for rec in records),
                   lost_steps=sum(max(0, rec.get("lost_steps", 0)) for rec in records),
                   recover_s=round(sum(rec.get("recover_s") or 0 for rec in records), 3))
        struck = strikes(r.directory)
        t0 = struck[0]["time"] if struck else (r.launches[0].signalled or {}).get("time")
        if t0 is not None and records[0].get("detected_at"):
            row["detect_s"] = round(records[0]["detected_at"] - t0, 3)
    elif final:
        row["strategy"] = "none needed" if not strikes(r.directory) else "none recorded"
    if case.outside is not None and r.launches and r.launches[0].signalled is None:
        row.update(identical=False, reason="the signal was never sent (the run ended first)")
    return row


def _line(row: dict) -> str:
    status = "skipped" if row["skipped"] else "bit-identical" if row["identical"] else "DIFFERS"
    return f"  {row['case']:<32} {status}{': ' + row['reason'] if row['reason'] else ''}"


def table(rows: list[dict]) -> str:
    """The rehearsal's result as a table."""
    head = ("case", "strategy", "lost", "detect s", "recover s", "bit-identical", "why not")
    lines = [head]
    for r in rows:
        same = "skipped" if r["skipped"] else "yes" if r["identical"] else "NO"
        lines.append((r["case"], r["strategy"] or "-", "-" if r["lost_steps"] is None else str(r["lost_steps"]),
                      "-" if r["detect_s"] is None else f"{r['detect_s']:.2f}",
                      "-" if r["recover_s"] is None else f"{r['recover_s']:.2f}", same, r["reason"]))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head) - 1)]
    return "\n".join(("  ".join(c.ljust(w) for c, w in zip(line, widths)) + "  " + line[-1]).rstrip()
                     for line in lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
