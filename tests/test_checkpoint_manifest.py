"""A manifest is read without trusting it: each malformed one, a file named
outside its checkpoint or reached through a link, and a layout that does not
cover its world is a corrupt checkpoint. ``latest()`` skips it with the
reason for the older sound one, ``trainguard ckpt verify`` reports it
(no traceback, exit 1), and ``finalize()`` never writes one."""

import hashlib
import json
import logging
import os
import re

import pytest

from trainguard.cli import main
from trainguard.core import CheckpointError, CheckpointStore
from trainguard.core.checkpoint import FileInfo
from trainguard.core.manifest import MAX_BYTES

NAMES = ("shard_k0_r0.pt", "shard_k0_r1.pt")


def shard(rank, names, *, copies=None, full=False, kind=0):
    return {"kind": kind, "copies": copies or [rank], "full": full, "saved_by": rank, "files": list(names)}


def per_rank(*names):
    """Rank i saved the i-th file, its own shard."""
    return {"world_size": len(names), "shards": [shard(i, [n]) for i, n in enumerate(names)]}


def save(store, step, names=NAMES):
    infos = [store.write(step, n, lambda f, n=n: f.write(b"x" * 1000 + n.encode())) for n in names]
    return store.finalize(step, infos, layout=per_rank(*names))


def rewrite(step_dir, edit):
    manifest = json.loads((step_dir / "manifest.json").read_text())
    edit(manifest)
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def record_of(path):
    data = path.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def outside(step_dir):
    """A file beside the checkpoints, equal to a shard of it."""
    out = step_dir.parent / "outside.pt"
    out.write_bytes((step_dir / NAMES[1]).read_bytes())
    return out


def name_outside(step_dir, name):
    out = outside(step_dir)
    rewrite(step_dir, lambda m: m["files"].__setitem__(name(out), record_of(out)))


def link_shard(step_dir):
    out = outside(step_dir)
    (step_dir / NAMES[1]).unlink()
    (step_dir / NAMES[1]).symlink_to(out)


def link_subdir(step_dir):
    (step_dir.parent / "elsewhere").mkdir()
    (step_dir.parent / "elsewhere" / "f.pt").write_bytes(b"weights")
    (step_dir / "rank_1").symlink_to(step_dir.parent / "elsewhere")
    rewrite(step_dir, lambda m: m["files"].__setitem__("rank_1/f.pt", record_of(step_dir / "rank_1" / "f.pt")))


def link_manifest(step_dir):
    (step_dir.parent / "manifest.json").write_bytes((step_dir / "manifest.json").read_bytes())
    (step_dir / "manifest.json").unlink()
    (step_dir / "manifest.json").symlink_to(step_dir.parent / "manifest.json")


def fifo_manifest(step_dir):
    (step_dir / "manifest.json").unlink()
    os.mkfifo(step_dir / "manifest.json")  # opening it for reading would wait for a writer forever


def oversized(step_dir):
    rewrite(step_dir, lambda m: m["meta"].__setitem__("pad", "x" * MAX_BYTES))


