"""TensorFlow jobs under ``trainguard run --framework tensorflow``, in real
processes (2 workers, MultiWorkerMirroredStrategy over gRPC on CPU,
``tests/workers/tf_train.py``): a fault restarts the whole job, every worker
resumes from the newest verified checkpoint and the job ends bit-identical to
a fault-free run (model, Adam's moments, Dropout's seed state, each worker's
data position); a corrupted newest checkpoint falls back to an older one with
the reason logged; a directory where nothing verifies is refused."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from conftest import WORKERS, run_bounded

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                                reason="needs the tensorflow extra (pip install -e '.[tensorflow]')")

TRAIN = WORKERS / "tf_train.py"


def _env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_") and k != "TF_CONFIG"}
    env.update({"TF_CPP_MIN_LOG_LEVEL": "2", **(extra or {})})
    return env


def tf_job(tmp: Path, name: str, mode: str = "loop", *, steps: int = 20, save_every: int = 5,
           fault: str | None = None, env: dict | None = None, timeout: float = 240, workers: int = 2):
    out, ckpt = tmp / f"{name}.jsonl", tmp / f"{name}-ckpt"
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--framework", "tensorflow", "--workers-per-node", str(workers),
           str(TRAIN), mode, str(steps), str(ckpt), str(out), str(save_every)]
    proc = run_bounded(cmd, env=_env({**({"TRAINGUARD_FAULT": fault} if fault else {}), **(env or {})}),
                       cwd=tmp, timeout=timeout, merge=True)
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return proc.returncode, proc.stdout, records, ckpt


def restarts(log: str) -> list[str]:
    return [line for line in log.splitlines() if "restarting the job" in line]


def by_worker(records: list[dict]) -> dict[int, dict]:
    return {r["index"]: r for r in records}


def check_resumed_equal(ref: list[dict], run: list[dict], resumed: int) -> None:
    ref_w, run_w = by_worker(ref), by_worker(run)
    assert sorted(ref_w) == sorted(run_w)
    for i in ref_w:
        assert run_w[i]["restart"] == "1" and run_w[i]["resumed"] == resumed, run_w[i]
        assert run_w[i]["step"] == ref_w[i]["step"]
        assert run_w[i]["state"] == ref_w[i]["state"], f"worker {i}'s final state differs from the fault-free run"
        if "next_batch" in ref_w[i]:  # each worker's own data position
            assert run_w[i]["next_batch"] == ref_w[i]["next_batch"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fault-free run every faulty one must end equal to."""
    tmp = tmp_path_factory.mktemp("tf_ref")
    rc, log, records, ckpt = tf_job(tmp, "ref")
    assert rc == 0, log[-6000:]
    assert not restarts(log) and len(records) == 2
    assert records[0]["state"] == records[1]["state"]  # the replicas agree
    return records


def test_crashed_worker_restarts_job_and_resumes_equal(tmp_path, reference):
    rc, log, records, ckpt = tf_job(tmp_path, "crash", fault="crash:rank=1,step=12")
    assert rc == 0, log[-6000:]
    lines = restarts(log)
    assert len(lines) == 1 and "worker 1" in lines[0] and "killed by signal 9 after step 12" in lines[0], log[-6000:]
    check_resumed_equal(reference, [r for r in records if r["restart"] == "1"], resumed=10)
    manifest = json.loads((ckpt / "step_00000010" / "manifest.json").read_text())
    assert manifest["layout"]["world_size"] == 2
    for i in (0, 1):  # every worker's own state is in the checkpoint, checksummed
        assert {f"worker_{i}/state.index", f"worker_{i}/host_rng.json"} <= set(manifest["files"])
    assert all("xxh3" in r for r in manifest["files"].values())
    assert not list(ckpt.glob("*_tmp"))


def _corrupt(directory: Path, how: str) -> None:
    newest = directory / "step_00000010"
    if how == "flip":
        data = newest / "model.data-00000-of-00001"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))
    elif how == "truncate":
        state = next((newest / "worker_0").glob("state.data-*"))
        state.write_bytes(state.read_bytes()[:-7])
    elif how == "missing-file":
        (newest / "worker_0" / "host_rng.json").unlink()
    elif how == "missing-manifest":
        (newest / "manifest.json").unlink()


