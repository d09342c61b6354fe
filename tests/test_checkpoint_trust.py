"""What a resume loads is what was verified, and whose it is (issue 41, item 5).

Before: verification opened each file without following a link, but the
load opened it again by name, so a shard swapped in between was loaded
(values off by 1.0) with no error; a step directory that was a link out of
the checkpoint directory passed ``trainguard ckpt verify``; and checksums
were unkeyed, so a shard edited with its checksum recomputed resumed
silently. The torch adapter's own load (``Checkpoints._load_stored``) is
driven here, on a stand-in for its Guard.
"""

from __future__ import annotations

import hashlib
import functools
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trainguard.adapters.torch.checkpoints import Checkpoints
from trainguard.core import CheckpointError, CheckpointStore

NAME = "shard_k0_r0.pt"
KEY = bytes(range(32))
LAYOUT = {"world_size": 1, "shards": [{"kind": 0, "copies": [0], "full": True, "saved_by": 0, "files": [NAME]}]}


def _shard(value: float) -> bytes:
    buf = io.BytesIO()
    torch.save({"model": {"w": torch.full((8,), value)}}, buf)
    return buf.getvalue()


def _save(store: CheckpointStore, step: int, value: float) -> None:
    info = store.write(step, NAME, lambda f: f.write(_shard(value)))
    store.finalize(step, [info], layout=LAYOUT)


def _load(found) -> float:
    """The torch adapter's load of a verified checkpoint, as a Guard runs it; the value of ``w``."""
    loaded = {}
    guard = SimpleNamespace(rank=0, device=SimpleNamespace(torch_device=torch.device("cpu")), history={}, sharding=None,
                            state=SimpleNamespace(load_state_dict=loaded.update, load_own=lambda own: None,
                                                  rng_loaded=True))
    guard._resumed_from_storage = functools.partial(Checkpoints._resumed_from_storage, guard)
    Checkpoints._load_stored(guard, found)
    return float(loaded["model"]["w"][0])


def test_a_shard_swapped_after_it_was_verified_is_not_loaded(tmp_path):
    store = CheckpointStore(tmp_path)
    _save(store, 2, 2.0)
    found = store.latest()
    # Between the check and the load: the same name, other bytes (renamed over it, as a swap is made).
    swapped = tmp_path / "swapped"
    swapped.write_bytes(_shard(3.0))
    os.replace(swapped, found.path / NAME)
    try:
        value = _load(found)
    except CheckpointError as e:
        assert "changed after it was verified" in str(e)
        return
    assert value == 2.0, f"loaded {value}: the swapped shard, not the one verified"


def test_a_shard_rewritten_in_place_after_it_was_verified_is_not_loaded(tmp_path):
    store = CheckpointStore(tmp_path)
    _save(store, 2, 2.0)
    found = store.latest()
    data = _shard(3.0)
    assert len(data) == found.manifest["files"][NAME]["bytes"]
    with open(found.path / NAME, "r+b") as f:  # the same inode, other bytes
        f.write(data)
    with pytest.raises(CheckpointError, match="changed after it was verified"):
        _load(found)


def test_the_verified_shard_is_loaded_when_nothing_changed(tmp_path):
    store = CheckpointStore(tmp_path)
    _save(store, 2, 2.0)
    assert _load(store.latest()) == 2.0


def _edit_with_checksum(step_dir: Path, value: float) -> None:
    """What someone who may write the directory does: new bytes, and the manifest's checksum made to match."""
    data = _shard(value)
    (step_dir / NAME).write_bytes(data)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"][NAME].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    manifest["files"][NAME].pop("xxh3", None)
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def test_with_a_key_an_edited_shard_with_its_checksum_recomputed_is_refused(tmp_path, caplog):
    store = CheckpointStore(tmp_path, key=KEY)
    _save(store, 2, 2.0)
    _save(store, 4, 4.0)
    assert store.latest().manifest["mac"]["alg"] == "hmac-sha256"
    _edit_with_checksum(store.final_path(4), 40.0)
    with caplog.at_level(logging.WARNING, logger="trainguard.checkpoint"):
        found = store.latest()
    assert found.step == 2 and _load(found) == 2.0
    assert "step_00000004: refused: its keyed checksum does not match" in caplog.text
    # Another key (a job of another secret) cannot vouch for it either; the key in use is named by its id only.
    with pytest.raises(CheckpointError, match="made with another key"):
        CheckpointStore(tmp_path, key=bytes(32)).verify(store.final_path(2))


def test_without_a_key_a_checkpoint_others_may_write_is_refused(tmp_path, monkeypatch):
    """An unkeyed checksum is anyone's to recompute: it is trusted only where no one else may write."""
    store = CheckpointStore(tmp_path, key=None)
    _save(store, 2, 2.0)
    assert store.latest().step == 2
    os.chmod(store.final_path(2) / NAME, 0o666)
    with pytest.raises(CheckpointError, match="no keyed checksum, and shard_k0_r0.pt may be written by another user"):
        store.verify(store.final_path(2))
    os.chmod(store.final_path(2) / NAME, 0o600)
    os.chmod(tmp_path, 0o777)
    with pytest.raises(CheckpointError, match="other users may rename"):
        CheckpointStore(tmp_path, key=None, writer=False).verify(store.final_path(2))
    monkeypatch.setenv("TRAINGUARD_ALLOW_SHARED_DIRS", "1")
    assert CheckpointStore(tmp_path, key=None).latest().step == 2


