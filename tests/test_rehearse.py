"""``trainguard rehearse`` on a user's script: it passes a script trainguard
protects, and it catches -- and names -- one that silently loses its data
position on a restart (the random streams' case is diagnosed from traces)."""

from __future__ import annotations

import copy
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import WORKERS, run_bounded
from trainguard.rehearse import _options, runs, table
from trainguard.rehearse.cases import plan_cases
from trainguard.rehearse.verdict import diagnose, judge

pytestmark = pytest.mark.timeout(600)


def rehearse(tmp_path, *flags: str, env: dict | None = None, script: str = "lm_train.py",
             steps: int = 16) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "rehearsal.json"
    cmd = [sys.executable, "-m", "trainguard.cli", "rehearse", *flags, "--json", str(out), "--dir",
           str(tmp_path / "runs"), "--nproc-per-node", "2", "--monitor-interval", "0.1",
           "--max-restarts", "0",  # every lost process dumps and is relaunched: the paths these cases walk
           str(WORKERS / script), str(steps), str(tmp_path / "report.json"), "ckpt", "4"]
    full = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    full.update({"TRAINGUARD_HEARTBEAT_INTERVAL_S": "0.5", **(env or {})})
    proc = run_bounded(cmd, env=full, cwd=tmp_path, timeout=560, merge=True)
    return proc, json.loads(out.read_text()) if out.exists() else {}


def test_a_protected_script_passes_its_rehearsal(tmp_path):
    proc, result = rehearse(tmp_path, "--quick", "--kinds", "uce,crash,resume")
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert result["passed"] and result["world_size"] == 2 and result["steps"] == 16
    by_case = {c["case"]: c for c in result["cases"]}
    assert set(by_case) == {"uce in optimizer", "crash in forward", "crash while resuming"}
    assert all(c["identical"] for c in result["cases"])
    assert by_case["uce in optimizer"]["strategy"] == "retry" and by_case["uce in optimizer"]["exits"] == [0]
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


@pytest.mark.slow  # stands for it in CI: test_the_first_piece_that_parted_is_named_with_its_likely_cause
def test_a_script_that_forgets_its_grad_scaler_is_caught_and_told_to_pass_it(tmp_path):
    """The tester's mixed-precision script without ``scaler=``: the relaunch
    starts the loss scale over. Before issue 37 the reason blamed kernels
    or state to pass as extra=, or the case passed."""
    pytest.importorskip("torchdata.stateful_dataloader")
    proc, result = rehearse(tmp_path, "--kinds", "crash", "--quick", script="amp_train.py", steps=12,
                            env={"AMP_NO_SCALER": "1", "PYTHONWARNINGS": "ignore::UserWarning"})
    assert proc.returncode == 1, proc.stdout[-6000:]
    (case,) = result["cases"]
    assert not case["identical"] and "GradScaler" in case["reason"], case
    assert "pass Guard(..., scaler=scaler)" in case["reason"] and "extra=" not in case["reason"]


@pytest.mark.slow  # stands for it in CI: test_a_case_passes_only_when_every_launch_ended_as_planned
def test_a_case_whose_first_launch_stopped_without_a_dying_gasp_is_not_a_pass(tmp_path):
    """The job may not dump (``--strategies exit``): it stops at the fault
    and the relaunch trains the steps since the save of step 4 again (the
    fault strikes at step 5, inside rank 1's update). The
    model still ends identical; before issue 37 the case said "yes"
    (strategy ?, lost -)."""
    proc, result = rehearse(tmp_path, "--strategies", "exit", "--kinds", "uce", "--quick")
    assert proc.returncode == 1, proc.stdout[-6000:]
    (case,) = result["cases"]
    assert case["exits"][0] not in (0, 75) and case["exits"][-1] == 0, case
    assert not case["identical"] and "launch 1 exited" in case["reason"], case
    assert "device memory error" in case["reason"], "the launch's fault, from its log"
    # rank 0 finished step 6 as rank 1 failed inside its update of it
    assert "resumed from step 4, but the one before it had reached step 6" in case["reason"], case
    assert case["strategy"] == "relaunch" and case["lost_steps"] == 2, case


def test_diverged_random_streams_are_named_before_the_model():
    ref = {0: {1: {"model": "a", "rng": "r1", "data": "d1"}, 2: {"model": "b", "rng": "r2", "data": "d2"}},
           1: {1: {"model": "a", "rng": "s1", "data": "d1"}, 2: {"model": "b", "rng": "s2", "data": "d2"}}}
    case = copy.deepcopy(ref)
    case[1][2].update(model="x", rng="other")
    reason = diagnose(ref, case, [0, 1], {"data_given": True})
    assert reason.startswith("random streams not restored: rank 1's torch's random streams differed from step 2")
    case = copy.deepcopy(ref)
    case[0][2].update(model="x")
    assert "non-deterministic" in diagnose(ref, case, [0], {"data_given": True})


