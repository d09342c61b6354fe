"""Running the integrations' examples (examples/{accelerate,hf,lightning}/train.py)
under ``trainguard run`` on 2 gloo ranks, and comparing their ends with a
fault-free run: the model and optimizer (the report's hash) and every rank's
random streams and data position (the rehearsal trace's final fingerprints)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from conftest import ROOT, Job, run_bounded


def run_example(tmp: Path, example: str, name: str, *, steps: int, fault: str = "", ckpt: Path | None = None,
                save_every: int = 0, env: dict | None = None, timeout: float = 240,
                max_restarts: int | None = None) -> Job:
    """``trainguard run --nproc-per-node 2 examples/<example>/train.py``; every
    rank writes its final fingerprints (random streams, data position).
    ``max_restarts=0``: a lost rank is dumped and the job exits 75 (the
    defaults restart it in place)."""
    ckpt = ckpt or tmp / f"{name}-ckpt"
    report = tmp / f"{name}.json"
    report.unlink(missing_ok=True)
    full = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    full.update({"TRAINGUARD_HEARTBEAT_INTERVAL_S": "0.5", "TRAINGUARD_PRELOCK_TIMEOUT_S": "20",
                 "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(env or {})})
    if fault:
        full["TRAINGUARD_FAULT"] = fault
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2", "--monitor-interval", "0.1",
           *(("--max-restarts", str(max_restarts)) if max_restarts is not None else ()), str(ROOT / "examples" / example / "train.py"), f"steps={steps}", f"checkpoint_dir={ckpt}",
           f"save_every={save_every}", f"report={report}"]
    proc = run_bounded(cmd, env=full, cwd=tmp, timeout=timeout)
    if proc.returncode:
        print(f"--- {name}: exit {proc.returncode}; log tail ---\n{(proc.stdout + proc.stderr)[-8000:]}")
    data = json.loads(report.read_text()) if report.exists() else None
    return Job(proc.returncode, proc.stdout + proc.stderr, data, ckpt, report)


def same_end(job: Job, reference: Job) -> None:
    """``job`` ended where ``reference`` did: the state's hash, every rank's
    random streams and data position (and the rest of its state, where the
    example reports it), no step lost."""
    assert job.report is not None, job
    for key in ("steps_completed", "final_state_sha256", "final_own"):
        assert job.report[key] == reference.report[key], (key, job.report[key], reference.report[key], job)
    if "final_pieces" in reference.report:  # every rank's scheduler, learning rates... (where the example gathers them)
        assert job.report["final_pieces"] == reference.report["final_pieces"], (
            job.report["final_pieces"], reference.report["final_pieces"], job)
    assert job.report["lost_steps"] == 0, job
