"""In-memory snapshots of state on a GPU (needs CUDA; skipped elsewhere, CI included).

Slots are page-locked with ``cudaHostRegister`` the first time a CUDA state
is copied in; a restarted job still resumes from memory, bit-identical. The
ranks share GPU 0 over gloo (NCCL refuses two ranks on one device), so one
GPU is enough.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from conftest import WORKERS, run_job

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = {"SNAP_DEVICE": "cuda"}


def _job(tmp_path, name, **kw):
    job_id = f"gpusnap-{uuid.uuid4().hex[:8]}"
    job = run_job(tmp_path, name, nproc=2, steps=12, save_every=4, script=WORKERS / "snapshot_train.py",
                  extra_args=["--job-id", job_id, *kw.pop("extra_args", [])], env=CUDA, **kw)
    assert not list(Path("/dev/shm").glob(f"trainguard-{job_id}-*")), "the node agent must remove its snapshots"
    return job


def test_take_pins_the_slot_and_reads_back_exactly(tmp_path, monkeypatch):
    from trainguard.adapters.torch.snapshot import Snapshots, read_payload
    from trainguard.core.snapshot import SnapshotDir
    from trainguard.core.snapshot.ring import load_verified

    g = torch.Generator(device="cuda").manual_seed(0)
    state = {"w": torch.randn(1024, 513, device="cuda", generator=g),
             "h": torch.randn(77, device="cuda", generator=g).half(), "n": torch.arange(5, device="cuda"),
             "step": torch.tensor(3.0), "big": torch.randn(5 << 20, device="cuda", generator=g)}  # 20 MB
    # "big" goes on its own; "step" (a host tensor) splits the rest into two runs through the buffer
    monkeypatch.setenv("TRAINGUARD_SNAPSHOT_STAGING_MB", "16")
    shm = SnapshotDir.create(f"gpusnap-unit-{uuid.uuid4().hex[:8]}")
    snaps = Snapshots(shm, 0, count=2)
    try:
        for step in (1, 2, 3):  # both slots, then the first again (registered once each)
            assert snaps.take(state, step) is not None
        report = snaps.report(None)
        assert snaps.pins == 2 and snaps.pin_failed == "", report
        assert (report["staged_copies"], report["direct_copies"], report["staging_MB"]) == (2, 1, 16), report
        while snaps.worker.pending:  # the worker seals each snapshot (XXH3-64) in the background
            snaps.poll(0.5)
        held = snaps.available()
        step, back = load_verified(held[max(held)][0], lambda p: read_payload(p, "cuda"))
        assert step == 3
        for key, t in state.items():
            assert back[key].device.type == "cuda" and torch.equal(back[key].to(t.device), t), key
        for slot, _ in held.values():
            slot.close()
    finally:
        snaps.close()
        shm.remove()
    assert snaps._pinned == {}, "closing unregisters every slot"


def test_restart_on_gpu_resumes_from_pinned_memory_bit_identical(tmp_path):
    clean = _job(tmp_path, "clean")
    assert clean.rc == 0, clean
    crash = _job(tmp_path, "crash", fault="crash:rank=1,step=6", extra_args=["--max-restarts", "1"])
    assert crash.rc == 0, crash
    assert crash.report["final_state_sha256"] == clean.report["final_state_sha256"], crash
    assert [r["strategy"] for r in crash.report["recoveries"]] == ["dump"], crash
    reports = {int(p.suffix[1:]): json.loads(p.read_text()) for p in tmp_path.glob("crash.json.[0-9]")}
    assert {rank: rep["snapshots"]["resumed_from"] for rank, rep in reports.items()} == \
        {0: {"step": 6, "source": "memory"}, 1: {"step": 6, "source": "memory"}}, crash
    assert all(rep["snapshots"]["pinned"] == 2 and not rep["snapshots"]["pin_failed"] for rep in reports.values())
