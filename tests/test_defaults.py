"""The defaults of ``trainguard run``: a restart budget and strategies that
restart a lost process in place, a dump only when that cannot work.

The job test runs the shape a user writes first -- no ``--strategies``, no
``--max-restarts`` -- on a model with dropout fed by a ``DistributedSampler``.
"""

from __future__ import annotations

import json

import pytest

from conftest import WORKERS, run_job
from trainguard.core import Strategy
from trainguard.core.annotations import resolve_strategies

pytestmark = pytest.mark.timeout(400)

LM = WORKERS / "lm_train.py"
STEPS = 8


def test_without_flags_a_run_has_a_restart_budget_and_restarts_a_lost_process_in_place():
    from trainguard.core.config import DEFAULT_MAX_RESTARTS, launch_defaults

    budget, strategies = launch_defaults(None)
    assert budget == DEFAULT_MAX_RESTARTS > 0
    assert strategies == (Strategy.RETRY, Strategy.RECOVER_IN_PLACE, Strategy.DUMP, Strategy.EXIT)


def test_max_restarts_0_leaves_recover_in_place_out_of_the_default_strategies():
    from trainguard.core.config import launch_defaults

    assert launch_defaults(0) == (0, (Strategy.RETRY, Strategy.DUMP, Strategy.EXIT))
    assert launch_defaults(3)[0] == 3


def test_strategies_given_anywhere_win_over_the_default():
    from trainguard.core.config import launch_defaults

    default = launch_defaults(None)[1]
    assert resolve_strategies(None, {}, default=default).strategies == default
    assert resolve_strategies("dump,exit", {}, default=default).strategies == (Strategy.DUMP, Strategy.EXIT)
    env = {"TRAINGUARD_STRATEGIES": "retry,exit"}
    assert resolve_strategies(None, env, default=default).strategies == (Strategy.RETRY, Strategy.EXIT)


def test_a_lost_process_under_the_defaults_is_restarted_alone_and_ends_bit_identical(tmp_path):
    ref = run_job(tmp_path, "ref", nproc=2, steps=STEPS, script=LM, max_restarts=None)
    assert ref.rc == 0, ref
    assert "restart budget 10 (default; --max-restarts N to change)" in ref.log, ref
    assert "strategies retry,recover-in-place,dump,exit (from default)" in ref.log, ref
    job = run_job(tmp_path, "crash", nproc=2, steps=STEPS, script=LM, fault="crash:rank=1,step=4,phase=backward",
                  max_restarts=None)
    assert job.rc == 0, job
    (record,) = job.report["recoveries"]
    assert (record["fault"], record["rank"], record["strategy"], record["lost_steps"]) == (
        "process_lost", 1, "recover-in-place", 0), record
    assert len(job.report["pids"]["0"]) == 1 and len(job.report["pids"]["1"]) == 2, job.report["pids"]
    assert job.report["final_state_sha256"] == ref.report["final_state_sha256"]
    for rank in (1,):  # the restarted rank's random streams and data position went on as if nothing happened
        mine = json.loads((tmp_path / f"crash.json.rank{rank}").read_text())
        theirs = json.loads((tmp_path / f"ref.json.rank{rank}").read_text())
        assert (mine["rng_sha256"], mine["data"]) == (theirs["rng_sha256"], theirs["data"])
