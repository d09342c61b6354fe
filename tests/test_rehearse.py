"""``trainguard rehearse`` on a user's script: it passes a script trainguard
protects, and it catches -- and names -- one that silently loses its data
position on a restart (the random streams' case is diagnosed from traces)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest

from conftest import WORKERS, run_bounded
from trainguard.rehearse import _options, table
from trainguard.rehearse.cases import plan_cases
from trainguard.rehearse.verdict import diagnose, judge

pytestmark = pytest.mark.timeout(600)


def rehearse(tmp_path, *flags: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "rehearsal.json"
    cmd = [sys.executable, "-m", "trainguard.cli", "rehearse", *flags, "--json", str(out), "--dir",
           str(tmp_path / "runs"), "--nproc-per-node", "2", "--monitor-interval", "0.1",
           "--max-restarts", "0",  # every lost process dumps and is relaunched: the paths these cases walk
           str(WORKERS / "lm_train.py"), "16", str(tmp_path / "report.json"), "ckpt", "4"]
    full = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    full.update({"TRAINGUARD_HEARTBEAT_INTERVAL_S": "0.5", **(env or {})})
    proc = run_bounded(cmd, env=full, cwd=tmp_path, timeout=560, merge=True)
    return proc, json.loads(out.read_text()) if out.exists() else {}


def test_a_protected_script_passes_its_rehearsal(tmp_path):
    proc, result = rehearse(tmp_path, "--quick", "--kinds", "uce,crash,resume")
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert result["passed"] and result["world_size"] == 2 and result["steps"] == 16
    by_case = {c["case"]: c for c in result["cases"]}
    assert set(by_case) == {"uce in backward", "crash in forward", "crash while resuming"}
    assert all(c["identical"] for c in result["cases"])
    assert by_case["uce in backward"]["strategy"] == "retry" and by_case["uce in backward"]["exits"] == [0]
    assert by_case["crash in forward"]["exits"] == [75, 0] and by_case["crash in forward"]["lost_steps"] == 0
    # the relaunch's resume failed on one rank: the job stopped, wrote nothing newer, and the next relaunch finished
    assert by_case["crash while resuming"]["exits"][0] == 75 and by_case["crash while resuming"]["exits"][-1] == 0
    assert len(by_case["crash while resuming"]["exits"]) == 3
    assert "every case ended bit-identical" in proc.stdout


def test_a_script_that_loses_its_data_position_is_caught_and_told_what_to_pass(tmp_path):
    proc, result = rehearse(tmp_path, "--kinds", "crash", "--quick", env={"LM_NO_DATA": "1"})
    assert proc.returncode == 1, proc.stdout[-6000:]
    (case,) = result["cases"]
    assert not case["identical"] and "data position is not restored" in case["reason"]
    assert "data=" in case["reason"]
    assert (tmp_path / "runs" / "crash-in-forward" / "launch-2.log").exists(), "a failed rehearsal keeps its runs"


def test_diverged_random_streams_are_named_before_the_model():
    ref = {0: {1: {"model": "a", "rng": "r1", "data": "d1"}, 2: {"model": "b", "rng": "r2", "data": "d2"}},
           1: {1: {"model": "a", "rng": "s1", "data": "d1"}, 2: {"model": "b", "rng": "s2", "data": "d2"}}}
    case = copy.deepcopy(ref)
    case[1][2].update(model="x", rng="other")
    reason = diagnose(ref, case, [0, 1], data_given=True)
    assert reason.startswith("random streams not restored: rank 1's torch's random streams differed from step 2")
    case = copy.deepcopy(ref)
    case[0][2].update(model="x")
    assert "non-deterministic" in diagnose(ref, case, [0], data_given=True)


def test_streams_a_script_does_not_seed_are_left_out_of_the_comparison():
    final = {0: {"steps_completed": 2, "final_state_sha256": "f", "rng": "r", "python": "p1", "data": None}}
    other = {0: {**final[0], "python": "p2"}}
    traces = {0: {1: {"model": "a", "rng": "r", "python": "p1"}}}
    unseeded = {0: {1: {"model": "a", "rng": "r", "python": "q1"}}}
    assert judge(final, other, unseeded, traces, [0]).identical, "Python's stream was never seeded"
    assert not judge(final, other, traces, traces, [0]).identical, "a seeded stream that parted counts"


def test_cases_fit_the_job_and_say_when_one_does_not_apply():
    cases = plan_cases(2, 16, saved=[4, 8, 12, 16], quick=True)
    kinds = [c.kind for c in cases]
    assert kinds == ["uce", "comm", "crash", "hang", "stop", "kill", "resume", "save", "recovery"]
    assert next(c for c in cases if c.kind == "save").fault == "crash:rank=1,step=4,phase=save"
    assert len(plan_cases(2, 16, saved=[], quick=False)) > len(cases)
    assert next(c for c in plan_cases(2, 16, saved=[], quick=True) if c.kind == "save").skip
    assert next(c for c in plan_cases(1, 16, saved=[], quick=True) if c.kind == "recovery").skip


def test_options_come_first_and_a_missing_script_is_a_usage_error():
    opts, rest = _options(["--quick", "--json=x.json", "--nproc-per-node", "2", "train.py", "--quick"])
    assert opts["quick"] and opts["json"] == "x.json" and rest == ["--nproc-per-node", "2", "train.py", "--quick"]
    with pytest.raises(SystemExit, match="no script given"):
        _options(["--quick"])
    with pytest.raises(SystemExit, match="--framework must be"):
        _options(["--framework", "jax", "train.py"])
    row = {"case": "crash in forward", "strategy": "dump", "lost_steps": 0, "detect_s": 0.021, "recover_s": 0.05,
           "identical": True, "skipped": False, "reason": ""}
    assert "crash in forward  dump" in table([row]) and "yes" in table([row])
