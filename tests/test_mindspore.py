"""The MindSpore adapter on real msrun jobs (2 workers, CPU): a device memory
error retried in place, a killed worker dumped and resumed, the same through
plain ``msrun`` after ``adapters-patch msrun``, and what is refused.

MindSpore is never imported into the test process: every job is a
subprocess (``trainguard run --framework mindspore`` or ``msrun``)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import WORKERS
from ms_jobs import STEPS, MsJob, run_ms
from trainguard.core import MINDSPORE
from trainguard.launcher.msrun import strategies_from_env

DUMP_3 = MINDSPORE.dirname(3)  # the dying gasp of step 3
needs_mindspore = pytest.mark.skipif(importlib.util.find_spec("mindspore") is None, reason="needs MindSpore")


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> MsJob:
    job = run_ms(tmp_path_factory.mktemp("ms-baseline"), "baseline", strategies=None)
    assert job.rc == 0 and job.report is not None, job
    assert job.report["steps_completed"] == STEPS and job.report["recoveries"] == [], job
    return job


@needs_mindspore
@pytest.mark.timeout(300)
def test_profiling_markers_leave_the_numbers_alone(tmp_path, baseline):
    prof = tmp_path / "prof"
    prof.mkdir()
    (prof / "profilingSwitch").write_text('{"CommunicationOperator":"on","Step":"on","SaveCheckpoint":"on",'
                                          '"FP":"on","DataLoader":"on"}')
    job = run_ms(tmp_path, "prof", strategies=None, env={"TRAINGUARD_PROFILING_DIR": str(prof),
                                                          "TRAINGUARD_JOB_ID": "ms"})
    assert job.rc == 0 and job.report["final_state_sha256"] == baseline.report["final_state_sha256"], job
    for rank in (0, 1):
        recs = [json.loads(line) for p in (prof / "ms" / str(rank)).iterdir() if p.name.isdigit()
                for line in p.read_text().splitlines()]
        assert {r["name"] for r in recs} == {"Step", "FP", "DataLoader", "Communication"}, rank
        assert sorted({r["step"] for r in recs if r["name"] == "Step"}) == list(range(STEPS))
        assert {r["op"] for r in recs if r["name"] == "Communication"} >= {"vote", "gradient allreduce"}
        groups = json.loads((prof / "ms" / str(rank) / "parallel_group.json").read_text())
        assert list(groups.values())[0]["global_ranks"] == [0, 1]
    out = subprocess.run([sys.executable, "-m", "trainguard.cli", "slow-nodes", str(prof), "--json"],
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["ranks"] == [0, 1]


@needs_mindspore
@pytest.mark.timeout(300)
# The repair goes through shared memory (same machine), and once through MindSpore's Broadcast.
# reduce: rank 1 fails after the vote passed, while rank 0 waits in the gradient all-reduce; it joins
# that all-reduce with a health flag of 0 (before: rank 0 was left to the collective timeout, a dump).
# CI: the update, and the reduce with the Broadcast repair (the contract's job tier retries a
# backward fault); the rest with -m slow.
@pytest.mark.parametrize("rank,phase,shm", [pytest.param(1, "forward", "1", marks=pytest.mark.slow),
                                            pytest.param(0, "backward", "1", marks=pytest.mark.slow),
                                            pytest.param(1, "backward", "0", marks=pytest.mark.slow),
                                            pytest.param(1, "reduce", "1", marks=pytest.mark.slow),
                                            (1, "optimizer", "1"), (1, "reduce", "0")])
def test_retry_after_a_device_memory_error_is_bit_identical_and_keeps_every_pid(tmp_path, baseline, rank, phase, shm):
    job = run_ms(tmp_path, "uce", fault=f"uce:rank={rank},step=3,phase={phase}", env={"TRAINGUARD_SHM_REPAIR": shm})
    assert job.rc == 0 and job.report is not None, job
    r = job.report
    # Every rank's state, its own BatchNorm statistics included (a repaired rank sets its own back over the
    # replica's it was repaired from).
    assert {k: v["final_state_sha256"] for k, v in job.ranks.items()} == \
        {k: v["final_state_sha256"] for k, v in baseline.ranks.items()} and len(job.ranks) == 2, job
    # The retried step drew the random numbers the abandoned one drew: every rank's streams end as without a fault.
    assert {k: v["rng_sha256"] for k, v in job.ranks.items()} == \
        {k: v["rng_sha256"] for k, v in baseline.ranks.items()} and len(job.ranks) == 2, job
    assert r["steps_completed"] == STEPS and r["lost_steps"] == 0, job
    assert [rec["strategy"] for rec in r["recoveries"]] == ["retry"], job
    assert r["recoveries"][0]["fault"] == "uce" and r["recoveries"][0]["rank"] == rank, job
    assert all(len(pids) == 1 for pids in r["pids"].values()), job  # no process was restarted
    # One WARNING line, the controller's, with no MindSpore call-stack banner in it (as for torch).
    (loud,) = job.loud()
    assert " WARNING " in loud and "-> retry: training resumed at step" in loud and "----" not in loud, job.loud()
    # The update after the fault is the one every replica skipped: step 3 (forward, backward, reduce) or 4.
    assert r["recoveries"][0]["step"] == (4 if phase == "optimizer" else 3), job
    assert not list(Path("/dev/shm").glob(f"**/trainguard-*-{r['pids'][str(1 - rank)][0]}-step*.state")), \
        "the repair's shared-memory file is removed (in /dev/shm or a node's snapshot directory)"


@needs_mindspore
@pytest.mark.timeout(400)
# backward: rank 0 waits in the vote; reduce: the vote passed and rank 0 waits in
# the gradient all-reduce, so its update was agreed but is never queued: the dump is of step 3.
@pytest.mark.parametrize("phase", [pytest.param("backward", marks=pytest.mark.slow), "reduce"])
def test_a_killed_worker_is_dumped_in_tft_layout_and_the_relaunch_is_bit_identical(tmp_path, baseline, phase):
    ckpt = tmp_path / "ckpt"
    fault = f"crash:rank=1,step=3,phase={phase}"
    first = run_ms(tmp_path, "crash", fault=fault, ckpt=ckpt)
    assert first.rc == 75, first
    assert "dying-gasp checkpoint at step 3" in first.log, first
    # One WARNING line; rank 0's failed all-reduce in it without MindSpore's call-stack banner.
    (loud,) = first.loud()
    assert "rank 0: comm: " in loud and "-> dump: job exiting" in loud and "----" not in loud, first.loud()
    entries = sorted(p.name for p in ckpt.iterdir() if not p.name.startswith("."))
    assert entries == ["latest_tft_step.txt", DUMP_3], entries  # one, finalised
    shard = ckpt / DUMP_3 / "rank_0" / "ttp_rank_0-1_3.ckpt"  # epoch 1, its step 3
    assert shard.is_file(), first
    keys = subprocess.run([sys.executable, "-c", "import sys, mindspore as ms; d = ms.load_checkpoint(sys.argv[1]); "
                           "print(int(d['step_num'].asnumpy()), int(d['epoch_num'].asnumpy()), "
                           "int(d['global_step'].asnumpy()[0]))", str(shard)],
                          capture_output=True, text=True, timeout=120)
    assert keys.stdout.split() == ["3", "1", "3"], keys.stdout + keys.stderr

    again = run_ms(tmp_path, "crash", fault=fault, ckpt=ckpt)
    assert again.rc == 0 and again.report is not None, again
    r = again.report
    assert r["final_state_sha256"] == baseline.report["final_state_sha256"], again
    assert r["steps_completed"] == STEPS and r["lost_steps"] == 0, again
    assert [(x["fault"], x["strategy"], x["step"]) for x in r["recoveries"]] == [("process_lost", "dump", 3)], again
    assert all(len(pids) == 2 for pids in r["pids"].values()), again  # two launches
    # The dump holds rank 0's parameters; rank 1's own part carries the BatchNorm statistics its own batches
    # moved, so every rank's state is the fault-free run's (before: rank 1 went on with rank 0's).
    assert {k: v["final_state_sha256"] for k, v in again.ranks.items()} == \
        {k: v["final_state_sha256"] for k, v in baseline.ranks.items()} and len(again.ranks) == 2, again
    assert {k: v["rng_sha256"] for k, v in again.ranks.items()} == \
        {k: v["rng_sha256"] for k, v in baseline.ranks.items()}, again
    assert "BatchNorm statistics" not in again.log, again


@needs_mindspore
@pytest.mark.timeout(400)
def test_a_worker_killed_while_it_resumes_ends_the_job_and_the_next_relaunch_is_bit_identical(tmp_path, baseline):
    """The fault matrix's MindSpore case of a fault while a rank resumes: the
    relaunch of a dump loses rank 1 while it loads; rank 0 is not left in
    its all-gather until the collective timeout, nothing newer is written,
    and the relaunch after that finishes in the fault-free state."""
    ckpt, fault = tmp_path / "ckpt", "crash:rank=1,step=3,phase=forward;crash:rank=1,step=3,phase=resume"
    first = run_ms(tmp_path, "first", fault=fault, ckpt=ckpt)
    assert first.rc == 75, first
    dump = ckpt / DUMP_3 / "manifest.json"
    before = dump.read_bytes()
    second = run_ms(tmp_path, "second", fault=fault, ckpt=ckpt)
    assert second.rc not in (0, 75), second
    assert "rank 1 failed before every rank had registered" in second.log, second
    assert "RingAllGather" not in second.log, "rank 0 was ended, not left to its collective's timeout"
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == \
        ["latest_tft_step.txt", DUMP_3] and dump.read_bytes() == before
    third = run_ms(tmp_path, "third", fault=fault, ckpt=ckpt)
    assert third.rc == 0 and third.report is not None, third
    assert third.report["final_state_sha256"] == baseline.report["final_state_sha256"], third
    assert third.report["lost_steps"] == 0, third


@needs_mindspore
@pytest.mark.timeout(400)
def test_with_snapshots_the_dump_writes_the_snapshot_and_the_relaunch_is_bit_identical(tmp_path, baseline):
    ckpt, fault = tmp_path / "ckpt", "crash:rank=1,step=3,phase=backward"
    env = {"TRAIN_SNAPSHOT_EVERY": "1"}
    first = run_ms(tmp_path, "snap", fault=fault, ckpt=ckpt, env=env)
    assert first.rc == 75, first
    assert "the save of step 3 reuses its snapshot in memory" in first.log, first
    shard = ckpt / DUMP_3 / "rank_0" / "ttp_rank_0-1_3.safetensors"
    assert shard.is_file(), first
    # MindSpore's own loader reads the persisted snapshot.
    keys = subprocess.run([sys.executable, "-c", "import sys, json, mindspore as ms; "
                           "d = ms.load_checkpoint(sys.argv[1], format='safetensors'); print(json.dumps(sorted(d)))",
                           str(shard)], capture_output=True, text=True, timeout=120)
    assert keys.returncode == 0, keys.stdout + keys.stderr
    from safetensors import safe_open
    with safe_open(str(shard), "np") as f:
        saved = sorted(f.keys())
    assert json.loads(keys.stdout.strip().splitlines()[-1]) == saved and any("moment" in k for k in saved), keys.stdout

    again = run_ms(tmp_path, "snap", fault=fault, ckpt=ckpt, env=env)
    assert again.rc == 0 and again.report is not None, again
    r = again.report
    assert r["final_state_sha256"] == baseline.report["final_state_sha256"], again
    assert r["snapshots"]["resumed_from"] == {"step": 3, "source": "storage"}, again
    assert r["snapshots"]["errors"] == [] and r["snapshots"]["taken"] >= 3, again
    assert [(x["fault"], x["strategy"], x["step"]) for x in r["recoveries"]] == [("process_lost", "dump", 3)], again


@needs_mindspore
@pytest.mark.timeout(400)
def test_shared_snapshots_when_the_holder_dies_its_replica_dumps_the_whole_state(tmp_path, baseline):
    """snapshot_shared: rank 1's snapshots hold only a header naming rank 0's.
    Rank 0 is killed, so rank 1 writes the dump from its own parameters; the
    relaunch loads it from storage and ends bit-identical."""
    ckpt, fault = tmp_path / "ckpt", "crash:rank=0,step=3,phase=backward"
    env = {"TRAIN_SNAPSHOT_EVERY": "1", "TRAIN_SNAPSHOT_SHARED": "1"}
    first = run_ms(tmp_path, "shared", fault=fault, ckpt=ckpt, env=env)
    assert first.rc == 75, first
    shards = sorted((ckpt / DUMP_3).glob("rank_*/*.safetensors"))
    assert [p.parent.name for p in shards] == ["rank_1"], first
    from safetensors import safe_open
    with safe_open(str(shards[0]), "np") as f:  # the parameters and the optimizer's moments, not a header
        assert any("moment" in k for k in f.keys()) and "fc1.weight" in f.keys(), first

    again = run_ms(tmp_path, "shared", fault=fault, ckpt=ckpt, env=env)
    assert again.rc == 0 and again.report is not None, again
    assert again.report["final_state_sha256"] == baseline.report["final_state_sha256"], again
    assert again.report["snapshots"]["resumed_from"] == {"step": 3, "source": "storage"}, again
    shared = {rank: r["snapshots"]["shared"] for rank, r in again.ranks.items()}
    assert shared[0] == {"holder": 0, "own_part_taken": 0}, again
    assert shared[1]["holder"] == 0 and shared[1]["own_part_taken"] >= STEPS - 3 - 1, again  # its first is whole


@needs_mindspore
@pytest.mark.timeout(120)
def test_shared_snapshots_a_replica_loads_its_holders_parameters_of_a_step_both_hold():
    """The Guard's load with shared snapshots (msrun removes a job's
    snapshots when it ends, so no relaunch finds them): a header naming rank
    0's snapshot, the step rank 0 lacks skipped (tests/workers/ms_shared_load.py)."""
    out = subprocess.run([sys.executable, str(WORKERS / "ms_shared_load.py")], capture_output=True, text=True,
                         timeout=100)
    assert out.returncode == 0, out.stdout + out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["step"] == 2 and got["equal"] and got["loads"] == 1, got
    assert got["resumed_from"] == {"step": 2, "source": "memory", "state_of": "r0.s1"}, got
    assert got["own_bytes"] < 8192, got  # a header, no parameters
    assert "rank 0's snapshot of that step is not sealed" in out.stderr, out.stderr


