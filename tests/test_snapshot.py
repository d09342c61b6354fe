"""In-memory snapshots: slots, verification, ownership, the persist worker,
peer copies and a full disk (kill -9 during persists: test_snapshot_kills.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import closing

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as st_load

from trainguard.adapters.torch.checkpoints import read_stored_snapshot
from trainguard.adapters.torch.snapshot import Snapshots, destinations, filled, read_payload, read_payload_into
from trainguard.core import CheckpointError
from trainguard.core.checkpoint import CheckpointStore
from trainguard.core.snapshot import PeerServer, SnapshotDir, State, fetch, push
from trainguard.core.snapshot.ring import load_verified
from trainguard.core.snapshot.segment import PAGE, Slot

from conftest import WORKERS
from snapshot_states import (equal, flip_byte, one_rank, persist_whole, sample_state, thread_count, unshare_ok,
                             wait_sealed)

def test_snapshot_round_trip_persist_and_safetensors(shm, tmp_path):
    with closing(Snapshots(shm, 0, count=2)) as snaps:
        i1 = snaps.take(sample_state(1), 1)
        i2 = snaps.take(sample_state(2), 2)
        assert {i1, i2} == {0, 1}
        i3 = snaps.take(sample_state(3), 3)  # the oldest slot is reused
        assert i3 == i1
        wait_sealed(snaps, i3)
        wait_sealed(snaps, i2)
        memory = snaps.available()
        assert sorted(memory) == [2, 3] and memory[3][1] == "memory"
        slot = memory[3][0]
        slot.lock(False, block=True)
        step, held = read_payload(slot.payload())
        raw = bytes(slot.payload())
        slot.close()
        assert step == 3 and equal(held, sample_state(3))
        # The payload is a safetensors file as it stands.
        tensors = st_load(raw)
        assert torch.equal(tensors[".state.model.w"], sample_state(3)["state"]["model"]["w"])

        root = tmp_path / "ckpt"
        persist_whole(snaps, i3, 3, root)
        snaps.wait(60)
        assert snaps.errors == [] and snaps.persisted[-1]["step"] == 3
        found = CheckpointStore(root).latest()
        assert found.step == 3 and sorted(found.manifest["files"]) == ["shard_k0_r0.safetensors"]
        assert not (found.path / ".records").exists()
        assert equal(read_stored_snapshot(found.file("shard_k0_r0.safetensors"), "cpu"), sample_state(3)["state"])
        with safe_open(str(found.file("shard_k0_r0.safetensors")), "pt") as f:
            assert json.loads(f.metadata()["trainguard"])["step"] == 3
        # Its checksum is the XXH3-64 the slot was sealed with; a flipped byte is caught at load.
        record = found.manifest["files"]["shard_k0_r0.safetensors"]
        assert set(record) == {"bytes", "xxh3"} and record["xxh3"] == snaps.slots[i3].info().checksum
        with open(found.file("shard_k0_r0.safetensors"), "r+b") as f:
            f.seek(-2, 2)
            f.write(b"\x00\x01")
        with pytest.raises(CheckpointError, match="fails its checksum"):
            CheckpointStore(root).verify(found.path)


def test_a_persist_of_a_slot_being_sealed_takes_the_seal_threads_checksum(shm, tmp_path, monkeypatch):
    """The worker seals on a second thread; a persist of the slot meanwhile
    writes the file and records the checksum that seal computes (not a
    second pass), or seals the slot itself when that seal could not."""
    import dataclasses
    from concurrent.futures import Future

    from trainguard.core.snapshot import persist as worker

    with closing(Snapshots(shm, 0, count=1)) as snaps:
        monkeypatch.setattr(snaps.worker, "submit", lambda op, **kw: 0)  # no worker: the slot stays unsealed
        index = snaps.take(sample_state(4), 4)
        slot = snaps.slots[index]
        assert slot.info().state is State.COMPLETE
        req = {"slot": str(slot.path), "step": 4, "root": str(tmp_path / "ckpt"), "naming": "torch",
               "name": "shard_k0_r0.safetensors"}
        in_flight: Future = Future()
        in_flight.set_result(dataclasses.replace(slot.info(), checksum=12345))  # what the seal thread found
        assert worker._persist(req, os.getpid(), in_flight)["file"][3] == 12345
        assert slot.info().state is State.COMPLETE  # nothing hashed again

        failed: Future = Future()
        failed.set_result(None)  # the seal thread could not seal it
        got = worker._persist({**req, "step": 4}, os.getpid(), failed)["file"][3]
        assert slot.info().state is State.SEALED and got == slot.info().checksum


def test_a_background_copy_commits_and_seals_on_its_own_and_a_persist_waits_for_it(shm, tmp_path, monkeypatch):
    """take(background=True) returns before the copy; the copy thread commits
    the slot and asks for its seal even if the trainer never settles (it may
    die in the next step); a persist asked meanwhile is sent once the copy
    has landed; a copy that fails leaves the slot unloadable, not training."""
    from trainguard.adapters.torch import snapshot as module

    gate = __import__("threading").Event()
    real = module._copy

    def held_copy(views, tensors):
        assert gate.wait(30), "the test never released the copy"
        real(views, tensors)
    monkeypatch.setattr(module, "_copy", held_copy)
    snaps = Snapshots(shm, 0, count=2)
    try:
        index = snaps.take(sample_state(1), 1, background=True)
        slot = snaps.slots[index]
        assert snaps.pending is not None and slot.info().state is State.WRITING
        assert snaps.available() == {}  # nothing loadable while it copies
        root = tmp_path / "ckpt"
        persist_whole(snaps, index, 1, root)
        assert snaps.worker.pending == {}  # held back until the copy lands
        gate.set()
        wait_sealed(snaps, index)  # committed and sealed without settle()
        snaps.wait(60)  # settles, sends the persist, waits for it
        assert snaps.pending is None and snaps.errors == [] and [p["step"] for p in snaps.persisted] == [1]
        assert equal(read_stored_snapshot(CheckpointStore(root).latest().file("shard_k0_r0.safetensors"), "cpu"),
                     sample_state(1)["state"])

        def broken(views, tensors):
            raise RuntimeError("no memory")
        monkeypatch.setattr(module, "_copy", broken)
        bad = snaps.take(sample_state(2), 2, background=True)
        persist_whole(snaps, bad, 2, root)
        snaps.wait(60)
        assert snaps.errors == ["step 2: the snapshot copy failed: no memory",
                                f"step 2: slot {snaps.slots[bad].path.name} no longer holds step 2"]
        assert snaps.slots[bad].info().state is State.WRITING and snaps.holding(2) is None
        assert CheckpointStore(root).steps() == [1]
        monkeypatch.setattr(module, "_copy", real)
        wait_sealed(snaps, snaps.take(sample_state(3), 3, background=True))
        assert sorted(snaps.available()) == [1, 3]
        snaps.settle()
        assert snaps.report(None)["taken"] == 2
    finally:
        gate.set()
        snaps.close()


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="torch runs one intra-op thread here: no OpenMP team")
def test_a_background_copy_leaves_the_training_threads_cores_alone(shm):
    """The background copy starts no OpenMP team on the ring's thread (torch's
    own copy of a large tensor would: a thread of its own, whose presence
    makes every parallel region of the training thread sleep and wake at its
    barriers); strided, bf16 and empty tensors still read back exactly."""
    big = torch.randn(4 << 20)  # 16 MB: copied in parallel by torch
    state = {"big": big, "strided": torch.randn(64, 32).t(), "bf16": torch.randn(300).bfloat16(),
             "empty": torch.empty(0, 3), "n": 7}
    with closing(Snapshots(shm, 0, count=2)) as snaps:
        wait_sealed(snaps, snaps.take(state, 1))  # in line: this thread's team, the persist worker's reader
        before = thread_count()
        index = snaps.take(state, 2, background=True)
        snaps.settle()
        assert thread_count() == before + 1  # the ring's copy thread, and nothing it started
        wait_sealed(snaps, index)
        step, held = read_payload(snaps.slots[index].payload())
        assert step == 2 and equal(held, state)


def test_a_save_overtaken_by_a_newer_final_checkpoint_is_not_finalised(shm, tmp_path):
    """A dying gasp at step 6 finalised before the background save of step 4
    reached the worker: step 4 is refused and the tracker keeps step 6."""
    root = tmp_path / "ckpt"
    store = CheckpointStore(root)
    info = store.write(6, "shard_k0_r0.pt", lambda f: f.write(b"dump"))
    store.finalize(6, [info], layout=one_rank("shard_k0_r0.pt"))
    with closing(Snapshots(shm, 0, count=2)) as snaps:
        index = snaps.take(sample_state(4), 4)
        persist_whole(snaps, index, 4, root)
        snaps.wait(60)
        assert snaps.persisted == [] and snaps.errors == \
            ["step 4: step 4 not finalised: the newer step 6 is final already"]
        assert CheckpointStore(root).tracked_step() == 6 and CheckpointStore(root).steps() == [6]


def test_background_saves_keep_only_the_newest_checkpoints_the_job_asked_for(shm, tmp_path):
    """``keep`` travels with the finalise request; the persist worker pruned
    nothing before, and a long job filled its disk."""
    root = tmp_path / "ckpt"
    with closing(Snapshots(shm, 0, count=2)) as snaps:
        for step in (2, 4, 6):
            index = snaps.take(sample_state(step), step)
            persist_whole(snaps, index, step, root, keep=2)
            snaps.wait(60)
        assert snaps.errors == [] and CheckpointStore(root).steps() == [6, 4]


def test_a_shard_that_fails_on_its_rank_stops_the_finaliser_waiting(shm, tmp_path):
    """Rank 1's persist fails (its slot no longer holds the step): it leaves a
    failed record, and rank 0's worker, finalising, gives up at once rather
    than waiting its timeout for the file."""
    root = tmp_path / "ckpt"
    fin = {"expected": ["a.safetensors", "b.safetensors"], "timeout_s": 600, "layout": {"world_size": 2},
           "meta": {}}
    zero, one = Snapshots(shm, 0, count=1), Snapshots(shm, 1, count=1)
    try:
        one.persist(one.take(sample_state(1), 1), 5, root=str(root), name="b.safetensors", finalize=None)
        zero.persist(zero.take(sample_state(5), 5), 5, root=str(root), name="a.safetensors", finalize=fin)
        one.wait(60)
        zero.wait(60)
        assert one.errors == [f"step 5: slot {one.slots[0].path.name} no longer holds step 5"]
        assert zero.errors == ["step 5: step_00000005_tmp: ['b.safetensors'] could not be written; not finalised"]
        assert CheckpointStore(root).steps() == []
    finally:
        zero.close()
        one.close()


def test_staged_copies_gather_small_tensors_and_read_back_exactly(shm):
    """The staging path (taken by CUDA tensors; forced here on the host):
    runs of small tensors gathered by dtype, a tensor larger than the buffer
    copied on its own, host, empty and non-contiguous tensors, all exact."""
    g = torch.Generator().manual_seed(7)
    big = torch.randn(40, 40, generator=g)  # 6400 bytes: more than the 4 KiB buffer
    state = {"a": torch.randn(30, generator=g), "h": torch.randn(50, generator=g).half(),
             "bf": torch.randn(9, generator=g).bfloat16(), "i": torch.arange(300), "m": torch.rand(11, generator=g) > 0.5,
             "empty": torch.empty(0, 3), "t": torch.randn(20, 8, generator=g).t(), "big": big,
             "host": torch.tensor(5.0), "x": 3}
    with closing(Snapshots(shm, 0, count=1)) as snaps:
        snaps.staging_bytes = 4096
        # "host" stays a host copy, as a CPU tensor in a CUDA state does
        snaps._stage = lambda t: t.numel() != 1
        for step in (1, 2):  # the plan is built once and reused
            state["a"] += 1
            assert snaps.take(state, step) == 0
            slot = snaps.slots[0]
            slot.lock(False, block=True)
            got_step, back = read_payload(slot.payload())
            slot.unlock()
            assert got_step == step and equal(back, state)
        report = snaps.report(None)
        assert report["staged_copies"] >= 2 and report["direct_copies"] == 1, report
        assert report["staging_MB"] == 0 and snaps._staging.host  # the one-element tensor went the host way


def test_staging_size_is_read_from_the_environment(monkeypatch):
    from trainguard.adapters.torch.snapshot import staging_bytes

    monkeypatch.setenv("TRAINGUARD_SNAPSHOT_STAGING_MB", "8")
    assert staging_bytes() == 8 << 20
    for bad in ("lots", "-1"):
        monkeypatch.setenv("TRAINGUARD_SNAPSHOT_STAGING_MB", bad)
        with pytest.raises(CheckpointError, match="TRAINGUARD_SNAPSHOT_STAGING_MB"):
            staging_bytes()


def test_corrupt_unsealed_and_half_written_snapshots_are_never_loaded(shm, caplog):
    with closing(Snapshots(shm, 0, count=3)) as snaps:
        for step in (1, 2):
            wait_sealed(snaps, snaps.take(sample_state(step), step))
        # Flip one byte of step 2's tensors: checksum mismatch.
        slot2 = next(s for s in snaps.slots if s.info() and s.info().step == 2)
        flip_byte(slot2.path, 5)
        # A third slot left mid-copy (a trainer killed while writing).
        third = next(s for s in snaps.slots if s.info() is None)
        third.lock(True)
        third.begin(PAGE)
        third.unlock()
        memory = snaps.available()
        assert sorted(memory) == [1]
        assert "fails its checksum" in caplog.text and "snapshot is writing, not sealed" in caplog.text


def test_a_load_fills_the_tensors_a_restart_has_in_place_and_only_once_the_checksum_passed(shm):
    with closing(Snapshots(shm, 0, count=1)) as snaps:
        index = snaps.take(sample_state(4), 4)
        wait_sealed(snaps, index)
        # What a restarted process has: its model (the half-precision bias saved in its
        # own dtype here: no place for it), and no optimizer state.
        model = {"w": torch.zeros(300, 70), "b": torch.zeros(70), "n": torch.tensor(0)}
        into = destinations({"state": {"model": model}})
        w = model["w"]
        slot = Slot(snaps.slots[index].path)
        flip_byte(slot.path, 5)  # one byte of the payload's end (the optimizer's moments) flipped
        read = lambda payload: read_payload_into(payload, "cpu", into)  # noqa: E731
        with pytest.raises(CheckpointError, match="fails its checksum"):
            load_verified(slot, read, filled)
        assert not w.any(), "a destination was written before the checksum was checked"

        flip_byte(slot.path, 5)  # flipped back
        step, loaded = load_verified(Slot(slot.path), read, filled)
        state, want = loaded["state"], sample_state(4)["state"]
        assert step == 4 and equal(state, want)
        held = state["model"]
        assert held["w"] is w and held["n"] is model["n"]  # filled in place
        assert held["b"] is not model["b"] and not model["b"].any()  # another dtype: copied out
        wait_sealed(snaps, snaps.take(sample_state(5), 5))  # the slot written again: what was copied out stays
        assert equal(state["optimizer"], want["optimizer"]) and equal(state["model"]["b"], want["model"]["b"])


def test_the_persist_worker_and_its_threads_run_below_the_trainers_priority(shm):
    from trainguard.core.snapshot.persist import NICE

    with closing(Snapshots(shm, 0, count=2)) as snaps:
        wait_sealed(snaps, snaps.take(sample_state(1), 1))  # the worker has started its seal thread
        pid, mine = snaps.worker.pid, os.getpriority(os.PRIO_PROCESS, 0)
        threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        assert len(threads) > 1
        assert {os.getpriority(os.PRIO_PROCESS, t) for t in threads} == {min(mine + NICE, 19)}


def test_persist_worker_killed_mid_persist_is_restarted_and_nothing_partial_is_final(shm, tmp_path):
    root = tmp_path / "ckpt"
    with closing(Snapshots(shm, 0, count=2)) as snaps:
        big = {"state": {"w": torch.ones(64 << 20 >> 2), "step": 1}, "history": {}}  # 64 MiB
        index = snaps.take(big, 1)
        snaps.persist(index, 1, root=str(root), name="shard_k0_r0.safetensors",
                      finalize={"expected": ["shard_k0_r0.safetensors", "shard_k0_r1.safetensors"],
                                "timeout_s": 600, "layout": {}, "meta": {}})
        time.sleep(0.2)
        pid = snaps.worker.pid
        os.kill(pid, signal.SIGKILL)
        snaps.wait(30)
        assert snaps.errors and f"persist worker {pid} died" in snaps.errors[-1]
        assert CheckpointStore(root).latest() is None
        # The next request starts a new worker, which serves it.
        index = snaps.take({"state": {"w": torch.zeros(4), "step": 2}, "history": {}}, 2)
        persist_whole(snaps, index, 2, root)
        snaps.wait(60)
        assert snaps.worker.restarts == 1 and snaps.worker.pid != pid
        assert CheckpointStore(root).latest().step == 2


def test_peer_copy_is_authenticated_checked_and_fetched_back(shm, tmp_path):
    root = tmp_path / "peer-node"
    root.mkdir()
    other = SnapshotDir.create("job-n1", root)
    server = PeerServer(other, token="secret")
    address = server.start()
    snaps = Snapshots(shm, 3, count=1)
    try:
        index = snaps.take(sample_state(5), 5)
        wait_sealed(snaps, index)
        slot = snaps.slots[index]
        with pytest.raises(CheckpointError, match="wrong job token"):
            push(address, slot, rank=3, token="guess")
        push(address, slot, rank=3, token="secret")
        copy = other.candidates(3)
        assert [s.path.name for s in copy] == ["r3"]
        assert copy[0].verified().step == 5
        # A copy torn on the way (bytes changed after sealing) is refused.
        with open(slot.path, "r+b") as f:
            f.seek(PAGE + 200)
            f.write(b"\xff\xff")
        with pytest.raises(CheckpointError, match="checksum"):
            push(address, slot, rank=3, token="secret")
        assert other.candidates(3)[0].verified().step == 5  # the good copy is kept
        # The process restarted on the peer node finds rank 3's copy there.
        there = Snapshots(other, 3, count=1)
        assert {s: src for s, (_, src) in there.available().items()} == {5: "peer memory"}
        there.close()
        # One restarted on a new, empty node fetches it back (and must know the token).
        new_node = SnapshotDir.create("job-n0-new", root)
        try:
            with pytest.raises(CheckpointError, match="wrong job token"):
                fetch(address, new_node, rank=3, token="guess")
            assert fetch(address, new_node, rank=2, token="secret") is None  # holds nothing for rank 2
            fresh = Snapshots(new_node, 3, count=1, peer=address, token="secret")
            got = fresh.available()
            assert {s: src for s, (_, src) in got.items()} == {5: "peer memory"}
            slot = got[5][0]
            slot.lock(False, block=True)
            assert equal(read_payload(slot.payload())[1], sample_state(5))
            fresh.close()
        finally:
            new_node.remove()
    finally:
        snaps.close()
        server.stop()
        other.remove()


@pytest.mark.skipif(not unshare_ok(), reason="needs unprivileged user and mount namespaces to mount a small tmpfs")
def test_full_disk_gives_a_clear_error_and_keeps_the_previous_checkpoint(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    script = WORKERS / "snapshot_full_disk.py"
    out = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                          f"mount -t tmpfs -o size=4m tmpfs {disk} && exec {sys.executable} {script} {disk}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "the disk is full" in result["error"] and "previous checkpoint is untouched" in result["error"]
    assert result["latest"] == 1 and result["whole"] is True
    assert result["leftover_bytes"] < 64 << 10, "the half-written file must be removed"
