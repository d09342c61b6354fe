"""Another user on the node cannot make a job's snapshot directory write
through links they planted (issue 24, item 3).

``/dev/shm`` is writable by everyone: a user who guessed a job's directory
name could make it first (0777) and fill it with links to files of the
job's user, who then wrote through them. These tests play that user with a
second uid (one no account has) against a root job, in a root directory
made like ``/dev/shm`` (1777).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from trainguard.core import CheckpointError, ConfigError, RankConfig
from trainguard.core.snapshot import SnapshotDir, sweep
from trainguard.core.snapshot import shm as shm_module

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="playing a second user needs root (to switch uid)")

PRECIOUS = b"root's precious file\n"


@pytest.fixture
def root():
    """A root like /dev/shm (sticky, writable by everyone), in shared memory."""
    path = Path(tempfile.mkdtemp(prefix="tg-shm-security-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def attacker():
    """Run a shell command as a uid no account has (nor any group but its own)."""
    uid = next(u for u in range(61_000, 65_000) if not _taken(u))

    def run(command: str) -> subprocess.CompletedProcess:
        return subprocess.run(["/bin/sh", "-c", command], user=uid, group=uid, extra_groups=[], cwd="/",
                              env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=30)
    run.uid = uid
    return run


def _taken(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


@pytest.fixture
def victims(tmp_path):
    """Two root-owned files only root may write."""
    files = [tmp_path / "victim-a", tmp_path / "victim-b"]
    for f in files:
        f.write_bytes(PRECIOUS)
        f.chmod(0o644)
    return files


def _listing(path: Path) -> list[tuple]:
    """What a planted directory holds: names, owners, link targets, contents."""
    out = []
    for p in sorted(path.iterdir()):
        st = os.lstat(p)
        out.append((p.name, st.st_uid, os.readlink(p) if p.is_symlink() else p.read_bytes()))
    return out


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_planted_directory_is_not_used_and_is_left_untouched(root, attacker, victims):
    """The attack as reported: the old name, made 0777 by another user, with
    links named like the files the job writes there."""
    planted = root / "trainguard-job-n0"
    me = {"pid": os.getpid(), "start": shm_module._start_time(os.getpid()), "host": socket.gethostname(),
          "job": "job-n0"}
    lure = root / "trainguard-job-n0-0123456789abcdef"  # the new pattern, "owned" by this very process
    out = attacker(f"mkdir -m777 {planted} && ln -s {victims[0]} {planted}/owner.json.tmp && "
                   f"ln -s {victims[1]} {planted}/r0.s0 && ln -s {victims[1]} {planted}/owner.json && "
                   f"mkdir -m777 {lure} && printf '%s' '{json.dumps(me)}' > {lure}/owner.json && "
                   f"ln -s {victims[0]} {lure}/r0.s0")
    assert out.returncode == 0, out.stderr
    before = {p: _listing(p) for p in (planted, lure)}
    directory = SnapshotDir.create("job-n0", root)
    try:
        assert directory.path not in (planted, lure)
        assert directory.path.name.startswith("trainguard-job-n0-") and directory.path.parent == root
        st = os.lstat(directory.path)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
        directory.slot(0, 0).reserve(4096)
        assert [v.read_bytes() for v in victims] == [PRECIOUS, PRECIOUS]
        assert {p: _listing(p) for p in (planted, lure)} == before
        assert all(os.lstat(p).st_uid == attacker.uid for p in (planted, lure))
    finally:
        directory.remove()


def test_the_directory_is_private_whatever_the_umask_and_owner_json_is_0600(root, attacker, victims):
    old = os.umask(0)
    try:
        directory = SnapshotDir.create("job-private", root)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.lstat(directory.path).st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(directory.path / "peer").st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(directory.path / "owner.json").st_mode) == 0o600
        # The other user cannot plant anything in it, nor even look.
        for command in (f"ln -s {victims[0]} {directory.path}/r0.s1", f"mkdir {directory.path}/x",
                        f"ln -s {victims[0]} {directory.path}/peer/r0", f"ls {directory.path}"):
            assert attacker(command).returncode != 0, command
        assert sorted(p.name for p in directory.path.iterdir()) == ["owner.json", "peer"]
    finally:
        directory.remove()


def test_a_name_that_is_taken_is_stepped_around(root, attacker, monkeypatch):
    names = iter(["aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"])
    monkeypatch.setattr(shm_module.secrets, "token_hex", lambda n: next(names))
    taken = root / "trainguard-job-aaaaaaaaaaaaaaaa"
    assert attacker(f"mkdir -m777 {taken}").returncode == 0
    directory = SnapshotDir.create("job", root)
    try:
        assert directory.path == root / "trainguard-job-bbbbbbbbbbbbbbbb"
        assert list(taken.iterdir()) == []
    finally:
        directory.remove()


def test_attach_refuses_a_directory_others_can_write_a_link_or_another_users(root, attacker, victims):
    good = SnapshotDir.create("job-attach", root)
    try:
        assert SnapshotDir.attach(good.path).path == good.path
        # Root's own directory, but open to everyone: the other user can plant links in it.
        open_dir = root / "trainguard-open"
        open_dir.mkdir()
        open_dir.chmod(0o777)
        (open_dir / "owner.json").write_text(json.dumps({"pid": os.getpid()}))
        assert attacker(f"ln -s {victims[0]} {open_dir}/r0.s0").returncode == 0
        with pytest.raises(ConfigError, match="mode 777, open to other users"):
            SnapshotDir.attach(open_dir)
        # The other user's directory (TRAINGUARD_SNAPSHOT_DIR pointed there).
        theirs = root / "trainguard-theirs"
        assert attacker(f"mkdir -m700 {theirs} && echo '{{}}' > {theirs}/owner.json").returncode == 0
        with pytest.raises(ConfigError, match=f"belongs to uid {attacker.uid}"):
            SnapshotDir.attach(theirs)
        # A link to our own good directory is refused too: it could be re-pointed at any time.
        link = root / "trainguard-link"
        assert attacker(f"ln -s {good.path} {link}").returncode == 0
        with pytest.raises(ConfigError, match="is a symbolic link"):
            SnapshotDir.attach(link)
        assert [v.read_bytes() for v in victims] == [PRECIOUS, PRECIOUS]
    finally:
        good.remove()


def test_a_link_at_a_slot_name_is_not_followed(root, victims):
    directory = SnapshotDir.create("job-links", root)
    try:
        os.symlink(victims[0], directory.path / "r0.s0")
        os.symlink(directory.path / "made-through-the-link", directory.path / "r0.s1")  # dangling
        os.symlink(victims[1], directory.path / "peer" / "r0")
        for slot in (directory.slot(0, 0), directory.slot(0, 1)):
            with pytest.raises(CheckpointError, match="symbolic link"):
                slot.reserve(4096)
            with pytest.raises(CheckpointError, match="symbolic link"):
                slot.lock(True)
            slot.close()
        with pytest.raises(CheckpointError, match="symbolic link"):
            directory.peer_copy(0).info()
        assert [v.read_bytes() for v in victims] == [PRECIOUS, PRECIOUS]
        assert not (directory.path / "made-through-the-link").exists()
    finally:
        directory.remove()


def test_the_sweep_ignores_another_users_directory_and_links(root, attacker, tmp_path):
    dead = {"pid": _dead_pid(), "start": 1, "host": socket.gethostname(), "job": "x"}
    theirs = root / "trainguard-theirs"
    assert attacker(f"mkdir -m755 {theirs} && printf '%s' '{json.dumps(dead)}' > {theirs}/owner.json").returncode == 0
    elsewhere = tmp_path / "elsewhere"  # root's, with a dead owner, behind a link the other user made
    elsewhere.mkdir()
    (elsewhere / "owner.json").write_text(json.dumps(dead))
    (elsewhere / "keep").write_bytes(PRECIOUS)
    link = root / "trainguard-link"
    assert attacker(f"ln -s {elsewhere} {link}").returncode == 0
    ours = root / "trainguard-ours-dead"
    ours.mkdir(mode=0o700)
    (ours / "owner.json").write_text(json.dumps(dead))
    assert sweep(root) == [ours]
    assert not ours.exists()
    assert json.loads((theirs / "owner.json").read_text()) == dead and os.lstat(theirs).st_uid == attacker.uid
    assert link.is_symlink() and (elsewhere / "keep").read_bytes() == PRECIOUS
    directory = SnapshotDir.create("job-sweep", root)  # (it sweeps too)
    directory.remove()
    assert theirs.is_dir() and link.is_symlink()


def test_a_root_others_may_rename_entries_in_is_refused(tmp_path):
    """Without the sticky bit another user could swap the directory for a
    link between our checks and our writes."""
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    with pytest.raises(ConfigError, match="not sticky"):
        SnapshotDir.create("job-loose", loose)
    assert list(loose.iterdir()) == []


def test_mindspores_repair_file_sweep_leaves_links_and_other_users_files_alone(root, attacker, victims):
    """The MindSpore repair's file (a replica's state for a rank on the same
    machine): its sweep of files left by dead processes removes only ours;
    another user's file and a link planted under the same pattern stay."""
    handlers = pytest.importorskip("trainguard.adapters.mindspore.handlers")
    dead = _dead_pid()
    assert attacker(f"echo theirs > {root}/trainguard-job-{dead}-step3.state").returncode == 0
    os.symlink(victims[0], root / f"trainguard-job-{dead}-step4.state")
    ours = root / f"trainguard-job-{dead}-step5.state"
    ours.write_bytes(b"left by a dead repair")
    handlers._remove_stale(root)
    assert not ours.exists(), "our own leftover is removed"
    assert (root / f"trainguard-job-{dead}-step3.state").read_text() == "theirs\n"
    assert os.path.islink(root / f"trainguard-job-{dead}-step4.state") and victims[0].read_bytes() == PRECIOUS


def test_mindspores_repair_file_goes_to_the_nodes_private_directory(monkeypatch, tmp_path):
    handlers = pytest.importorskip("trainguard.adapters.mindspore.handlers")
    private = tmp_path / "node"
    private.mkdir(mode=0o700)
    monkeypatch.setenv("TRAINGUARD_SNAPSHOT_DIR", str(private))
    assert handlers._repair_dir(RankConfig.from_env().node_dir) == private  # the Guard reads it once
    monkeypatch.delenv("TRAINGUARD_SNAPSHOT_DIR")
    assert handlers._repair_dir(RankConfig.from_env().node_dir) == Path(handlers.SHM)
