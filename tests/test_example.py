"""The ResNet-50 example as a user runs it (small settings to fit CI)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["steps=4", "seed=1", "batch_size=2", "image_size=8", "save_every=0", "log_every=0"]

pytestmark = pytest.mark.timeout(400)


def example(tmp: Path, name: str, *, fault: str | None = None, overrides=()) -> tuple[int, dict | None, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    if fault:
        env["TRAINGUARD_FAULT"] = fault
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2", "--monitor-interval", "0.1",
           str(ROOT / "examples" / "resnet50" / "train.py"), *SMALL, f"report={name}.json",
           f"checkpoint_dir={name}-ckpt", *overrides]
    out = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=360)
    report = tmp / f"{name}.json"
    return out.returncode, json.loads(report.read_text()) if report.exists() else None, out.stdout + out.stderr


def test_example_retries_a_uce_to_the_fault_free_state(tmp_path):
    rc, ref, log = example(tmp_path, "ref")
    assert rc == 0, log[-4000:]
    for key in ("final_state_sha256", "steps_completed", "lost_steps", "pids", "recoveries"):
        assert key in ref
    assert ref["steps_completed"] == 4 and ref["recoveries"] == []

    rc, uce, log = example(tmp_path, "uce", overrides=['fault="uce:rank=1,step=2,phase=backward"'])
    assert rc == 0, log[-4000:]
    assert uce["final_state_sha256"] == ref["final_state_sha256"]
    assert uce["lost_steps"] == 0 and all(len(p) == 1 for p in uce["pids"].values())
    assert [r["strategy"] for r in uce["recoveries"]] == ["retry"]
    assert not (tmp_path / "outputs").exists(), "hydra must not create output directories"
