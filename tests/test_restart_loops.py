"""No restart loops, and no strategy that can never act: on real jobs under ``trainguard run``.

A bug in the script raises at the same step on every launch. The first launch saves a dying
gasp and exits 75; a relaunch (a scheduler relaunching on 75, or ``--max-restarts``) resumes
from it and fails the same way at the same step: the job stops with exit 1 and says why,
instead of dumping the same step again and asking to be relaunched forever. A strategy the
launch flags cannot serve (``recover-in-place`` without a restart budget) is refused with
exit 2 before any worker starts.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import WORKERS, run_job
from trainguard.core import (ControllerConfig, DataStatus, Fault, FaultKind, RankState, ReplicaGroup, RunStatus,
                             Strategy, decide)
from trainguard.core.config_launch import unrunnable

pytestmark = pytest.mark.timeout(300)

BUG = {"TINY_BUG": "1,4"}  # rank 1 raises ValueError inside step 4, on every launch
SAME = "the same fault (unknown ValueError) failed the launch before at the same step"


# ------------------------------------------------------------------- the pure decisions
FULL = {r: (ReplicaGroup.full(range(2)),) for r in range(2)}


def stopped_at(step: int) -> dict[int, RankState]:
    return {r: RankState(rank=r, step=step, data=DataStatus.UPDATED, run=RunStatus.STOPPED, stopped=True)
            for r in range(2)}


def bug(rank: int = 1, error: str = "ValueError") -> Fault:
    return Fault(kind=FaultKind.UNKNOWN, rank=rank, message=f"{error}: a bug in the script (rank {rank})")


@pytest.mark.parametrize("faults, previous, expected", [
    ([bug(1)], (4, "unknown ValueError"), Strategy.EXIT),      # the same class at the step it resumed from
    ([bug(0)], (4, "unknown ValueError"), Strategy.EXIT),      # on another rank: still the same class
    ([Fault(kind=FaultKind.COMM, rank=0, message="Connection reset by peer"), bug(1)],
     (4, "unknown ValueError"), Strategy.EXIT),                 # a peer's broken collective is the symptom
    ([bug(1, "KeyError")], (4, "unknown ValueError"), Strategy.DUMP),   # another error: dumped again
    ([bug(1)], (3, "unknown ValueError"), Strategy.DUMP),      # progress since the last dump
    ([bug(1)], None, Strategy.DUMP),                           # the launch resumed from no dying gasp
])
def test_a_dump_is_refused_only_for_the_same_fault_at_the_step_the_job_resumed_from(faults, previous, expected):
    config = ControllerConfig(strategies="dump,exit")
    plan, reason = decide(stopped_at(4), faults, config, 0.0, layout=FULL, previous=previous)
    assert plan.strategy is expected, reason
    assert plan.final is (expected is Strategy.EXIT)
    if expected is Strategy.EXIT:
        assert "failed the launch before at the same step" in reason and "step 4" in reason


def test_the_fault_class_is_the_same_on_every_rank():
    assert bug(0).cause == bug(1).cause == "unknown ValueError"
    assert Fault(kind=FaultKind.PROCESS_LOST, rank=3, message="exit code -9 (SIGKILL)").cause == "process_lost"


@pytest.mark.parametrize("strategies, max_restarts, spare, refused", [
    ("retry,dump,exit", 0, 0, None),
    ("recover-in-place,dump", 0, 0, "--max-restarts N"),
    ("recover-in-place,dump", 1, 0, None),
    ("recover,dump", 0, 1, "--max-restarts N"),
    ("recover,dump", 2, 0, "--spare-slots N"),
    ("recover,dump", 2, 1, None),
])
def test_a_strategy_the_launch_flags_cannot_serve_is_named(strategies, max_restarts, spare, refused):
    from trainguard.core.config import parse_strategies

    why = unrunnable(parse_strategies(strategies), max_restarts=max_restarts, spare_slots=spare)
    assert (why is None) if refused is None else (refused in why), why


# ------------------------------------------------------------------- real jobs
def relaunch_on_75(tmp_path, name: str, *, limit: int = 4, extra_args: list[str] | None = None):
    """What a scheduler does: launch, and launch again while the job exits 75."""
    jobs, ckpt = [], tmp_path / f"{name}-ckpt"
    while len(jobs) < limit:
        jobs.append(run_job(tmp_path, f"{name}{len(jobs)}", nproc=2, steps=8, env=BUG, strategies="dump,exit",
                            ckpt=ckpt, extra_args=extra_args))
        if jobs[-1].rc != 75:
            break
    return jobs


def test_a_scheduler_relaunching_on_75_converges_when_the_script_fails_the_same_way(tmp_path):
    jobs = relaunch_on_75(tmp_path, "loop")
    assert [j.rc for j in jobs] == [75, 1], [str(j) for j in jobs]
    first, second = jobs
    assert "saved a dying-gasp checkpoint at step 4" in first.log
    assert SAME in second.log and "trainguard: the job stopped" in second.log, second
    assert "relaunch the same command to resume" not in second.log, second
    # Nothing newer was written: the dying gasp of step 4 is still the newest checkpoint.
    assert (second.ckpt / "latest_step.txt").read_text().strip() == "4"


@pytest.mark.slow  # CI: the same under the patched torchrun (tests/test_patch.py, the same agent)
def test_max_restarts_is_not_spent_replaying_the_same_fault(tmp_path):
    job = run_job(tmp_path, "budget", nproc=2, steps=8, env=BUG, strategies="dump,exit",
                  extra_args=["--max-restarts", "3"])
    assert job.rc == 1, job
    # The first round dumped, torch's agent restarted the group once, the second round stopped.
    assert job.log.count("rank 1 left step 4") == 2, job
    assert SAME in job.log, job


def launch(tmp_path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2", *args,
                           str(WORKERS / "tiny_train.py"), "4", str(tmp_path / "r.json"), str(tmp_path / "ckpt")],
                          capture_output=True, text=True, env=full, cwd=tmp_path, timeout=120)


def test_a_strategy_the_flags_cannot_serve_is_refused_before_any_worker_starts(tmp_path):
    # No restart budget given explicitly (without the flag trainguard run's default budget serves it)
    out = launch(tmp_path, "--max-restarts", "0", env={"TRAINGUARD_STRATEGIES": "recover-in-place,dump,exit"})
    assert out.returncode == 2, out.stderr
    assert "--max-restarts N" in out.stderr and "TRAINGUARD_STRATEGIES" in out.stderr, out.stderr
    assert "registered" not in out.stderr and not (tmp_path / "ckpt").exists(), out.stderr


def refusal(tmp_path, monkeypatch, *args: str, strategies: str | None = None) -> str:
    """The launcher's refusal of these flags, in process (nothing starts before it)."""
    from trainguard.core import TrainguardError
    from trainguard.launcher.run import launch as launch_in_process

    for name in [k for k in __import__("os").environ if k.startswith("TRAINGUARD_")]:
        monkeypatch.delenv(name)
    if strategies:
        monkeypatch.setenv("TRAINGUARD_STRATEGIES", strategies)
    with pytest.raises(TrainguardError) as refused:
        launch_in_process(["--nproc-per-node", "2", *args, str(WORKERS / "tiny_train.py"), "4",
                           str(tmp_path / "r.json"), str(tmp_path / "ckpt")])
    return str(refused.value)


def test_recover_without_spare_slots_is_refused(tmp_path, monkeypatch):
    assert "--spare-slots N" in refusal(tmp_path, monkeypatch, "--max-restarts", "2", strategies="recover,dump")


def test_a_node_range_is_refused_saying_what_to_give(tmp_path, monkeypatch):
    assert "takes every torchrun flag but a node range; give a fixed count such as --nnodes 2" in \
        refusal(tmp_path, monkeypatch, "--nnodes", "1:2")