TRACE = {0: {1: {"model": "a", "optimizer": "o1", "lr": "l1", "scheduler": "s1", "scaler": "g1", "extra:ema": "e1",
                 "rng": "r1", "data": "d1"},
             2: {"model": "b", "optimizer": "o2", "lr": "l2", "scheduler": "s2", "scaler": "g2", "extra:ema": "e2",
                 "rng": "r2", "data": "d2"}}}
GIVEN = {"data_given": True, "given": ["data", "ema", "scaler", "scheduler"], "undeclared": {}}


@pytest.mark.parametrize("parts,given,expect", [
    # the piece named is the cause, not the model and optimizer it moved
    (("scaler", "model", "optimizer"), GIVEN, "GradScaler's state (scale, growth tracker, per-optimizer stage) "
                                              "parted first at step 2 on rank 0: a piece the Guard restores"),
    (("scaler", "model"), {**GIVEN, "given": ["data"], "undeclared": {"scaler": "a GradScaler steps it"}},
     "a GradScaler steps it -- pass Guard(..., scaler=scaler)"),
    (("scheduler", "lr", "optimizer"), GIVEN, "LR scheduler's state parted first"),
    (("lr", "optimizer"), {**GIVEN, "given": ["data"]}, "pass your scheduler as Guard(..., scheduler=sched)"),
    (("extra:ema", "model"), GIVEN, "extra 'ema' parted first"),
    (("model", "optimizer"), {**GIVEN, "given": ["data"], "data_given": True,
                              "undeclared": {"data": "the loop iterates a DataLoader (`batches`)"}},
     "data position is not restored: the optimizer parted at step 2 on rank 0 with the same random streams, so "
     "that step read another batch (the loop iterates a DataLoader (`batches`))"),
    (("model", "optimizer"), GIVEN, "given: data, ema, scaler, scheduler): a non-deterministic kernel, or state "
                                    "of your own the Guard is not given (pass it as extra="),
])
def test_the_first_piece_that_parted_is_named_with_its_likely_cause(parts, given, expect):
    case = copy.deepcopy(TRACE)
    case[0][2].update({p: "other" for p in parts})
    assert expect in diagnose(TRACE, case, [0], given)


def test_a_rng_that_parted_beside_a_loader_not_given_names_the_loader():
    case = copy.deepcopy(TRACE)
    case[0][2].update(rng="other", model="x")
    reason = diagnose(TRACE, case, [0], {**GIVEN, "undeclared": {"data": "the loop iterates `batches`"}})
    assert reason.startswith("random streams not restored") and "likely cause: the loop iterates `batches`" in reason


def test_a_mindspore_rank_whose_own_part_parted_is_named_not_its_data_position():
    """MindSpore's trace holds each rank's own part apart from the model: its
    BatchNorm statistics (``buffers``) and MindSpore's streams. A rank that
    resumed with another's statistics is named as such, not blamed on a data
    position the script never gave (the message before)."""
    ref = {1: {3: {"model": "a", "buffers": "b1", "streams": "s1"}, 4: {"model": "c", "buffers": "b2", "streams": "s2"}}}
    case = copy.deepcopy(ref)
    case[1][4].update(model="x", buffers="other")
    reason = diagnose(ref, case, [1], {"data_given": False})
    assert reason.startswith("the buffers (BatchNorm's moving statistics, each rank's own) parted first at step 4 "
                             "on rank 1 with the same random streams"), reason
    case[1][4].update(streams="other")
    assert diagnose(ref, case, [1], {}).startswith("random streams not restored: rank 1's MindSpore's random streams "
                                                   "(its generator and op seeds) differed from step 4")


FINAL = {0: {"steps_completed": 8, "final_state_sha256": "f", "rng": "r", "data": "d", "recoveries": []}}


@pytest.mark.parametrize("exits,launches,recoveries,planned,expect", [
    ([75, 0], {0: [{"start": 0, "last": 5}, {"start": 5, "last": 8}]}, [], (75,), ""),
    # the tester's uce in the optimizer: every rank exited (1), no dying gasp, the relaunch re-trained from step 4
    ([1, 0], {0: [{"start": 0, "last": 6}, {"start": 4, "last": 8}]}, [], (75,),
     "launch 1 exited 1 instead of stopping after a dying gasp (75): rank 1 left step 6: unscale_(); launch 2 "
     "resumed from step 4, but the one before it had reached step 6: 2 steps trained again"),
    ([75, 0], {0: [{"start": 0, "last": 6}, {"start": 4, "last": 8}]}, [], (75,), "2 steps trained again"),
    ([75, 1, 0], {0: [{"start": 0, "last": 5}, {"start": 5, "last": 8}]}, [], (75, 1), ""),  # a failed resume
    ([0], {0: [{"start": 0, "last": 8}]}, [{"strategy": "retry", "lost_steps": 1}], (75,), "1 step lost"),
])
def test_a_case_passes_only_when_every_launch_ended_as_planned(exits, launches, recoveries, planned, expect):
    final = {0: {**FINAL[0], "recoveries": recoveries}}
    verdict = judge(FINAL, final, {0: {}}, {0: {}}, exits, launches=launches, planned_exits=planned,
                    errors=["rank 1 left step 6: unscale_()"] + [""] * 3)
    assert verdict.identical == (not expect) and expect in verdict.reason, verdict


