"""What every benchmark shares: the machine line, the table, the JSON shape.

Every script under ``bench/`` writes::

    {"benchmark": NAME, "machine": "...", "quick": bool, "when": "...",
     "rows": [{...}, ...],                      # the side-by-side measurements
     "goals": [{"name", "measured", "target", "unit", "met"}, ...]}
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Goal:
    name: str
    measured: float | None
    target: float
    unit: str
    higher_is_better: bool = False

    @property
    def met(self) -> bool:
        if self.measured is None:
            return False
        return self.measured >= self.target if self.higher_is_better else self.measured <= self.target

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("higher_is_better")
        d["met"] = self.met
        return d


def machine() -> str:
    """One line describing where the numbers came from."""
    try:
        import torch

        torch_v = f", torch {torch.__version__}"
        if torch.cuda.is_available():
            torch_v += f", GPU {torch.cuda.get_device_name()}"
    except ImportError:
        torch_v = ""
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        mem = f", {kb / (1 << 20):.0f} GiB RAM"
    except OSError:
        pass
    return (f"{platform.machine()} {os.cpu_count()} cores{mem}, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}{torch_v}")


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a short run for CI and smoke checks")
    p.add_argument("--out", type=Path, default=None, help="JSON output path (default: bench/results/NAME.json)")
    return p


def table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns), "  ".join("-" * widths[c] for c in columns)]
    lines += ["  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns) for r in rows]
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def report(name: str, rows: Sequence[dict], columns: Sequence[str], goals: Sequence[Goal], *, quick: bool,
           out: Path | None = None, extra: dict | None = None) -> dict:
    """Print the table and the goals, write the JSON, return it."""
    result = {
        "benchmark": name,
        "machine": machine(),
        "quick": quick,
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "rows": list(rows),
        "goals": [g.to_dict() for g in goals],
        **(extra or {}),
    }
    print(f"\n{name} on {result['machine']}{' (quick)' if quick else ''}\n")
    print(table(rows, columns))
    print()
    for g in result["goals"]:
        measured = "-" if g["measured"] is None else f"{g['measured']:.4g}"
        print(f"  [{'met' if g['met'] else 'NOT met'}] {g['name']}: {measured} {g['unit']} (target {g['target']})")
    path = out or RESULTS / f"{name}{'-quick' if quick else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {path}", file=sys.stderr)
    return result
