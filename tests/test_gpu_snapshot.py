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
                  extra_args=["--job-id", job_id, *kw.pop("extra_args", [])], env={**CUDA, **kw.pop("env", {})},
                  **kw)
    assert not list(Path("/dev/shm").glob(f"trainguard-{job_id}-*")), "the node agent must remove its snapshots"
    return job


def test_take_pins_the_slot_and_reads_back_exactly(tmp_path, monkeypatch):
    from trainguard.adapters.torch.snapshot import Snapshots, read_payload
    from trainguard.core.snapshot import SnapshotDir
    from trainguard.core.snapshot.ring import load_verified

    g = torch.Generator(device="cuda").manual_seed(0)
    model = {"w": torch.randn(1024, 513, device="cuda", generator=g),
             "h": torch.randn(77, device="cuda", generator=g).half(), "n": torch.arange(5, device="cuda"),
             "step": torch.tensor(3.0), "big": torch.randn(5 << 20, device="cuda", generator=g)}  # 20 MB
    state = {"state": {"model": model}}  # where a load puts tensors on the device (snapshot.on_device)
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
        for key, t in model.items():
            got = back["state"]["model"][key]
            assert got.device.type == "cuda" and torch.equal(got.to(t.device), t), key
        for slot, _ in held.values():
            slot.close()
    finally:
        snaps.close()
        shm.remove()
    assert snaps._pinned == {}, "closing unregisters every slot"


def test_a_background_take_leaves_on_a_side_stream_after_the_work_that_wrote_the_state():
    """take(background=True) returns while the copy is still to land; the
    copy waits for what the current stream had queued (here a write held
    back by a sleeping kernel); a tensor that changed shape under its path
    gets a new layout, in line and in the background."""
    from test_snapshot_layout import _read_back
    from trainguard.adapters.torch.snapshot import Snapshots
    from trainguard.core.snapshot import SnapshotDir

    state = {"w": torch.zeros(4096, 1024, device="cuda"), "b": torch.zeros(33, device="cuda").half(),
             "step": torch.tensor(1.0)}
    shm = SnapshotDir.create(f"gpusnap-side-{uuid.uuid4().hex[:8]}")
    snaps = Snapshots(shm, 0, count=2)
    read_back = lambda step: _read_back(snaps, step)  # noqa: E731
    try:
        for step, value in ((1, 1.0), (2, 2.0), (3, 3.0)):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of a held-back stream: the write below lands after it
            state["w"].fill_(value)
            state["b"].fill_(value)
            assert snaps.take(state, step, background=True) is not None
            assert snaps.pending is not None, "a background take returns before its copy has landed"
            back = read_back(step)
            assert torch.equal(back["w"], torch.full((4096, 1024), value)), "the copy ran before the write"
            assert torch.equal(back["b"], torch.full((33,), value).half()) and back["step"] == 1.0
        for step, background in ((4, False), (5, True)):
            state["w"] = torch.arange(step * 1000.0, device="cuda").reshape(step, 1000)  # same path, new shape
            assert snaps.take(state, step, background=background) is not None
            back = read_back(step)
            assert torch.equal(back["w"], state["w"].cpu()), step
        assert snaps.pins >= 2 and not snaps.pin_failed and not snaps.errors
    finally:
        snaps.close()
        shm.remove()


