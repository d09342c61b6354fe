"""One benchmark, two trees, interleaved pairs: before and after a change.

``python bench/pairs.py --before DIR --out FILE [--runs 3] -- scale.py --sizes 16384 --tls off``
runs ``bench/<script>`` with the given arguments from the tree at ``DIR``
(a ``git worktree`` of the baseline commit) and from this tree, with this
interpreter and ``PYTHONPATH`` at each tree, alternately: pair 1 before
then after, pair 2 after then before, and so on, so drift in the machine's
load falls on both sides alike. Each run's rows are kept with the tree, the
run number and the 1-minute load average when it started (and ``uptime``
as printed), and the medians of every numeric column per tree; the goals
are those of the last run of this tree. On a machine others share, compare
the pairs: their spread is in the file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    from bench import common
except ImportError:  # run as `python bench/pairs.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench import common

HERE = Path(__file__).resolve().parent.parent


def commit(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()


def run_once(tree: Path, script: str, args: list[str], out: Path) -> tuple[dict, str, float]:
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    load = round(os.getloadavg()[0], 1)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, str(tree / "bench" / script), *args, "--out", str(out)], cwd=tree, env=env,
                   check=True)
    return json.loads(out.read_text()), uptime, load


def medians_of(rows: list[dict]) -> dict:
    """The median of every numeric column, per tree and per kind of row (its ``mode`` and ``scenario``)."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(" ".join([r["tree"], *(str(r[k]) for k in ("mode", "scenario") if r.get(k))]), []).append(r)
    medians = {}
    for label, mine in groups.items():
        for k in mine[0]:
            values = [r[k] for r in mine if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)]
            if k != "run" and len(values) == len(mine):
                medians[f"{label}: median {k}"] = round(statistics.median(values), 3)
    return medians


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", type=Path, required=True, help="a checkout of the baseline tree")
    p.add_argument("--runs", type=int, default=3, help="pairs")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--note", default="", help="what the pairs compare, for the result file")
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...: the benchmark and its arguments")
    a = p.parse_args()
    script, *args = a.bench[1:] if a.bench[:1] == ["--"] else a.bench
    trees = {f"before ({commit(a.before)})": a.before.resolve(), f"after ({commit(HERE)})": HERE}
    (before, b_dir), (after, h_dir) = trees.items()
    rows, last, uptimes, run = [], {}, [], 0
    with tempfile.TemporaryDirectory(prefix="tg-pairs-") as d:
        for pair in range(a.runs):
            order = [(before, b_dir), (after, h_dir)] if pair % 2 == 0 else [(after, h_dir), (before, b_dir)]
            for label, tree in order:
                run += 1
                result, uptime, load = run_once(tree, script, args, Path(d) / "run.json")
                print(f"run {run}: {label}: {uptime}", file=sys.stderr)
                uptimes.append(f"run {run} ({label}): {uptime}")
                for row in result["rows"]:
                    rows.append({"run": run, "tree": label, **row, "loadavg_1m_at_start": load})
                last[label] = result
    medians = medians_of(rows)
    out = {"benchmark": last[after]["benchmark"], "machine": common.machine(), "quick": last[after]["quick"],
           "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "note": a.note, "command": f"python bench/pairs.py --before <{before}> --runs {a.runs} -- "
                                      f"{script} {' '.join(args)}",
           "rows": rows, "goals": last[after]["goals"], "medians": medians, "uptime": uptimes}
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(medians, indent=1))
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