def test_a_step_directory_that_is_a_link_out_of_the_checkpoint_directory_fails_verify(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    _save(CheckpointStore(elsewhere, key=None), 3, 3.0)
    ckpt = tmp_path / "ckpt"
    _save(CheckpointStore(ckpt, key=None), 2, 2.0)
    os.symlink(elsewhere / "step_00000003", ckpt / "step_00000003")
    assert CheckpointStore(ckpt, key=None).latest().step == 2
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    out = subprocess.run([sys.executable, "-m", "trainguard.cli", "ckpt", "verify", str(ckpt)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "BROKEN  step_00000003: the step directory is a symbolic link" in out.stdout, \
        out.stdout + out.stderr


def test_a_checkpoint_directory_of_another_user_is_refused_to_a_writer(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("playing a second user needs root")
    from attackers import as_user, free_uid

    base = Path(tempfile.mkdtemp(prefix="tg-ckpt-"))
    os.chmod(base, 0o1777)
    try:
        uid = free_uid()
        assert as_user(uid, f"mkdir -m755 {base}/theirs").returncode == 0
        with pytest.raises(Exception, match=f"belongs to uid {uid}"):
            CheckpointStore(base / "theirs", key=None)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_resumed_job_checks_what_an_earlier_job_of_the_same_key_file_wrote(tmp_path, monkeypatch):
    """The key outlives the job: a key file, or a configured secret; never the launcher's fresh one."""
    from trainguard.core import integrity

    key_file = tmp_path / "project.key"
    key_file.write_text("k" * 32)
    key_file.chmod(0o600)
    env = {"TRAINGUARD_KEY_FILE": str(key_file)}
    first = CheckpointStore(tmp_path / "ckpt", key=integrity.key_from_env(env))
    _save(first, 2, 2.0)
    again = CheckpointStore(tmp_path / "ckpt", key=integrity.key_from_env(env))
    assert integrity.check(again.key, again.latest().manifest, "checkpoint") is None
    token = tmp_path / "token"
    token.write_text("t" * 32)
    token.chmod(0o600)
    assert integrity.key_from_env({"TRAINGUARD_TOKEN_FILE": str(token)}) == \
        integrity.key_from_env({"TRAINGUARD_TOKEN": "t" * 32})
    assert integrity.key_for_workers({}) == "none"  # a single-node job without one: no key, unkeyed manifests
    assert integrity.key_from_env({"TRAINGUARD_CHECKPOINT_KEY": "none", "TRAINGUARD_TOKEN": "fresh" * 8}) is None


TF_SWAP = r"""
import json, os, sys
import tensorflow as tf
from trainguard.adapters.tensorflow.state import Checkpointer
from trainguard.adapters.tensorflow.worker import WorkerInfo

def checkpointer(directory, value):
    v = tf.Variable(tf.fill([64], value))
    return v, Checkpointer(tf.train.Checkpoint(v=v), directory, worker=WorkerInfo(),
                           strategy=tf.distribute.get_strategy())

v, ours = checkpointer(sys.argv[1], 2.0)
ours.save(2)
step = ours.root / "step_00000002"
modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (step, step / "worker_0")}
_, theirs = checkpointer(sys.argv[2], 3.0)
theirs.save(2)
v.assign(tf.fill([64], 0.0))
verify = ours.store.latest

def verified_then_swapped():
    found = verify()
    for name in ("model.index", "model.data-00000-of-00001"):  # the same names, other bytes, once verified
        os.replace(theirs.store.final_path(2) / name, found.path / name)
    return found

ours.store.latest = verified_then_swapped
try:
    ours.restore()
    print(json.dumps({"value": float(v[0]), "modes": modes}))
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}", "modes": modes}))
"""


@pytest.mark.slow  # TensorFlow's start costs 10-50 s here; CI: the linked directory's test below
def test_a_tensorflow_checkpoint_swapped_after_it_was_verified_is_not_loaded(tmp_path):
    """TensorFlow reads a checkpoint by its prefix (model.index, model.data-*): it is given links to the
    files as verified, not the names. (Both files swapped: the index holds CRCs of the data.) Its files lie in
    directories of mode 0700."""
    pytest.importorskip("tensorflow")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    out = subprocess.run([sys.executable, "-c", TF_SWAP, str(tmp_path / "ours"), str(tmp_path / "theirs")],
                         env={**env, "TF_CPP_MIN_LOG_LEVEL": "2"}, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # what TensorFlow writes (0644 files) lies in directories no one else may enter
    assert result["modes"] == {"step_00000002": "0o700", "worker_0": "0o700"}, result["modes"]
    if "error" in result:
        assert "ResumeError" in result["error"] and "changed after it was verified" in result["error"], result
    else:
        assert result["value"] == 2.0, f"loaded {result['value']}: the swapped file, not the one verified"


def test_a_loader_that_reads_by_name_gets_links_to_the_files_as_verified(tmp_path):
    """Verified.linked, what the TensorFlow adapter loads from: the verified bytes, or a refusal, never the
    file at the name by then; the private directory is gone afterwards."""
    store = CheckpointStore(tmp_path / "ckpt")
    _save(store, 2, 2.0)
    found = store.latest()
    with found.linked([NAME]) as private:
        assert (private / NAME).read_bytes() == _shard(2.0)
        assert os.stat(private).st_mode & 0o777 == 0o700
    assert not private.exists()
    swapped = tmp_path / "swapped"
    swapped.write_bytes(_shard(3.0))
    os.replace(swapped, found.path / NAME)
    with pytest.raises(CheckpointError, match="changed after it was verified"):
        with found.linked([NAME]) as private:
            pytest.fail(f"handed over {private} for a file swapped after it was verified")
