"""One contract, run against every framework's Guard (in the manner of
torchft's transport tests): each is a :class:`~trainguard.core.rank.RankRuntime`
and offers the loop of :class:`trainguard.core.rank.Guard` with the same
outcomes -- the steps it yields, the body it insists on, a fault raised
where no controller can recover it, the report's keys, a checkpoint it
resumes from to the same state.

The loop's scenarios run in a subprocess per framework
(``workers/rank_contract.py``, world size 1, no controller): MindSpore is
never imported into the test process.

The job's scenarios (:class:`RankJobContract`) need a replica, so they run
two ranks under ``trainguard run`` with its controller
(``workers/rank_job.py``: the same training in each framework, drawing from
every random stream), and include Megatron driven through MindIO's TTP API,
whose flow has no loop: a device memory error is retried in place by the
same processes, and a lost process is dumped and resumed by the same command
again, each ending bit-identical to the fault-free run, random streams
included.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import WORKERS, run_job
from ms_jobs import run_ms

REPORT_KEYS = {"steps_completed", "lost_steps", "pids", "recoveries", "final_state_sha256", "compile_cache"}


def _run(framework: str, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp(f"contract-{framework}")
    out = subprocess.run([sys.executable, str(WORKERS / "rank_contract.py"), framework, str(root)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


class RankContract:
    """The suite; a subclass names its framework in ``framework``."""

    framework = ""

    @pytest.fixture(scope="class")
    @classmethod
    def outcome(cls, tmp_path_factory) -> dict:
        return _run(cls.framework, tmp_path_factory)

    def test_it_is_a_rank_runtime_offering_the_guard_contract(self, outcome):
        assert outcome["loop"]["runtime"] and outcome["loop"]["contract"], outcome["loop"]

    def test_steps_yields_each_completed_step_once_and_counts_them(self, outcome):
        loop = outcome["loop"]
        assert loop["seen"] == [0, 1, 2] and loop["step"] == 3, loop

    def test_the_report_has_the_common_keys_and_a_clean_history(self, outcome):
        loop = outcome["loop"]
        assert REPORT_KEYS <= set(loop["report"]), loop["report"]
        assert loop["lost_steps"] == 0 and loop["recoveries"] == [], loop
        assert loop["pids"] == {"0": [loop["pid"]]}, loop

    def test_a_body_outside_protect_is_refused_with_the_fix(self, outcome):
        # steps() says it after the body; the torch Guard's optimizer already at its update (outside a step)
        unprotected = outcome["unprotected"]
        assert unprotected["type"] == "ConfigError", unprotected
        assert "`with guard.protect():`" in unprotected["message"], unprotected

    def test_without_a_controller_a_fault_is_raised_not_swallowed(self, outcome):
        fault = outcome["fault"]
        assert fault["raised"] == {"type": "RuntimeError", "message": "a fault in the body of step 1"}, fault
        assert fault["step"] == 1, fault  # step 0 completed; step 1 was not counted

    def test_a_new_guard_resumes_from_the_checkpoint_to_the_same_state_and_goes_on(self, outcome):
        resume = outcome["resume"]
        assert resume == {"step": 4, "same_state": True, "seen": [4, 5]}, resume


class TestTorch(RankContract):
    framework = "torch"


@pytest.mark.skipif(importlib.util.find_spec("mindspore") is None, reason="needs MindSpore")
@pytest.mark.timeout(300)
class TestMindSpore(RankContract):
    framework = "mindspore"


JOB_STEPS = 6
UCE = "uce:rank=1,step=2,phase=backward"
CRASH = "crash:rank=1,step=3,phase=backward"


SAVES = {"CONTRACT_SAVE_EVERY": "2"}
SAVE_CRASH = "crash:rank=1,step=4,phase=save"


def _run_job(framework: str, tmp, name: str, fault: str | None, *, rc: int = 0, steps: int = JOB_STEPS,
             env: dict | None = None) -> dict:
    """Launch ``workers/rank_job.py`` on two ranks (again, after a dump:
    the same command); every rank's report by rank."""
    env = {"CONTRACT_FRAMEWORK": framework, **(env or {})}
    if framework == "mindspore":
        job = run_ms(tmp, name, fault=fault, script=WORKERS / "rank_job.py", env=env, steps=steps)
        ranks = job.ranks
    else:
        job = run_job(tmp, name, nproc=2, steps=steps, fault=fault, script=WORKERS / "rank_job.py", env=env)
        ranks = {int(p.suffix[1:]): json.loads(p.read_text()) for p in tmp.glob(f"{name}.json.[0-9]")}
    assert job.rc == rc, job
    assert sorted(ranks) == ([0, 1] if rc == 0 else []), job
    return {"ranks": ranks, "ckpt": job.ckpt, "log": job.log}