@pytest.mark.parametrize("staging_mb", ["0", "16"])
def test_copies_started_before_the_walk_land_exactly_what_the_walk_found(monkeypatch, staging_mb):
    """From the second take on, the device copies start from the last take's
    tensors before the state is walked. Whatever the walk then finds lands:
    values changed in place; a tensor replaced by one of the same shape
    elsewhere in memory (copied again, behind); a host tensor's new value; a
    new structure (walked and copied afresh); in line and in the background."""
    from test_snapshot_layout import _read_back, _same
    from trainguard.adapters.torch.snapshot import Snapshots
    from trainguard.core.snapshot import SnapshotDir

    monkeypatch.setenv("TRAINGUARD_SNAPSHOT_STAGING_MB", staging_mb)
    g = torch.Generator(device="cuda").manual_seed(1)
    state = {"model": {"w": torch.randn(512, 300, device="cuda", generator=g),
                       "bn": torch.randn(64, device="cuda", generator=g), "n": torch.tensor(7, device="cuda"),
                       "big": torch.randn(5 << 20, device="cuda", generator=g)},
             "optimizer": {"state": {0: {"step": torch.tensor(1.0), "m": torch.zeros(512, 300, device="cuda")}}},
             "rng": torch.arange(16, dtype=torch.uint8)}
    shm = SnapshotDir.create(f"gpusnap-ahead-{uuid.uuid4().hex[:8]}")
    snaps = Snapshots(shm, 0, count=2)

    def check(step: int, background: bool) -> None:
        assert snaps.take(state, step, background=background) is not None
        back = _read_back(snaps, step)
        want = {"model": {k: v.cpu() for k, v in state["model"].items()},
                "optimizer": {"state": {0: {k: v.cpu() for k, v in state["optimizer"]["state"][0].items()}}},
                "rng": state["rng"]}
        assert _same(back, want), (step, background)
    try:
        check(1, False)
        assert snaps.ahead_hits == 0
        for step, background in ((2, False), (3, True), (4, False), (5, True)):
            torch.cuda._sleep(100_000_000)  # the writes below are queued behind a busy stream
            state["model"]["w"].mul_(1.5)
            state["optimizer"]["state"][0]["m"].add_(step)
            state["optimizer"]["state"][0]["step"] += 1
            state["rng"] = state["rng"] + 1  # a new host tensor at every take, as the RNG streams are
            check(step, background)
        assert (snaps.ahead_hits, snaps.ahead_late) == (4, 0)
        for step, background in ((6, False), (7, True)):  # new memory under an old path: copied behind
            state["model"]["bn"] = torch.randn(64, device="cuda", generator=g)
            state["model"]["n"] = torch.tensor(step, device="cuda")
            check(step, background)
        assert (snaps.ahead_hits, snaps.ahead_late) == (6, 4)
        state["model"]["extra"] = torch.ones(3, device="cuda")  # a new path: walked and copied afresh
        check(8, False)
        state["model"]["w"] = torch.randn(256, 300, device="cuda", generator=g)  # a new shape
        check(9, True)
        assert snaps.ahead_hits == 6, "a changed structure is not taken ahead of its walk"
        check(10, False)
        assert snaps.ahead_hits == 7, "the new structure is taken ahead from its second take on"
        assert not snaps.errors and snaps.report(None)["copied_ahead"] == 7
    finally:
        snaps.close()
        shm.remove()


def test_restart_on_gpu_resumes_from_pinned_memory_bit_identical(tmp_path):
    clean = _job(tmp_path, "clean")
    assert clean.rc == 0, clean.log[-6000:]
    crash = _job(tmp_path, "crash", fault="crash:rank=1,step=6", extra_args=["--max-restarts", "1"])
    assert crash.rc == 0, crash.log[-8000:]
    assert crash.report["final_state_sha256"] == clean.report["final_state_sha256"], crash
    assert [r["strategy"] for r in crash.report["recoveries"]] == ["dump"], crash
    reports = {int(p.suffix[1:]): json.loads(p.read_text()) for p in tmp_path.glob("crash.json.[0-9]")}
    assert {rank: rep["snapshots"]["resumed_from"] for rank, rep in reports.items()} == \
        {0: {"step": 6, "source": "memory"}, 1: {"step": 6, "source": "memory"}}, crash
    assert all(rep["snapshots"]["pinned"] == 2 and not rep["snapshots"]["pin_failed"] for rep in reports.values())


def test_a_device_memory_error_on_cuda_restarts_that_process_alone_bit_identical(tmp_path):
    """CUDA cannot clean a device memory error in the process: the struck
    rank's process is ended and restarted alone (recover-in-place), its
    state from the survivor and its streams from its node's record; the
    survivor keeps its PID and the job ends bit-identical, dropout masks
    (the CUDA generator) included."""
    dropout = {"SNAP_DROPOUT": "1"}
    clean = _job(tmp_path, "clean", env=dropout)
    assert clean.rc == 0, clean.log[-6000:]
    uce = _job(tmp_path, "uce", env=dropout, fault="uce:rank=1,step=6,phase=backward",
               strategies="retry,recover-in-place,dump,exit", extra_args=["--max-restarts", "1"])
    assert uce.rc == 0, uce.log[-8000:]
    (record,) = uce.report["recoveries"]
    assert (record["fault"], record["rank"], record["strategy"], record["lost_steps"]) == \
        ("uce", 1, "recover-in-place", 0), record
    assert "cannot be repaired in the process" in uce.log
    pids = uce.report["pids"]
    assert len(pids["0"]) == 1 and len(pids["1"]) == 2, pids
    assert uce.report["final_state_sha256"] == clean.report["final_state_sha256"], uce
