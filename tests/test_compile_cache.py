"""The framework-free compile cache: keys, validation of entries (mismatched,
partial, truncated, corrupt: ignored with one warning, never restored) and
concurrent publishers leaving one valid entry."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
from pathlib import Path

import pytest

from trainguard.core import ConfigError
from trainguard.core.compile_cache import MANIFEST, CompileCache, LocalCache, Lookup, cache_key, resolve_root

PARTS = {"framework": "torch", "torch": "2.13.0", "device": "cpu", "model_code": "abc", "config": {"batch": [16]}}


def artifacts(path: Path, scale: int = 1) -> Path:
    """A framework cache directory as a compile leaves it."""
    (path / "fxgraph" / "ab").mkdir(parents=True)
    (path / "fxgraph" / "ab" / "entry").write_bytes(b"graph" * 100 * scale)
    (path / "kernel.so").write_bytes(os.urandom(4096))
    (path / "locks").mkdir()
    (path / "locks" / "kernel.lock").write_bytes(b"")
    return path


def published(root: Path, tmp: Path, parts=PARTS) -> CompileCache:
    cache = CompileCache(root, parts)
    assert cache.restore(tmp / "empty") is Lookup.MISS
    assert cache.publish(artifacts(tmp / "src"), skip=("locks",))
    return cache


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_published_entry_is_restored_file_for_file(tmp_path):
    root = tmp_path / "cache"
    first = published(root, tmp_path)
    assert first.counters["published"] == 1 and first.state is Lookup.MISS
    again = CompileCache(root, dict(PARTS))
    dest = tmp_path / "dest"
    dest.mkdir()
    assert again.restore(dest) is Lookup.HIT, again.reason
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == [
        "fxgraph/ab/entry", "kernel.so"]  # the lock directory is never published
    assert (dest / "kernel.so").read_bytes() == (tmp_path / "src" / "kernel.so").read_bytes()
    assert again.report()["hits"] == 1 and again.report()["restored"]["files"] == 2
    assert not list(root.glob(".tmp-*"))


def test_the_key_follows_every_part():
    assert cache_key(PARTS) == cache_key(dict(reversed(list(PARTS.items()))))
    assert cache_key(PARTS).startswith("torch-")
    for change in ({"torch": "2.12.0"}, {"model_code": "abd"}, {"config": {"batch": [32]}}, {"device": "cuda"}):
        assert cache_key({**PARTS, **change}) != cache_key(PARTS), change
    with pytest.raises(ConfigError, match="JSON"):
        cache_key({**PARTS, "config": object()})


def test_another_version_or_model_finds_no_entry(tmp_path):
    root = tmp_path / "cache"
    published(root, tmp_path)
    for change in ({"torch": "2.12.0"}, {"model_code": "another model"}):
        other = CompileCache(root, {**PARTS, **change})
        assert other.restore(tmp_path / f"d-{len(change)}") is Lookup.MISS


@pytest.mark.parametrize("damage, says", [
    ("torch-version", "torch='2.12.0' (this process: '2.13.0')"),
    ("truncate", "truncated"),
    ("flip", "checksum"),
    ("no-manifest", "partial"),
    ("bad-manifest", "unreadable"),
    ("escape", "outside the entry"),
    ("missing-file", "missing"),
])
def test_an_unusable_entry_is_ignored_with_one_warning_and_rebuilt(tmp_path, caplog, damage, says):
    root = tmp_path / "cache"
    entry = published(root, tmp_path).entry
    manifest = json.loads((entry / MANIFEST).read_text())
    kernel = entry / "files" / "kernel.so"
    if damage == "torch-version":  # an entry made by another torch, found under this key
        manifest["parts"]["torch"] = "2.12.0"
        (entry / MANIFEST).write_text(json.dumps(manifest))
    elif damage == "truncate":
        kernel.write_bytes(kernel.read_bytes()[:100])
    elif damage == "flip":
        data = bytearray(kernel.read_bytes())
        data[7] ^= 1
        kernel.write_bytes(bytes(data))
    elif damage == "no-manifest":
        (entry / MANIFEST).unlink()
    elif damage == "bad-manifest":
        (entry / MANIFEST).write_text('{"format": 1, "parts": ')
    elif damage == "escape":
        manifest["files"]["../../outside"] = manifest["files"].pop("kernel.so")
        (entry / MANIFEST).write_text(json.dumps(manifest))
    elif damage == "missing-file":
        kernel.unlink()

    caplog.set_level(logging.INFO, logger="trainguard.compile_cache")
    cache = CompileCache(root, dict(PARTS), owner="rank 1")
    dest = tmp_path / "dest"
    dest.mkdir()
    assert cache.restore(dest) is Lookup.INVALID
    assert says in cache.reason
    assert list(dest.iterdir()) == []  # nothing unchecked is left for the framework to load
    [warning] = warnings(caplog)
    assert warning.startswith("rank 1: compile cache not used, compiling afresh") and says in warning

    # The process compiles afresh and its publication replaces the bad entry.
    assert cache.publish(artifacts(tmp_path / "fresh"), skip=("locks",))
    again = CompileCache(root, dict(PARTS))
    assert again.restore(tmp_path / "dest2") is Lookup.HIT, again.reason
    assert not list(root.glob(".trash-*")) and not list(root.glob(".tmp-*"))


def test_other_ranks_log_an_unusable_entry_at_info(tmp_path, caplog):
    root = tmp_path / "cache"
    (published(root, tmp_path).entry / MANIFEST).unlink()
    caplog.set_level(logging.INFO, logger="trainguard.compile_cache")
    assert CompileCache(root, dict(PARTS), warn=False).restore(tmp_path / "d") is Lookup.INVALID
    assert warnings(caplog) == []
    assert any("compile cache not used" in r.getMessage() for r in caplog.records)


def test_nothing_compiled_publishes_nothing(tmp_path):
    (tmp_path / "src" / "locks").mkdir(parents=True)
    cache = CompileCache(tmp_path / "cache", PARTS)
    assert not cache.publish(tmp_path / "src", skip=("locks",))
    assert not cache.entry.exists()


def _publish_at_once(root: str, src: str, barrier, results) -> None:
    cache = CompileCache(root, PARTS, owner=f"pid {os.getpid()}")
    cache.restore(Path(src) / "restore")  # every rank finds no entry, compiles, publishes
    barrier.wait()
    results.put(cache.publish(Path(src) / "art", skip=("locks",)))


@pytest.mark.timeout(120)
def test_ranks_publishing_at_once_leave_one_valid_entry(tmp_path):
    root, ranks = tmp_path / "cache", 4
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(ranks), ctx.Queue()
    procs = []
    for r in range(ranks):
        src = tmp_path / f"rank{r}"
        artifacts(src / "art", scale=50)  # same names, same sizes, as ranks compiling one model
        (src / "restore").mkdir()
        procs.append(ctx.Process(target=_publish_at_once, args=(str(root), str(src), barrier, results)))
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sorted(outcomes) == [False] * (ranks - 1) + [True]
    reader = CompileCache(root, PARTS)
    assert reader.restore(tmp_path / "check") is Lookup.HIT, reader.reason
    assert [p.name for p in root.iterdir()] == [reader.key]  # no half-written copies left


def test_where_the_cache_lives(tmp_path):
    env = {"TRAINGUARD_COMPILE_CACHE": str(tmp_path / "env")}
    assert resolve_root(None, tmp_path / "ckpt", {}) == tmp_path / "ckpt" / ".trainguard" / "compile_cache"
    assert not (tmp_path / "ckpt").exists()  # the default place is made by the first publication
    assert resolve_root(None, tmp_path / "ckpt", env) == tmp_path / "env"
    assert resolve_root(tmp_path / "arg", tmp_path / "ckpt", env) == tmp_path / "arg"  # the argument wins
    assert resolve_root(None, None, {}) is None
    assert resolve_root(False, tmp_path / "ckpt", env) is None
    assert resolve_root(None, tmp_path / "ckpt", {"TRAINGUARD_COMPILE_CACHE": "off"}) is None
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="cannot be created"):
        resolve_root(tmp_path / "file" / "sub", None, {})
    with pytest.raises(ConfigError, match="not a directory"):
        resolve_root(tmp_path / "file", None, {})


def test_a_private_directory_per_process_published_once_and_removed(tmp_path):
    root = tmp_path / "cache"
    local = LocalCache(root, PARTS, prefix="trainguard-test-cache-")
    assert local.local.is_dir() and local.local.name.startswith(f"trainguard-test-cache-{os.getpid()}-")
    artifacts(local.local)
    local.after_step()
    local.after_step()  # once only
    assert local.report()["published"] == 1 and local.report()["state"] == "miss"
    local.close()
    assert not Path(local.local_name).exists()
    off = LocalCache(None, {}, prefix="trainguard-test-cache-")
    off.after_step()
    assert off.report() == {"state": "off"} and off.local is None