class RankJobContract:
    """The two-rank suite; a subclass names its framework in ``framework``
    and whether the Guard's periodic saves are its (``periodic``)."""

    framework = ""
    periodic = True

    @pytest.fixture(scope="class")
    @classmethod
    def jobs(cls, tmp_path_factory) -> dict:
        tmp = tmp_path_factory.mktemp(f"contract-job-{cls.framework}")
        jobs = {"reference": _run_job(cls.framework, tmp, "reference", None),
                "uce": _run_job(cls.framework, tmp, "uce", UCE),
                "dump": _run_job(cls.framework, tmp, "crash", CRASH, rc=75),
                "relaunch": _run_job(cls.framework, tmp, "crash", CRASH)}
        if cls.periodic:  # a shorter run saving every 2 steps, then the whole run from its last save
            jobs["saved"] = _run_job(cls.framework, tmp, "periodic", None, steps=JOB_STEPS - 2,
                                     env={**SAVES, "CONTRACT_SNAPSHOT_EVERY": "1"})  # saves persist snapshots
            jobs["longer"] = _run_job(cls.framework, tmp, "periodic", None, env=SAVES)  # saves write at once
        return jobs

    def test_the_fault_free_run_completes_every_step_with_no_recovery(self, jobs):
        for rank, report in jobs["reference"]["ranks"].items():
            assert report["steps_completed"] == JOB_STEPS and report["lost_steps"] == 0, (rank, report)
            assert report["recoveries"] == [] and report["pids"][str(rank)] == [report["pid"]], (rank, report)

    def test_a_device_memory_error_is_retried_in_place_at_its_step(self, jobs):
        for rank, report in jobs["uce"]["ranks"].items():
            (record,) = report["recoveries"]
            assert (record["fault"], record["rank"], record["step"], record["strategy"]) == ("uce", 1, 2, "retry")
            assert record["detect_s"] is not None and record["recover_s"] is not None, record
            assert report["steps_completed"] == JOB_STEPS and report["lost_steps"] == 0, (rank, report)

    def test_no_process_was_restarted(self, jobs):
        ranks = jobs["uce"]["ranks"]
        for rank, report in ranks.items():
            assert report["pids"] == {str(r): [ranks[r]["pid"]] for r in ranks}, (rank, report["pids"])

    def test_every_rank_ends_bit_identical_to_the_fault_free_run_random_streams_included(self, jobs):
        reference, uce = jobs["reference"]["ranks"], jobs["uce"]["ranks"]
        for rank in reference:
            assert uce[rank]["state_sha256"] == reference[rank]["state_sha256"], (rank, jobs["uce"]["log"][-4000:])
            assert uce[rank]["streams_sha256"] == reference[rank]["streams_sha256"], rank

    def test_a_retry_writes_no_checkpoint(self, jobs):
        ckpt = jobs["uce"]["ckpt"]
        assert not ckpt.exists() or not [p for p in ckpt.iterdir() if not p.name.startswith(".")], \
            sorted(p.name for p in ckpt.iterdir())


    def test_a_lost_rank_is_dumped_at_the_step_every_rank_committed_and_the_relaunch_resumes_there(self, jobs):
        for rank, report in jobs["relaunch"]["ranks"].items():
            assert [(r["rank"], r["strategy"], r["step"]) for r in report["recoveries"]] == [(1, "dump", 3)], \
                (rank, report["recoveries"])
            assert report["steps_completed"] == JOB_STEPS and report["lost_steps"] == 0, (rank, report)
            assert sorted(len(pids) for pids in report["pids"].values()) == [2, 2], report["pids"]  # relaunched

    def test_the_relaunch_ends_bit_identical_on_every_rank_random_streams_included(self, jobs):
        reference, relaunch = jobs["reference"]["ranks"], jobs["relaunch"]["ranks"]
        for rank in reference:
            assert relaunch[rank]["state_sha256"] == reference[rank]["state_sha256"], \
                (rank, jobs["dump"]["log"][-3000:], jobs["relaunch"]["log"][-3000:])
            assert relaunch[rank]["streams_sha256"] == reference[rank]["streams_sha256"], \
                (rank, jobs["dump"]["log"][-3000:], jobs["relaunch"]["log"][-3000:])


    def test_a_periodic_save_holds_every_ranks_streams_and_a_longer_run_resumes_from_it_bit_identical(self, jobs):
        if not self.periodic:
            pytest.skip(self.periodic_skip)
        manifests = {m["step"]: m for m in (json.loads(p.read_text())
                                            for p in jobs["saved"]["ckpt"].rglob("manifest.json"))}
        for step in (JOB_STEPS - 2, JOB_STEPS):  # the shorter run's last save, and the longer run's
            names = {n.rsplit(".", 1)[0] for n in manifests[step]["files"]}
            assert {"own_r0", "own_r1"} <= names, (step, manifests[step]["files"])
        reference, longer = jobs["reference"]["ranks"], jobs["longer"]["ranks"]
        for rank in reference:
            assert f"rank {rank} resumed from storage at step {JOB_STEPS - 2}" in jobs["longer"]["log"], \
                jobs["longer"]["log"][-3000:]
            assert longer[rank]["steps_completed"] == JOB_STEPS, (rank, longer[rank])
            assert longer[rank]["state_sha256"] == reference[rank]["state_sha256"], (rank, jobs["longer"]["log"][-3000:])
            assert longer[rank]["streams_sha256"] == reference[rank]["streams_sha256"], \
                (rank, jobs["longer"]["log"][-3000:])


    def test_a_crash_inside_a_periodic_save_dumps_its_step_and_the_relaunch_is_bit_identical(self, jobs, tmp_path):
        """Rank 1 dies as its periodic save of step 4 begins, while rank 0
        writes its part and waits to learn what the others wrote: the save
        is never finalised, the controller dumps step 4 (every rank
        committed it), and the same command resumes there and ends as the
        fault-free run does, random streams included."""
        if not self.periodic:
            pytest.skip(self.periodic_skip)
        dump = _run_job(self.framework, tmp_path, "save-crash", SAVE_CRASH, rc=75, env=SAVES)
        manifests = {m["step"]: m for m in (json.loads(p.read_text()) for p in dump["ckpt"].rglob("manifest.json"))}
        assert sorted(manifests) == [2, 4], sorted(manifests)
        faults = [r["fault"] for r in manifests[4]["meta"]["history"]["records"]]
        assert faults == ["process_lost"], manifests[4]["meta"]  # the dump's, not the periodic save's
        relaunch = _run_job(self.framework, tmp_path, "save-crash", SAVE_CRASH, env=SAVES)
        reference = jobs["reference"]["ranks"]
        for rank, report in relaunch["ranks"].items():
            assert [(r["rank"], r["strategy"], r["step"]) for r in report["recoveries"]] == [(1, "dump", 4)], \
                (rank, report["recoveries"], dump["log"][-3000:])
            assert report["steps_completed"] == JOB_STEPS and report["lost_steps"] == 0, (rank, report)
            assert report["state_sha256"] == reference[rank]["state_sha256"], (rank, relaunch["log"][-3000:])
            assert report["streams_sha256"] == reference[rank]["streams_sha256"], (rank, relaunch["log"][-3000:])


