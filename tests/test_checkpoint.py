"""Checkpoint directories: temporary names, manifest, verification, fallback."""

import json
import logging
import errno
import os

import pytest

from trainguard.core import MINDSPORE, CheckpointError, CheckpointStore, MEGATRON


def layout(*names):
    """Each file the shard of one rank (rank i saved the i-th)."""
    return {"world_size": len(names), "shards": [
        {"kind": 0, "copies": [i], "full": False, "saved_by": i, "files": [n]} for i, n in enumerate(names)]}


def save(store, step, payload=b"x" * 1000, files=("shard_k0_r0.pt", "shard_k0_r1.pt")):
    infos = [store.write(step, name, lambda f, n=name: f.write(payload + n.encode())) for name in files]
    store.finalize(step, infos, layout=layout(*files), meta={"note": step})
    return infos


def test_roundtrip_names_tracker_and_no_tmp(tmp_path):
    store = CheckpointStore(tmp_path)
    save(store, 3)
    save(store, 7)
    assert sorted(os.listdir(tmp_path)) == ["latest_step.txt", "step_00000003", "step_00000007"]
    assert (tmp_path / "latest_step.txt").read_text() == "7\n"
    found = store.latest()
    assert found.step == 7 and found.manifest["meta"] == {"note": 7}
    assert set(found.manifest["files"]) == {"shard_k0_r0.pt", "shard_k0_r1.pt"}


def test_megatron_naming(tmp_path):
    store = CheckpointStore(tmp_path, MEGATRON)
    save(store, 12)
    assert (tmp_path / "iter_0000012").is_dir()
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "12\n"


def corrupt_flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def corrupt_truncate(path):
    path.write_bytes(path.read_bytes()[:100])


@pytest.mark.parametrize("damage, why", [
    (lambda d: corrupt_flip(d / "shard_k0_r1.pt"), "fails its checksum"),
    (lambda d: corrupt_truncate(d / "shard_k0_r0.pt"), "truncated"),
    (lambda d: (d / "shard_k0_r1.pt").unlink(), "shard_k0_r1.pt is missing"),
    (lambda d: (d / "manifest.json").unlink(), "no manifest.json"),
    (lambda d: (d / "manifest.json").write_text("{not json"), "unreadable manifest.json"),
])
def test_broken_newest_checkpoint_falls_back_to_the_previous(tmp_path, caplog, damage, why):
    store = CheckpointStore(tmp_path)
    save(store, 3)
    save(store, 7)
    damage(tmp_path / "step_00000007")
    with caplog.at_level(logging.WARNING, logger="trainguard.checkpoint"):
        found = store.latest()
    assert found.step == 3
    assert any("skipping checkpoint" in r.message and why in r.message and "falling back" in r.message
               for r in caplog.records), caplog.text
    assert any("tracker latest_step.txt names step 7" in r.message for r in caplog.records)


def test_nothing_valid_means_none_with_a_reason(tmp_path, caplog):
    store = CheckpointStore(tmp_path)
    save(store, 3)
    corrupt_flip(tmp_path / "step_00000003" / "shard_k0_r0.pt")
    with caplog.at_level(logging.WARNING, logger="trainguard.checkpoint"):
        assert store.latest() is None
    assert "no complete checkpoint" in caplog.text


def test_finalize_refuses_files_that_differ_from_what_the_saver_wrote(tmp_path):
    store = CheckpointStore(tmp_path)
    infos = [store.write(4, "shard_k0_r0.pt", lambda f: f.write(b"abc"))]
    (store.tmp_path(4) / "shard_k0_r0.pt").write_bytes(b"abd")
    with pytest.raises(CheckpointError, match="shard_k0_r0.pt fails its checksum"):
        store.finalize(4, infos, layout=layout("shard_k0_r0.pt"))
    assert store.tmp_path(4).is_dir()  # left for inspection
    assert not store.final_path(4).exists()
    assert store.latest() is None


def test_disk_full_is_a_clear_error_and_the_previous_checkpoint_survives(tmp_path):
    store = CheckpointStore(tmp_path)
    save(store, 3)
    def full(f):  # what every write does on a full disk (a link to /dev/full is no longer followed)
        f.write(b"y" * (1 << 10))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(CheckpointError, match="the disk is full.*previous checkpoint is untouched"):
        store.write(5, "shard_k0_r0.pt", full)
    assert store.latest().step == 3


def test_same_step_is_replaced_and_older_tmp_dirs_are_cleaned(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    store.tmp_path(1).mkdir(parents=True)  # a save that died half-way
    save(store, 2, payload=b"old")
    save(store, 2, payload=b"new")
    save(store, 4)
    save(store, 6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest_step.txt", "step_00000004", "step_00000006"]


@pytest.mark.parametrize("name", ["../escape", "a/../b", "a/b/c", "/abs", "", "manifest.json", "rank_0/"])
def test_invalid_names_are_refused(tmp_path, name):
    with pytest.raises(CheckpointError, match="invalid checkpoint file name"):
        CheckpointStore(tmp_path).write(1, name, lambda f: None)


def test_mindspore_layout_keeps_files_under_rank_directories(tmp_path):
    """MindSpore TFT's layout: a rank directory per saver; a file written by a
    framework's own save function (by path) is hashed like any other."""
    store = CheckpointStore(tmp_path, MINDSPORE)
    info = store.write_path(7, "rank_0/ttp_rank_0-0_7.ckpt", lambda path: path.write_bytes(b"weights"))
    assert (tmp_path / "ttp_saved_checkpoints-step_7_tmp" / "rank_0" / "ttp_rank_0-0_7.ckpt").is_file()
    store.finalize(7, [info], layout=layout(info.name))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest_tft_step.txt", "ttp_saved_checkpoints-step_7"]
    assert store.latest().step == 7
    (tmp_path / "ttp_saved_checkpoints-step_7" / "rank_0" / "ttp_rank_0-0_7.ckpt").write_bytes(b"weightz")
    assert store.latest() is None  # the corrupted file fails its checksum


def test_mindspore_dying_gasps_named_by_older_releases_are_still_read(tmp_path):
    """``tft_saved_checkpoints-step_{n}``: older MindSpore TFT's name, and
    trainguard's before it took 2.10's ``ttp_saved_...``."""
    store = CheckpointStore(tmp_path, MINDSPORE)
    info = store.write_path(5, "rank_0/ttp_rank_0-0_5.ckpt", lambda path: path.write_bytes(b"weights"))
    store.finalize(5, [info], layout=layout(info.name))
    (tmp_path / "ttp_saved_checkpoints-step_5").rename(tmp_path / "tft_saved_checkpoints-step_5")
    found = store.latest()
    assert found is not None and found.step == 5 and found.path.name == "tft_saved_checkpoints-step_5"


def test_manifest_records_sizes_and_checksums(tmp_path):
    store = CheckpointStore(tmp_path)
    infos = save(store, 1)
    manifest = json.loads((tmp_path / "step_00000001" / "manifest.json").read_text())
    assert manifest["format"] == "trainguard-checkpoint/1"
    for info in infos:
        assert manifest["files"][info.name] == {"bytes": info.bytes, "sha256": info.sha256}
