"""FSDP2 and HSDP under the torch Guard, in 4 gloo ranks running a
torchtitan-style script (``workers/fsdp_train.py``: ``fully_shard`` per
block and at the root, AdamW, dropout, clipping, layers that split
unevenly): every fault ends bit-identical to the fault-free run on the full
gathered state (``get_state_dict(full_state_dict=True)``), every rank's
random streams and data position -- or stops at once with a clear message
and writes nothing newer, and the relaunch resumes bit-identical from the
last checkpoint. Checkpoints are DCP's: torch's own ``dcp.load`` reads
them, and the script's own DCP checkpoint is resumed under the Guard.

CI runs the HSDP crash -> dump -> relaunch, a UCE in the backward pass
retried in place and the read of a checkpoint by torch's ``dcp.load``; the
rest (FSDP2 on 4 ranks, the other phases, kills from outside, the script's
own DCP checkpoint, the example) are ``-m slow``, each naming the CI case
that stands for it."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from conftest import WORKERS, Job, job_command, run_job

pytestmark = pytest.mark.timeout(600)

SCRIPT = WORKERS / "fsdp_train.py"
STEPS, SAVE_EVERY = 12, 4
HSDP, FSDP2 = {"FSDP_MESH": "hsdp"}, {"FSDP_MESH": "fsdp2"}


def finals(job: Job) -> dict:
    """What must match the fault-free run: the full gathered state (every
    rank computes it), and per rank its data position and random streams."""
    out = {}
    for rank in range(4):
        path = job.report_path if rank == 0 else job.report_path.with_name(f"{job.report_path.name}.rank{rank}")
        report = json.loads(path.read_text())
        out[rank] = (report["full_sha256"], report["data"], report["rng_sha256"], report["steps_completed"])
    return out


def run(tmp: Path, name: str, mesh: dict, **kwargs) -> Job:
    env = {**mesh, **kwargs.pop("env", {})}
    return run_job(tmp, name, nproc=4, steps=STEPS, save_every=SAVE_EVERY, script=SCRIPT, env=env, timeout=240,
                   **kwargs)


@pytest.fixture(scope="module")
def hsdp_reference(tmp_path_factory):
    """The fault-free HSDP run; it also saves a DCP checkpoint of the
    script's own after step 6 (``dcp.save``, collective). Run once per
    session: ``pytest -n 2`` workers share it through the session's base
    directory (the first one runs it under a lock, the other reads it)."""
    base = tmp_path_factory.getbasetemp()  # under xdist: the session's directory's popen-gwN
    tmp = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "fsdp-hsdp-reference"
    tmp.mkdir(exist_ok=True)
    with open(tmp / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (tmp / "done").exists():
            job = Job(0, (tmp / "done").read_text(), json.loads((tmp / "reference.json").read_text()),
                      tmp / "reference-ckpt", tmp / "reference.json")
        else:
            job = run(tmp, "reference", HSDP, env={"FSDP_DCP_OUT": f"{tmp / 'users-dcp'}:6"})
            if job.rc == 0:
                (tmp / "done").write_text(job.log)
    assert job.rc == 0, job
    assert job.report["steps_completed"] == STEPS and not job.report["recoveries"]
    return job, finals(job)


@pytest.fixture(scope="module")
def fsdp2_reference(tmp_path_factory):
    job = run(tmp_path_factory.mktemp("fsdp2-reference"), "reference", FSDP2)
    assert job.rc == 0, job
    return finals(job)


def dump_and_relaunch(tmp: Path, reference: dict, fault: str, mesh: dict = HSDP,
                      check_dump=lambda job: None) -> tuple[Job, dict]:
    """The job saves a dying gasp and stops (75; ``check_dump`` sees it);
    its relaunch finishes bit-identical with no step lost."""
    first = run(tmp, "first", mesh, fault=fault)
    assert first.rc == 75, first
    check_dump(first)
    second = run(tmp, "second", mesh, fault=fault, ckpt=first.ckpt)
    assert second.rc == 0, second
    assert finals(second) == reference, f"not bit-identical to the fault-free run:\n{second.log[-4000:]}"
    assert second.report["lost_steps"] == 0
    assert "continues from its seed" not in second.log and "holds no random streams" not in second.log
    (record,) = second.report["recoveries"]
    assert record["strategy"] == "dump", record
    return first, record


def retried_in_place(tmp: Path, reference: dict, fault: str, mesh: dict, source: str) -> dict:
    """The job repairs the rank in place and ends bit-identical; returns the recovery."""
    job = run(tmp, "job", mesh, fault=fault)
    assert job.rc == 0, job
    assert finals(job) == reference, f"not bit-identical to the fault-free run:\n{job.log[-4000:]}"
    (record,) = job.report["recoveries"]
    assert record["strategy"] == "retry" and job.report["lost_steps"] == 0, record
    assert source in job.log, job.log[-3000:]
    return record


def stopped_then_relaunched(tmp: Path, reference: dict, fault: str, shard: int) -> None:
    """FSDP2 keeps one copy of each shard: the job stops at once, saying
    which shard has no copy, and writes nothing newer; the relaunch resumes
    from the last periodic checkpoint and ends bit-identical."""
    first = run(tmp, "first", FSDP2, fault=fault)
    assert first.rc == 1, first
    assert f"no consistent copy of shard [{shard}] (state kind 0)" in first.log, first.log[-3000:]
    assert sorted(p.name for p in first.ckpt.glob("step_*")) == ["step_00000004"], "nothing newer is written"
    second = run(tmp, "second", FSDP2, fault=fault, ckpt=first.ckpt)
    assert second.rc == 0, second
    assert "resumed from storage at step 4" in second.log
    assert finals(second) == reference, f"not bit-identical to the fault-free run:\n{second.log[-4000:]}"


# ------------------------------------------------------------------ HSDP
def test_hsdp_crash_dumps_one_copy_of_each_shard_and_the_relaunch_is_bit_identical(tmp_path, hsdp_reference,
                                                                                  capsys):
    def check_dump(first: Job) -> None:
        manifest = json.loads((first.ckpt / "step_00000006" / "manifest.json").read_text())
        layout = manifest["layout"]
        assert layout["format"] == "dcp"
        assert sorted((s["copies"], s["saved_by"], s["full"]) for s in layout["shards"]) == \
            [([0, 2], 0, False), ([1, 3], 3, False)], "rank 1's shard is saved by its replica, rank 3"
        assert {".metadata", "own_r1.bin"} <= set(manifest["files"]), "DCP's metadata and the lost rank's own part"
        from trainguard.cli import main
        capsys.readouterr()
        code, out = main(["ckpt", "verify", str(first.ckpt)]), capsys.readouterr().out  # checks DCP's chunks too
        assert code == 0 and "ok      " in out and "BROKEN" not in out, out

    _, record = dump_and_relaunch(tmp_path, hsdp_reference[1], "crash:rank=1,step=6,phase=forward",
                                  check_dump=check_dump)
    assert record["fault"] == "process_lost" and record["rank"] == 1 and record["step"] == 6


def test_hsdp_uce_in_the_backward_pass_is_retried_in_place_from_the_other_replica_group(tmp_path, hsdp_reference):
    record = retried_in_place(tmp_path, hsdp_reference[1], "uce:rank=2,step=6,phase=backward", HSDP,
                              "rank 2 took its state at step 6 from rank 0")
    assert record["fault"] == "uce" and record["rank"] == 2


@pytest.mark.slow  # stands for them in CI: test_hsdp_uce_in_the_backward_pass_is_retried_in_place_...
@pytest.mark.parametrize("phase,source", [("forward", "rank 1 took its state at step 6 from rank 3"),
                                          ("optimizer", "rank 1 took its state at step 7 from rank 3")])
def test_hsdp_uce_in_the_forward_pass_and_the_update_is_retried_in_place(tmp_path, hsdp_reference, phase, source):
    retried_in_place(tmp_path, hsdp_reference[1], f"uce:rank=1,step=6,phase={phase}", HSDP, source)


@pytest.mark.slow  # stands for it in CI: test_hsdp_crash_dumps_one_copy_of_each_shard_and_the_relaunch_...
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "sigstop"])
def test_hsdp_a_worker_killed_or_stopped_from_outside_dumps_bit_identical(tmp_path, hsdp_reference, sig):
    seed = random.randrange(1 << 30)
    first = _outside(tmp_path, "first", sig, seed)
    assert first.rc == 75, f"seed {seed}: {first}"
    second = run(tmp_path, "second", HSDP, ckpt=first.ckpt)
    assert second.rc == 0, second
    assert finals(second) == hsdp_reference[1], f"seed {seed}: not bit-identical:\n{second.log[-3000:]}"
    (record,) = second.report["recoveries"]
    assert record["rank"] == 1 and record["fault"] == ("process_lost" if sig == signal.SIGKILL else "hang")


@pytest.mark.slow  # stands for it in CI: test_decide.py's test_no_process_is_restarted_into_a_job_that_says_...
def test_hsdp_with_process_restarts_dumps_and_the_group_restart_resumes_bit_identical(tmp_path, hsdp_reference):
    """Under ``trainguard run``'s defaults (retry, recover-in-place, dump,
    exit; a restart budget): recover-in-place is refused (a new process
    would wait for good in init_device_mesh's collectives), the dump runs,
    and the launcher's restart of the whole group resumes from it."""
    job = run(tmp_path, "job", HSDP, fault="crash:rank=1,step=6,phase=forward", max_restarts=None)
    assert job.rc == 0, job
    assert finals(job) == hsdp_reference[1]
    (record,) = job.report["recoveries"]
    assert record["strategy"] == "dump" and "a new process cannot join an HSDP job" in job.log
    assert "restarted ranks [0, 1, 2, 3]" in job.log


@pytest.mark.slow  # stands for it in CI: test_decide.py's test_fsdp2_has_no_copy_of_a_lost_or_corrupted_shard
@pytest.mark.parametrize("snapshot_every,resumed", [("0", "resumed from storage at step 4"),
                                                    ("1", "resumed from memory at step 6")])
def test_fsdp2_under_the_default_restart_budget_resumes_bit_identical(tmp_path, fsdp2_reference, snapshot_every,
                                                                      resumed):
    """Under ``trainguard run``'s defaults a lost FSDP2 rank leaves its
    shard with no live copy: no dump (nothing newer written), the job exits
    and the launcher's group restart resumes -- from the last periodic
    checkpoint, or with ``snapshot_every=1`` from every rank's own snapshot
    of the step in the node's memory (no step lost) -- ending bit-identical,
    once, not a loop."""
    job = run(tmp_path, "job", {**FSDP2, "FSDP_SNAPSHOT_EVERY": snapshot_every},
              fault="crash:rank=1,step=6,phase=forward", max_restarts=None)
    assert job.rc == 0, job
    assert finals(job) == fsdp2_reference
    assert "dump: no consistent copy of shard [1] (state kind 0) at step 6; exit" in job.log
    assert job.log.count("restarted ranks [0, 1, 2, 3]") == 1, job.log[-3000:]
    assert all(f"rank {r} {resumed}" in job.log for r in range(4)), job.log[-3000:]


def _outside(tmp: Path, name: str, sig: int, seed: int) -> Job:
    """Run the HSDP job and send ``sig`` to rank 1 at a random moment of
    its training (after its first update was recorded)."""
    cmd, env, report, ckpt = job_command(tmp, name, nproc=4, steps=STEPS, save_every=SAVE_EVERY, script=SCRIPT,
                                         env={**HSDP, "FSDP_STEP_SLEEP": "0.1"})
    proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        recorded = None
        deadline = time.time() + 120
        while recorded is None and time.time() < deadline and proc.poll() is None:
            recorded = next(Path("/dev/shm").glob(f"trainguard-*-{proc.pid}-*/own-r1"), None)
            time.sleep(0.02)
        assert recorded is not None, "rank 1 never recorded an update"
        time.sleep(random.Random(seed).uniform(0.0, 1.0))
        os.kill(next(p for p in _workers(proc.pid) if _rank_of(p) == 1), sig)
        out, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return Job(proc.returncode, out, json.loads(report.read_text()) if report.exists() else None, ckpt, report)


def _workers(launcher: int) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == launcher:
                out.append(int(pid))
    return out


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)


