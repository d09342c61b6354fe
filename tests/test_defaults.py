"""The defaults of ``trainguard run``: a restart budget and strategies that
restart a lost process in place, a dump only when that cannot work, and
after a dump the group restarted by the launcher itself (warm standby
processes, the state from the node's snapshots in memory) -- one launch,
bit-identical. A dump caused by the script's own exception is not
restarted (the restart would meet the same exception: a loop).

The jobs run the shape a user writes first -- no ``--strategies``, no
``--max-restarts`` -- on a model with dropout fed by a ``DistributedSampler``.
"""

from __future__ import annotations

import json

import pytest

from conftest import WORKERS, run_job
from trainguard.core import Strategy
from trainguard.core.annotations import resolve_strategies
from trainguard.core.checkpoint import CheckpointStore

pytestmark = pytest.mark.timeout(400)

LM = WORKERS / "lm_train.py"
STEPS = 8
SNAPSHOTS = {"LM_SNAPSHOT_EVERY": "1"}


def _ranks(tmp, name: str) -> dict:
    return {0: json.loads((tmp / f"{name}.json").read_text()),
            1: json.loads((tmp / f"{name}.json.rank1").read_text())}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fault-free run (snapshots in memory every step: they change nothing in the training)."""
    tmp = tmp_path_factory.mktemp("reference")
    ref = run_job(tmp, "ref", nproc=2, steps=STEPS, script=LM, env=SNAPSHOTS, max_restarts=None)
    assert ref.rc == 0, ref
    return ref, _ranks(tmp, "ref")


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


def test_a_lost_process_under_the_defaults_is_restarted_alone_and_ends_bit_identical(tmp_path, reference):
    ref, theirs = reference
    assert "restart budget 10 (default; --max-restarts N to change)" in ref.log, ref
    assert "strategies retry,recover-in-place,dump,exit (from default)" in ref.log, ref
    job = run_job(tmp_path, "crash", nproc=2, steps=STEPS, script=LM, fault="crash:rank=1,step=4,phase=backward",
                  max_restarts=None)
    assert job.rc == 0, job
    (record,) = job.report["recoveries"]
    assert (record["fault"], record["rank"], record["strategy"], record["lost_steps"]) == (
        "process_lost", 1, "recover-in-place", 0), record
    assert len(job.report["pids"]["0"]) == 1 and len(job.report["pids"]["1"]) == 2, job.report["pids"]
    ours = _ranks(tmp_path, "crash")
    for rank in (0, 1):  # the restarted rank's random streams and data position went on as if nothing happened
        for key in ("final_state_sha256", "rng_sha256", "data"):
            assert ours[rank][key] == theirs[rank][key], (rank, key)


def test_after_a_dump_the_launcher_restarts_the_group_warm_from_memory_bit_identical(tmp_path, reference):
    # dump is the only strategy: the lost rank cannot be restarted alone, the group is.
    job = run_job(tmp_path, "crash", nproc=2, steps=STEPS, script=LM, env=SNAPSHOTS, strategies="dump,exit",
                  fault="crash:rank=1,step=4,phase=backward", max_restarts=None)
    assert job.rc == 0, job  # one launch: no relaunch from outside
    assert "restarted ranks [0, 1] in warm standby processes" in job.log, job
    assert job.log.count("resumed from memory at step 4") == 2, job
    (record,) = job.report["recoveries"]
    assert (record["fault"], record["rank"], record["strategy"], record["step"], record["lost_steps"]) == (
        "process_lost", 1, "dump", 4, 0), record
    ours, theirs = _ranks(tmp_path, "crash"), reference[1]
    for rank in (0, 1):  # model, optimizer, random streams and data position as in the fault-free run
        assert ours[rank]["final_state_sha256"] == theirs[rank]["final_state_sha256"]
        assert (ours[rank]["rng_sha256"], ours[rank]["data"]) == (theirs[rank]["rng_sha256"], theirs[rank]["data"])


def test_a_dump_after_the_scripts_own_exception_is_not_restarted_in_a_loop(tmp_path):
    job = run_job(tmp_path, "bug", nproc=2, steps=STEPS, script=LM, env={"LM_RAISE_AT": "1:4"}, max_restarts=None)
    assert job.rc == 75, job
    assert "not restarting the group: the dump followed an exception of the script itself" in job.log, job
    assert "a bug in the script at step 4" in job.log, job
    assert job.log.count("all 2 ranks registered") == 1, job  # one round: the group was not started again


def test_a_process_lost_during_a_periodic_save_gives_that_save_up_at_once_and_training_goes_on(tmp_path, reference):
    """Rank 1 dies as the save of step 3 begins, before it wrote its own
    part of it (random streams, data position); its replacement never
    writes it. The survivor that finalises gives the save up when the
    recovery ends instead of waiting the save timeout for it (and training
    for a snapshot slot meanwhile): the job is bound below that timeout."""
    ref, theirs = reference
    env = {**SNAPSHOTS, "TRAINGUARD_SAVE_TIMEOUT_S": "120"}
    job = run_job(tmp_path, "save", nproc=2, steps=STEPS, script=LM, env=env, save_every=3,
                  fault="crash:rank=1,step=3,phase=save", max_restarts=None, timeout=100)
    assert job.rc == 0, job
    (record,) = job.report["recoveries"]
    assert (record["fault"], record["rank"], record["strategy"], record["step"], record["lost_steps"]) == (
        "process_lost", 1, "recover-in-place", 3, 0), record
    assert len(job.report["pids"]["0"]) == 1 and len(job.report["pids"]["1"]) == 2, job.report["pids"]
    assert job.log.count("rank 0: the checkpoint of step 3 is given up: own_r1.bin will never be written (rank 1 "
                         "died before writing it and was restarted)") == 1, job
    assert "never arrived" not in job.log and "was not saved" not in job.log, job  # no wait, no store failure
    # Nothing of step 3 is left, and the next periodic save is complete: every rank's own part in it.
    assert sorted(p.name for p in job.ckpt.iterdir() if p.name.startswith("step_")) == ["step_00000006"], job
    saved = CheckpointStore(job.ckpt).latest()
    assert saved is not None and saved.step == 6, job
    assert {"own_r0.bin", "own_r1.bin"} <= set(saved.manifest["files"]), saved.manifest
    ours = _ranks(tmp_path, "save")
    for rank in (0, 1):
        for key in ("final_state_sha256", "rng_sha256", "data"):
            assert ours[rank][key] == theirs[rank][key], (rank, key)