def test_corrupt_newest_checkpoint_falls_back(tmp_path):
    """One worker (no launcher) saves steps 5 and 10; the newest is then
    flipped, truncated, short of a file or of its manifest: each load takes
    step 5 and logs why; with both broken the load is refused."""
    out = tmp_path / "write.jsonl"
    base = tmp_path / "base"
    proc = run_bounded([sys.executable, str(TRAIN), "loop", "10", str(base), str(out), "5"], env=_env(),
                       cwd=tmp_path, timeout=180, merge=True)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert sorted(p.name for p in base.glob("step_*")) == ["step_00000005", "step_00000010"]
    reasons = {"flip": "model.data-00000-of-00001 fails its checksum (corrupted)",
               "truncate": "has 19", "missing-file": "worker_0/host_rng.json is missing",
               "missing-manifest": "no manifest.json"}
    dirs = []
    for how in reasons:
        shutil.copytree(base, tmp_path / how)
        _corrupt(tmp_path / how, how)
        dirs.append(tmp_path / how)
    both = tmp_path / "both-broken"
    shutil.copytree(base, both)
    _corrupt(both, "missing-manifest")
    (both / "step_00000005" / "manifest.json").unlink()
    dirs.append(both)
    intact = tmp_path / "intact"
    shutil.copytree(base, intact)
    (intact / "step_00000010").rename(intact / "away")  # only step 5 left: the state a fallback must load
    dirs.append(intact)
    probe_out = tmp_path / "probe.jsonl"
    proc = run_bounded([sys.executable, str(TRAIN), "probe", "0", ",".join(map(str, dirs)), str(probe_out), "0"],
                       env=_env(), cwd=tmp_path, timeout=180, merge=True)
    assert proc.returncode == 0, proc.stdout[-4000:]
    results = {Path(r["dir"]).name: r for r in map(json.loads, probe_out.read_text().splitlines())}
    step5 = results["intact"]
    assert step5["step"] == 5
    for how, reason in reasons.items():
        assert results[how].get("step") == 5, (how, results[how])
        assert results[how]["state"] == step5["state"], how  # the fallback loaded step 5 whole
        skipped = [line for line in proc.stdout.splitlines()
                   if f"skipping checkpoint {tmp_path / how}/step_00000010" in line]
        assert len(skipped) == 1 and reason in skipped[0], (how, proc.stdout[-3000:])
    assert "error" in results["both-broken"] and "no checkpoint" in results["both-broken"]["error"]
    assert "passes verification" in results["both-broken"]["error"]


@pytest.mark.slow  # CI: test_tf_launcher.py's hung stand-in and the crash above
def test_hung_worker_restarts_job_and_resumes_equal(tmp_path, reference):
    rc, log, records, _ = tf_job(tmp_path, "hang", fault="hang:rank=0,step=12",
                                 env={"TRAINGUARD_HANG_MIN_S": "3"})
    assert rc == 0, log[-6000:]
    lines = restarts(log)
    assert len(lines) == 1 and "hung after step 12: no progress for" in lines[0], log[-6000:]
    check_resumed_equal(reference, [r for r in records if r["restart"] == "1"], resumed=10)


@pytest.mark.slow  # CI: the crash above, in a custom loop
def test_fit_callback_crash_resumes_equal_at_the_epoch(tmp_path):
    """``model.fit`` with the callback, one worker: Keras 3.15's ``fit`` fails
    under a two-worker MultiWorkerMirroredStrategy before any step (its
    ``_maybe_symbolic_build`` hands a PerReplica batch to ``strategy.reduce``),
    so the callback is shown on one."""
    rc, log, ref, _ = tf_job(tmp_path, "fit-ref", "fit", steps=4, save_every=5, workers=1)
    assert rc == 0, log[-6000:]
    rc, log, run, ckpt = tf_job(tmp_path, "fit-crash", "fit", steps=4, save_every=5, workers=1,
                                fault="crash:rank=0,step=10")
    assert rc == 0, log[-6000:]
    assert len(restarts(log)) == 1, log[-6000:]
    check_resumed_equal(ref, [r for r in run if r["restart"] == "1"], resumed=8)  # the end of epoch 2


@pytest.mark.slow  # CI: the refusal with stand-in workers (test_tf_launcher.py) and the probe above
def test_unloadable_directory_stops_the_job_without_restarts(tmp_path):
    rc, log, records, ckpt = tf_job(tmp_path, "first", steps=10, save_every=5)
    assert rc == 0, log[-6000:]
    for step in ckpt.glob("step_*"):
        (step / "manifest.json").unlink()
    out = tmp_path / "second.jsonl"
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--framework", "tensorflow", "--workers-per-node", "2",
           str(TRAIN), "loop", "20", str(ckpt), str(out), "5"]
    proc = run_bounded(cmd, env=_env(), cwd=tmp_path, timeout=240, merge=True)
    assert proc.returncode == 1, proc.stdout[-6000:]
    assert not restarts(proc.stdout) and "refused to go on (exit 76)" in proc.stdout
    assert "no checkpoint in" in proc.stdout and "passes verification" in proc.stdout
    assert not out.exists() and sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000005", "step_00000010"]