# ------------------------------------------------------------------ FSDP2
@pytest.mark.slow  # stands for it in CI: the HSDP tests above (the same groups, reset and retry) and
# test_sharded_state.py's FSDP2 layout
def test_fsdp2_comm_fault_in_the_backward_pass_is_retried_in_place(tmp_path, fsdp2_reference):
    """Every shard is still whole after a communication fault: the ranks
    are released from FSDP's reduce-scatter and repeat the step, with no
    state copied (the rank's own shard is its only copy)."""
    record = retried_in_place(tmp_path, fsdp2_reference, "comm:rank=1,step=6,phase=backward", FSDP2,
                              "retry at step 6 (no state copy needed)")
    assert record["fault"] == "comm"


@pytest.mark.slow  # stands for them in CI: test_decide.py's test_fsdp2_has_no_copy_of_a_lost_or_corrupted_shard
@pytest.mark.parametrize("fault,shard", [("crash:rank=1,step=6,phase=forward", 1),
                                         ("uce:rank=1,step=6,phase=forward", 1),
                                         ("uce:rank=2,step=6,phase=backward", 2),
                                         ("uce:rank=3,step=6,phase=optimizer", 3)])
def test_fsdp2_a_lost_or_corrupted_shard_stops_at_once_and_the_relaunch_is_bit_identical(tmp_path, fsdp2_reference,
                                                                                          fault, shard):
    stopped_then_relaunched(tmp_path, fsdp2_reference, fault, shard)