class TestTorchJob(RankJobContract):
    framework = "torch"


IN_UPDATE = "comm:rank=1,step=2,phase=optimizer"


class TestMegatronTtpJob(RankJobContract):
    framework = "ttp"
    periodic = False
    periodic_skip = ("a Megatron job's periodic save is Megatron-LM's own save_checkpoint, whose rng_state "
                     "test_compat_mindio round-trips")

    def test_a_rank_caught_inside_its_update_takes_the_streams_of_its_updates_start(self, jobs, tmp_path):
        """Rank 1 fails inside its update to step 3 (a communication error
        after its parameters changed), once rank 0 committed step 3: the
        controller locks step 3, which rank 1 never committed, and repairs
        it from rank 0. Every rank draws from each stream before the
        rollback (``draws_after_a_fault``), so only the streams kept when
        rank 1's update began bring it back to the fault-free run."""
        caught = _run_job(self.framework, tmp_path, "in-update", IN_UPDATE)
        reference = jobs["reference"]["ranks"]
        for rank, report in caught["ranks"].items():
            (record,) = report["recoveries"]
            assert (record["fault"], record["rank"], record["step"], record["strategy"]) == ("comm", 1, 3, "retry"), \
                (rank, record)
            assert report["pids"] == {str(r): [caught["ranks"][r]["pid"]] for r in caught["ranks"]}, report["pids"]
            assert report["state_sha256"] == reference[rank]["state_sha256"], (rank, caught["log"][-4000:])
            assert report["streams_sha256"] == reference[rank]["streams_sha256"], (rank, caught["log"][-4000:])
        assert "no random-number state" not in caught["log"], caught["log"][-4000:]
        assert "streams are put back as that update began" in caught["log"], caught["log"][-4000:]


@pytest.mark.skipif(importlib.util.find_spec("mindspore") is None, reason="needs MindSpore")
@pytest.mark.timeout(400)
class TestMindSporeJob(RankJobContract):
    framework = "mindspore"