def deep(step_dir):
    text = (step_dir / "manifest.json").read_text()
    (step_dir / "manifest.json").write_text(text[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}")


def set_record(name, value):
    return lambda d: rewrite(d, lambda m: m["files"].__setitem__(name, value))


def edit_record(edit):
    """``edit`` rewrites shard 0's true record (its real size and checksum)."""
    return lambda d: rewrite(d, lambda m: edit(m["files"][NAMES[0]]))


def nested_name(step_dir):
    (step_dir / "a" / "b").mkdir(parents=True)
    (step_dir / "a" / "b" / "c.pt").write_bytes(b"deeper than a writer puts a file")
    rewrite(step_dir, lambda m: m["files"].__setitem__("a/b/c.pt", record_of(step_dir / "a" / "b" / "c.pt")))


def set_key(key, value):
    return lambda d: rewrite(d, lambda m: m.__setitem__(key, value))


def only_rank_0(step_dir):
    """What a rank that trained on alone after its peer failed finalised:
    its own shard, in a world of 2."""
    def edit(m):
        del m["files"][NAMES[1]]
        m["layout"]["shards"] = m["layout"]["shards"][:1]
    rewrite(step_dir, edit)
    (step_dir / NAMES[1]).unlink()


DAMAGE = {
    "invalid utf-8": (lambda d: (d / "manifest.json").write_bytes(b'{"format": "\xff\xfe"}'), "not UTF-8"),
    "entry is a string": (set_record(NAMES[0], "1014 bytes"), "record is str, not an object"),
    "entry is a list": (set_record(NAMES[0], [1014, "ab"]), "record is list, not an object"),
    "entry is a number": (set_record(NAMES[0], 1014), "record is int, not an object"),
    "deep nesting": (deep, "nested deeper than"),
    "absolute name": (lambda d: name_outside(d, str), "is an absolute path"),
    "dot-dot name": (lambda d: name_outside(d, lambda p: f"../{p.name}"), "no empty, '.' or '..' part"),
    "too deep a name": (nested_name, "must be 'file' or 'subdir/file'"),
    "symlinked shard": (link_shard, "shard_k0_r1.pt is a symbolic link (refused"),
    "symlinked subdir": (link_subdir, "rank_1/f.pt lies under a symbolic link"),
    "symlinked manifest": (link_manifest, "manifest.json is a symbolic link (refused"),
    "fifo manifest": (fifo_manifest, "manifest.json is not a regular file"),
    "bytes a string": (edit_record(lambda r: r.update(bytes=str(r["bytes"]))), "is not a whole number of bytes"),
    "bytes a float": (edit_record(lambda r: r.update(bytes=float(r["bytes"]))), "is not a whole number of bytes"),
    "short sha256": (edit_record(lambda r: r.update(sha256=r["sha256"][:8])), "not 64 lowercase hex digits"),
    "no checksum": (edit_record(lambda r: r.pop("sha256")), "has no checksum"),
    "step a float": (set_key("step", 7.0), "manifest says step 7.0, its directory step 7"),
    "meta a list": (set_key("meta", []), "meta (or its history) is not an object"),
    "history a list": (set_key("meta", {"history": []}), "meta (or its history) is not an object"),
    "no layout": (set_key("layout", {}), "manifest has no layout"),
    "layout a list": (set_key("layout", []), "manifest has no layout"),
    "shard not an object": (set_key("layout", {"world_size": 1, "shards": ["all"]}), "shard 0 is str"),
    "shard names an unlisted file": (set_key("layout", {"world_size": 1, "shards": [shard(0, ["x.pt"])]}),
                                     "names 'x.pt', which the manifest does not list"),
    "oversized": (oversized, f"is over {MAX_BYTES >> 20} MiB"),
    "rank 0 of a world of 2": (only_rank_0, "partial checkpoint: its shards of state kind 0 hold 1 of the 2 ranks"),
}


@pytest.fixture
def two_checkpoints(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt")
    save(store, 3)
    return store, save(store, 7)


@pytest.mark.parametrize("damage, why", DAMAGE.values(), ids=DAMAGE.keys())
def test_corrupt_manifest_is_skipped_for_the_older_checkpoint(two_checkpoints, caplog, damage, why):
    store, newest = two_checkpoints
    damage(newest)
    with pytest.raises(CheckpointError, match="step_00000007: .*" + re.escape(why)):
        store.verify(newest)
    with caplog.at_level(logging.WARNING, logger="trainguard.checkpoint"):
        assert store.latest().step == 3
    assert any("skipping checkpoint" in r.message and why in r.message for r in caplog.records), caplog.text


@pytest.mark.parametrize("damage, why", DAMAGE.values(), ids=DAMAGE.keys())
def test_ckpt_verify_reports_it_with_the_reason_and_fails(two_checkpoints, capsys, damage, why):
    store, newest = two_checkpoints
    damage(newest)
    assert main(["ckpt", "verify", str(store.root)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("BROKEN  step_00000007: ") and why in lines[0], lines
    assert lines[1] == f"ok      {store.root / 'step_00000003'}", lines


def test_finalize_refuses_a_layout_that_does_not_cover_its_world(tmp_path):
    store = CheckpointStore(tmp_path)
    save(store, 3)
    info = store.write(15, NAMES[0], lambda f: f.write(b"rank 0 alone"))
    with pytest.raises(CheckpointError, match="cannot finalise .*step_00000015_tmp: a partial checkpoint: its shards "
                                              "of state kind 0 hold 1 of the 2 ranks .*none holds rank 1"):
        store.finalize(15, [info], layout={"world_size": 2, "shards": [shard(0, [NAMES[0]])]})
    assert store.tmp_path(15).is_dir() and not store.final_path(15).exists()
    assert store.tracked_step() == 3 and store.latest().step == 3


@pytest.mark.parametrize("layout, why", [
    (None, "manifest has no layout"),
    ({"world_size": 2, "shards": [shard(0, NAMES)]}, "hold 1 of the 2 ranks"),
    ({"world_size": 2, "shards": [shard(0, NAMES), shard(0, [], kind=1, copies=[1])]}, "state kind 0 hold 1 of"),
    ({"world_size": 2, "shards": [shard(0, ["rng_r1.pt"], copies=[0, 1])]}, "names 'rng_r1.pt', which the"),
    ({"world_size": True, "shards": [shard(0, NAMES, copies=[0])]}, "not a whole number of ranks"),
])
def test_finalize_writes_only_what_verify_accepts(tmp_path, layout, why):
    store = CheckpointStore(tmp_path)
    infos = [store.write(1, n, lambda f: f.write(b"w")) for n in NAMES]
    with pytest.raises(CheckpointError, match=re.escape(why)):
        store.finalize(1, infos, layout=layout)
    assert store.tracked_step() is None and store.steps() == []


def test_finalize_refuses_a_record_without_a_checksum(tmp_path):
    store = CheckpointStore(tmp_path)
    store.write(1, NAMES[0], lambda f: f.write(b"w"))
    with pytest.raises(CheckpointError, match="xxh3 is not a 64-bit unsigned integer"):
        store.finalize(1, [FileInfo(NAMES[0], 1, "", None)], layout=per_rank(NAMES[0]), rehash=False)


@pytest.mark.parametrize("names, layout", [
    # torch, data parallel: rank 0 saves the one full shard, rank 1 its random streams only
    (["shard_k0_r0.pt", "rng_r1.pt"], {"world_size": 2, "shards": [shard(0, ["shard_k0_r0.pt"], copies=[0, 1],
                                                                         full=True)]}),
    # elastic: rank 1 is gone; the full shard still names it among its copies
    (["shard_k0_r0.pt"], {"world_size": 2, "shards": [shard(0, ["shard_k0_r0.pt"], copies=[0, 1], full=True)]}),
    # megatron, tensor parallel 2 x data parallel 2: a full shard per data-parallel group
    (["mp_rank_00/model_optim_rng.pt", "mp_rank_01/model_optim_rng.pt"],
     {"world_size": 4, "shards": [shard(0, ["mp_rank_00/model_optim_rng.pt"], copies=[0, 2], full=True),
                                  shard(1, ["mp_rank_01/model_optim_rng.pt"], copies=[1, 3], full=True)]}),
    # megatron with experts and a dense optimizer: the dense shards' state is in the expert files
    (["mp_rank_00_000/model_optim_rng.pt", "mp_rank_00_001/model_optim_rng.pt"],
     {"world_size": 2, "shards": [shard(0, [], copies=[0, 1], full=True),
                                  shard(0, ["mp_rank_00_000/model_optim_rng.pt"], copies=[0], kind=1, full=True),
                                  shard(1, ["mp_rank_00_001/model_optim_rng.pt"], copies=[1], kind=1, full=True)]}),
])
def test_every_writers_layout_is_finalised_and_verified(tmp_path, names, layout):
    store = CheckpointStore(tmp_path)
    infos = [store.write(5, n, lambda f, n=n: f.write(n.encode())) for n in names]
    store.finalize(5, infos, layout=layout)
    assert store.latest().step == 5 and store.latest().manifest["layout"] == layout


def test_a_full_shard_of_one_data_parallel_group_does_not_cover_the_world(tmp_path):
    """Megatron, tensor parallel 2: the shard of tensor rank 1 is lost."""
    store = CheckpointStore(tmp_path)
    info = store.write(5, "mp_rank_00/model_optim_rng.pt", lambda f: f.write(b"tp0"))
    with pytest.raises(CheckpointError, match="hold 2 of the 4 ranks of its world \\(none holds rank 1\\)"):
        store.finalize(5, [info], layout={"world_size": 4, "shards": [shard(0, [info.name], copies=[0, 2],
                                                                            full=True)]})
