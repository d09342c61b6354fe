"""A compile-cache entry rewritten by another user is never run (issue 41, item 2).

Before, an entry was trusted when its files matched the SHA-256 in its own
``manifest.json``: anyone who could write the cache (by default inside the
checkpoint directory) could rewrite a file and its checksum, and the next
launch loaded their code ("compile cache hit"). Here that other user's
writes are files owned by a second uid.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from trainguard.core.compile_cache import CompileCache, Lookup

PARTS = {"framework": "test", "model_code": "abc"}
SECRET = "cache-" + "ef" * 20
PAYLOAD = "\nimport os; os.system('touch /tmp/pwned')  # appended by another user\n"


def _publish(root: Path, tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "kernel.py").write_text("def kernel():\n    return 1\n")
    (src / "sub" / "lib.so").write_bytes(b"\x7fELF" + bytes(64))
    cache = CompileCache(root, PARTS, owner="rank 0")
    assert cache.publish(src)
    return cache.entry


def _forge(entry: Path, uid: int) -> None:
    """What the other user does: code appended to a file, the manifest's checksum made to match; theirs."""
    kernel = entry / "files" / "kernel.py"
    data = kernel.read_bytes() + PAYLOAD.encode()
    kernel.unlink()
    kernel.write_bytes(data)
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["files"]["kernel.py"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (entry / "manifest.json").unlink()
    (entry / "manifest.json").write_text(json.dumps(manifest))
    for path in [entry, *entry.rglob("*")]:
        os.chown(path, uid, uid)
        os.chmod(path, 0o777 if path.is_dir() else 0o666)


def _restored(root: Path, tmp_path: Path, caplog) -> tuple[Lookup, str]:
    dest = tmp_path / "dest"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir()
    cache = CompileCache(root, PARTS, owner="rank 0")
    with caplog.at_level(logging.INFO, logger="trainguard.compile_cache"):
        state = cache.restore(dest)
    kernel = dest / "kernel.py"
    return state, kernel.read_text() if kernel.exists() else ""


@pytest.fixture
def other_uid():
    if os.geteuid() != 0:
        pytest.skip("playing a second user needs root (to give it files)")
    from attackers import free_uid

    return free_uid()


@pytest.mark.parametrize("keyed", [True, False], ids=["with a key", "without a key"])
def test_an_entry_another_user_rewrote_is_not_run(tmp_path, monkeypatch, caplog, other_uid, keyed):
    if keyed:
        monkeypatch.setenv("TRAINGUARD_TOKEN", SECRET)  # a configured secret: the key of the entries
        monkeypatch.setenv("TRAINGUARD_ALLOW_SHARED_DIRS", "1")  # a cache the team shares, on purpose
    root = tmp_path / "cache"
    entry = _publish(root, tmp_path)
    os.chmod(root, 0o777)  # others may write in it
    # The entry as published: used when its keyed checksum vouches for it; without one, not in such a directory.
    assert _restored(root, tmp_path, caplog)[0] is (Lookup.HIT if keyed else Lookup.INVALID)
    _forge(entry, other_uid)
    state, kernel = _restored(root, tmp_path, caplog)
    assert PAYLOAD not in kernel, "the other user's code was restored into the framework's cache"
    assert state is Lookup.INVALID
    assert ("refused: its keyed checksum does not match" if keyed else "carries no keyed checksum") in caplog.text


def test_a_private_entry_without_a_key_is_used(tmp_path, caplog):
    root = tmp_path / "cache"
    _publish(root, tmp_path)
    assert oct(os.stat(root).st_mode & 0o777) == "0o700"
    state, kernel = _restored(root, tmp_path, caplog)
    assert state is Lookup.HIT and "def kernel" in kernel


def test_an_entry_published_under_another_key_is_not_used(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TRAINGUARD_TOKEN", SECRET)
    root = tmp_path / "cache"
    _publish(root, tmp_path)
    monkeypatch.setenv("TRAINGUARD_TOKEN", "another-" + "0" * 30)
    state, kernel = _restored(root, tmp_path, caplog)
    assert state is Lookup.INVALID and kernel == "" and "made with another key" in caplog.text