def test_a_launch_that_ended_otherwise_names_a_scaler_found_but_not_given():
    """The tester's script without scaler=: a retry inside the update left
    the scaler's stage set, unscale_ raised on the next step and the launch
    exited 1. The reason names the scaler the Guard found (before: only the
    launch's error)."""
    reference = {0: {**FINAL[0], "undeclared": {"scaler": "a GradScaler steps guard.optimizer but was not given "
                                                           "to the Guard as scaler="}}}
    verdict = judge(reference, FINAL, {0: {}}, {0: {}}, [1, 0],
                    launches={0: [{"start": 0, "last": 6}, {"start": 4, "last": 8}]},
                    errors=["rank 1 left step 5: RuntimeError: unscale_() has already been called", ""])
    assert not verdict.identical and verdict.reason.startswith("launch 1 exited 1"), verdict
    assert verdict.reason.endswith("likely cause: a GradScaler steps guard.optimizer but was not given to the Guard "
                                   "as scaler= -- pass Guard(..., scaler=scaler)"), verdict


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
    assert cases[0].fault == "uce:rank=1,step=5,phase=optimizer", "--quick strikes inside the update too"
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


def test_a_signal_from_outside_lands_during_training_at_a_seeded_step(tmp_path, monkeypatch):
    """The moment is a step of the run's own (the SIGSTOP case's signal once
    landed after a fast run had finished training: it was drawn in seconds
    of the fault-free run's training)."""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(runs, "_worker", lambda directory, rank: victim.pid)
    (tmp_path / "trace").mkdir()
    trace = tmp_path / "trace" / "r1.jsonl"
    trace.write_text('{"start": 0}\n')
    reached = []

    def train():
        for step in range(1, 13):
            time.sleep(0.05)
            with trace.open("a") as f:
                f.write(json.dumps({"step": step, "t": time.time()}) + "\n")
            reached.append(step)

    trainer = threading.Thread(target=train)
    trainer.start()

    class Running:
        def poll(self):
            return None

    try:
        sent = runs._signal_at_random(Running(), tmp_path, signal.SIGTERM, 1, 12, seed=3)
        at = len(reached)
        assert victim.wait(10) == -signal.SIGTERM
    finally:
        victim.kill()
        trainer.join()
    target = random.Random(3).randint(1, 10)
    assert sent["step"] == target and sent["rank"] == 1
    assert target <= at <= target + 1, "sent within the step after the one drawn, while training went on"


@pytest.mark.parametrize("exits,records,expect", [
    ([0], [{"fault": "hang", "rank": 1, "step": 4, "strategy": "recover-in-place",
            "message": "training loop hung: no progress for 2.16 s (limit 2.00 s)"}],
     "it recovered (recover-in-place) from a hang on rank 1 at step 4: training loop hung"),
    ([75, 0], [], "launch 1 of 2 exited 75"),
])
def test_a_fault_free_run_that_needed_a_recovery_is_refused_as_the_reference(tmp_path, monkeypatch, capsys,
                                                                           exits, records, expect):
    """A rehearsal on a busy machine once took a fault-free run whose rank
    1 had been restarted for a hang (a step slower than the 2 s floor) as
    its reference, and compared every case with it. It now stops before any
    case runs (exit 2) and says why."""
    import trainguard.rehearse as rehearsal

    ran = []

    def fake_run(directory, command, **kwargs):
        ran.append(directory.name)
        log = directory / "launch-1.log"
        directory.mkdir(parents=True, exist_ok=True)
        log.write_text("")
        return runs.Run(directory, [runs.Launch(rc, 1.0, log) for rc in exits])

    final = {r: {"steps_completed": 12, "recoveries": records} for r in (0, 1)}
    monkeypatch.setattr(rehearsal, "run", fake_run)
    monkeypatch.setattr(rehearsal, "read_final", lambda directory: final)
    monkeypatch.setattr(rehearsal, "saved_steps", lambda directory: [4, 8])
    assert rehearsal.main(["--dir", str(tmp_path / "runs"), "--quick", "train.py"]) == 2
    assert ran == ["fault-free"], "no case ran"
    err = capsys.readouterr().err
    assert "the fault-free run was not free of faults" in err and expect in err, err