# ------------------------------------------------------------------ DCP
def _worker():
    spec = importlib.util.spec_from_file_location("fsdp_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_trainguard_checkpoint_of_an_fsdp_model_is_read_by_dcp_into_a_plain_model(hsdp_reference):
    """torch's own ``dcp.load`` (its reader, its planner, no trainguard
    code) fills an unsharded model and optimizer from the HSDP job's last
    checkpoint; they hold the job's whole final state."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    job, reference = hsdp_reference
    worker = _worker()
    torch.manual_seed(0)
    model = worker.plain_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # as the script's: its param groups hold initial_lr
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(state, checkpoint_id=str(job.ckpt / f"step_{STEPS:08d}"), no_dist=True)
    assert worker.state_sha256(state["model"], state["optimizer"]) == reference[0][0]


@pytest.mark.slow  # stands for it in CI: test_a_trainguard_checkpoint_of_an_fsdp_model_is_read_by_dcp_... (the
# other direction) and test_sharded_state.py's resume
def test_the_scripts_own_dcp_checkpoint_is_resumed_under_the_guard(tmp_path, hsdp_reference):
    """The script loads the checkpoint ``dcp.save`` wrote after step 6 (with
    its random streams and data position) and tells the Guard its step;
    the job ends bit-identical to the run that never stopped."""
    job, reference = hsdp_reference
    resumed = run(tmp_path, "resumed", HSDP, env={"FSDP_DCP_IN": f"{job.ckpt.parent / 'users-dcp'}:6"})
    assert resumed.rc == 0, resumed
    assert resumed.report["steps_completed"] == STEPS
    assert finals(resumed) == reference
    assert sorted(p.name for p in resumed.ckpt.glob("step_*")) == ["step_00000008", "step_00000012"]


# ------------------------------------------------------------------ the example
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fsdp" / "train.py"


@pytest.mark.slow  # stands for it in CI: test_hsdp_uce_in_the_backward_pass_is_retried_in_place_from_the_...
def test_the_fsdp_example_retries_a_comm_fault_and_every_rank_exits_cleanly(tmp_path):
    """The example's GPT (attention, three units and the root): after the
    retry every rank ends with exit 0 -- a retired backend kept open by the
    abandoned step's handles once left a peer's retiring thread waiting into
    the interpreter's exit ("terminate called without an active exception",
    exit -6 in 2 of 3 runs before the fix)."""
    def example(name: str, fault: str | None) -> Job:
        cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "4", "--monitor-interval", "0.1",
               str(EXAMPLE), "mesh=fsdp2", "steps=6", "save_every=3", f"checkpoint_dir={tmp_path / name}",
               f"report={tmp_path / name}.json"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
        env.update({"TRAINGUARD_HEARTBEAT_INTERVAL_S": "0.5", **({"TRAINGUARD_FAULT": fault} if fault else {})})
        proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        report = tmp_path / f"{name}.json"
        return Job(proc.returncode, proc.stdout + proc.stderr, json.loads(report.read_text()) if report.exists()
                   else None, tmp_path / name, report)

    reference = example("reference", None)
    assert reference.rc == 0, reference
    job = example("comm", "comm:rank=3,step=3,phase=backward")
    assert job.rc == 0 and "terminate called" not in job.log, job
    assert job.report["full_state_sha256"] == reference.report["full_state_sha256"]
    assert [r["strategy"] for r in job.report["recoveries"]] == ["retry"]