@needs_mindspore
@pytest.mark.timeout(120)
def test_a_corrupt_snapshot_is_detected_and_the_newest_sound_one_is_loaded_without_touching_the_parameters():
    """As above, with a byte of the holder's snapshot of step 2 flipped:
    the load says so, resumes from step 1, and the parameters are set once,
    to step 1's."""
    out = subprocess.run([sys.executable, str(WORKERS / "ms_shared_load.py"), "corrupt"], capture_output=True,
                         text=True, timeout=100)
    assert out.returncode == 0, out.stdout + out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["step"] == 1 and got["loads"] == 1 and got["equal"], got
    assert got["resumed_from"]["source"] == "memory", got
    assert "not resuming from memory at step 2" in out.stderr and "fails its checksum" in out.stderr, out.stderr


@needs_mindspore
@pytest.mark.timeout(120)
def test_graph_mode_is_refused_for_a_hand_written_loop_with_the_reason(tmp_path):
    script = tmp_path / "graph.py"
    script.write_text("import mindspore as ms\nfrom mindspore import nn\nfrom trainguard.mindspore import Guard\n"
                      "ms.set_context(mode=ms.GRAPH_MODE)\nnet = nn.Dense(2, 2)\n"
                      "Guard(net, nn.SGD(net.trainable_params(), 0.1))\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "ConfigError: trainguard's MindSpore Guard needs PyNative mode" in proc.stderr, proc.stderr
    assert "in graph mode it protects Model.train with TrainFaultTolerance" in proc.stderr, proc.stderr


@pytest.mark.parametrize("env,expected", [
    ({"MS_ENABLE_TFT": "{TTP:1,UCE:1,ARF:1}"}, "retry,recover-in-place,dump,exit"),
    ({"MS_ENABLE_TFT": "{UCE:1 TTP:1}"}, "retry,dump,exit"),  # the spelling in MindSpore's own guide
    ({"MS_ENABLE_TFT": "{UCE:0, TTP:1}"}, "dump,exit"),
    ({"MS_ENABLE_TFT": "{ARF:1}"}, "recover-in-place,dump,exit"),  # ARF turns TTP on, as in MindSpore
    ({"MS_ENABLE_TFT": "{TTP:0}"}, None),
    ({}, None),
    ({"MS_ENABLE_TFT": "{UCE:1}", "TRAINGUARD_STRATEGIES": "dump,exit"}, "dump,exit"),  # trainguard's own wins
])
def test_strategies_follow_ms_enable_tft(env, expected):
    assert strategies_from_env(env) == expected


@pytest.fixture
def patched_msrun():
    """The real msrun, patched for one test and restored byte for byte."""
    from trainguard.patch import cli, core
    from trainguard.patch.msrun import TARGET

    path = core.locate(TARGET, sys.executable).path
    original = path.read_bytes()
    assert core.state(original) == "not patched", f"{path} was patched before the test"
    assert cli.main(["msrun"]) == 0
    try:
        yield path
    finally:
        if path.read_bytes() != original:
            cli.main(["msrun", "--revert"])
        assert path.read_bytes() == original, f"{path} was left modified"
        assert not core.backup_path(path).exists()


@needs_mindspore
@pytest.mark.timeout(300)
def test_plain_msrun_after_the_patch_retries_with_ms_enable_tft(tmp_path, baseline, patched_msrun):
    job = run_ms(tmp_path, "msrun", fault="uce:rank=1,step=3,phase=backward", strategies=None, launcher="msrun",
                 env={"MS_ENABLE_TFT": "{UCE:1,TTP:1}"})
    assert job.rc == 0 and job.report is not None, job
    assert "strategies retry,dump,exit" in job.log, job  # trainguard took msrun's workers over
    assert [(x["fault"], x["strategy"]) for x in job.report["recoveries"]] == [("uce", "retry")], job
    assert job.report["final_state_sha256"] == baseline.report["final_state_sha256"], job
    assert all(len(pids) == 1 for pids in job.report["pids"].values()), job

    plain = run_ms(tmp_path, "plain", strategies=None, launcher="msrun")  # no MS_ENABLE_TFT: msrun as before
    assert plain.rc == 0 and plain.report is not None, plain
    assert "trainguard controls msrun" not in plain.log and "no trainguard controller" in plain.log, plain
    (hint,) = [line for line in plain.loud() if "no trainguard controller" in line]
    assert "MS_ENABLE_TFT" in hint, hint  # what the patched msrun was missing
    assert plain.report["final_state_sha256"] == baseline.report["final_state_sha256"], plain


@needs_mindspore
@pytest.mark.timeout(300)
@pytest.mark.xfail(run=False, reason="MindSpore's CPU collectives cannot take a restarted worker back "
                                     "(bench/probe_mindspore_rejoin.py): recover-in-place falls back to dump")
def test_a_killed_worker_is_restarted_alone_with_recover_in_place(tmp_path, baseline):
    job = run_ms(tmp_path, "rip", fault="crash:rank=1,step=3,phase=backward", strategies="recover-in-place,exit")
    assert job.rc == 0 and job.report is not None, job
    assert [(x["fault"], x["strategy"]) for x in job.report["recoveries"]] == [("process_lost", "recover-in-place")]
    assert len(job.report["pids"]["0"]) == 1 and len(job.report["pids"]["1"]) == 2, job
    assert job.report["final_state_sha256"] == baseline.report["final_state_sha256"], job


@needs_mindspore
@pytest.mark.timeout(300)
def test_a_frozen_worker_is_killed_by_the_msrun_plugin_and_the_job_dumps(tmp_path):
    job = run_ms(tmp_path, "frozen", fault="stop:rank=1,step=3,phase=backward")
    assert job.rc == 75, job
    assert "found stopped (state T)" in job.log and "killed by its agent" in job.log, job
    assert "dying-gasp checkpoint at step 3" in job.log, job
    assert (job.ckpt / DUMP_3 / "manifest.json").is_file(), job


@needs_mindspore
@pytest.mark.timeout(400)
@pytest.mark.slow  # ~45 s; CI: the same decision under trainguard run (tests/test_restart_loops.py)
def test_a_relaunch_that_fails_the_same_way_at_the_same_step_stops_instead_of_looping(tmp_path):
    """A bug in the script at step 3, on every launch: the first launch dumps (75), the relaunch
    resumes from it, fails alike and stops with exit 1 instead of asking to be relaunched again."""
    ckpt, env = tmp_path / "ckpt", {"MS_TRAIN_BUG": "1,3"}
    first = run_ms(tmp_path, "bug", strategies="dump,exit", ckpt=ckpt, env=env)
    assert first.rc == 75 and "dying-gasp checkpoint at step 3" in first.log, first
    again = run_ms(tmp_path, "bug", strategies="dump,exit", ckpt=ckpt, env=env)
    assert again.rc == 1, again
    assert "the same fault (unknown ValueError) failed the launch before at the same step" in again.log, again
    assert "relaunch the same command to resume" not in again.log, again
    assert (ckpt / "latest_tft_step.txt").read_text().strip() == "3"
