"""Files a root job writes where another user may write (issue 41, items 3
and 4, and the token file of item 6).

A second uid (one no account has) plays the other user. Before: a planted
``events.jsonl`` link made the job append to a root-only file, and in a
directory that user owned to create one; a ``report.png`` link made
``trainguard report`` overwrite one; ``events.jsonl`` was made 0644; the
owner of a sticky snapshot root renamed the job's directory and linked its
name to their own, and the job wrote every snapshot into their files.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from attackers import as_user, free_uid
from trainguard.core import ConfigError
from trainguard.core.events import EventLog

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="playing a second user needs root (to switch uid)")

PRECIOUS = b"root's precious file\n"


@pytest.fixture
def shared():
    """A directory like /tmp (sticky, everyone may write), the other user's uid, and a command runner as it."""
    path = Path(tempfile.mkdtemp(prefix="tg-private-"))
    os.chmod(path, 0o1777)
    uid = free_uid()

    def run(command: str) -> None:
        out = as_user(uid, command)
        assert out.returncode == 0, out.stderr
    run.uid = uid
    yield path, run
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def victim(tmp_path):
    """A file only root may write."""
    f = tmp_path / "victim"
    f.write_bytes(PRECIOUS)
    f.chmod(0o600)
    return f


def _events_log():
    """Warnings of the events logger (trainguard's loggers may not propagate)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger("trainguard.events").addHandler(handler)
    return records, handler


# ------------------------------------------------------------ the run directory
@pytest.mark.parametrize("owner", ["theirs", "root's sticky"])
def test_a_planted_events_link_is_not_written_through(shared, victim, owner):
    root, attacker = shared
    run_dir = root / "run" if owner == "theirs" else root
    if owner == "theirs":
        attacker(f"mkdir -m777 {run_dir}")
    attacker(f"ln -s {victim} {run_dir}/events.jsonl")
    records, handler = _events_log()
    try:
        log = EventLog(run_dir)
        log.write("launch", argv=["train.py", "--secret-flag"])
        log.write("exit", code=0)
    finally:
        logging.getLogger("trainguard.events").removeHandler(handler)
    assert victim.read_bytes() == PRECIOUS
    assert os.path.islink(run_dir / "events.jsonl")
    assert len(records) == 1, [r.getMessage() for r in records]  # said once, then no more tries
    assert ("belongs to uid" if owner == "theirs" else "events.jsonl") in records[0].getMessage()


def test_a_run_directory_of_another_user_is_refused_before_the_job_starts(shared, tmp_path):
    root, attacker = shared
    attacker(f"mkdir -m755 {root}/theirs")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    out = subprocess.run([sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "1", "--run-dir",
                          str(root / "theirs"), "train.py"], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and f"belongs to uid {attacker.uid}" in out.stderr, out.stderr[-2000:]


def test_the_events_file_and_its_directory_are_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        EventLog(tmp_path / "run").write("launch", argv=["train.py"])
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "run").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "run" / "events.jsonl").st_mode) == 0o600


# ------------------------------------------------------------ trainguard report
def test_report_does_not_write_its_picture_through_a_link(shared, victim):
    pytest.importorskip("matplotlib")
    root, attacker = shared
    run_dir = root / "run"
    attacker(f"mkdir -m777 {run_dir} && printf '%s\\n' '{{\"t\": 1, \"ev\": \"launch\"}}' "
             f"'{{\"t\": 2, \"ev\": \"exit\", \"code\": 0}}' > {run_dir}/events.jsonl && "
             f"ln -s {victim} {run_dir}/report.png")
    out = subprocess.run([sys.executable, "-m", "trainguard.cli", "report", str(run_dir)], capture_output=True,
                         text=True, timeout=120)
    assert victim.read_bytes() == PRECIOUS
    assert out.returncode == 1 and f"belongs to uid {attacker.uid}" in out.stderr, out.stderr[-2000:]
    # In a directory of root's own, a link left at the name is replaced, not written through.
    mine = root / "mine"
    mine.mkdir(mode=0o755)
    shutil.copy(run_dir / "events.jsonl", mine / "events.jsonl")
    os.symlink(victim, mine / "report.png")
    out = subprocess.run([sys.executable, "-m", "trainguard.cli", "report", str(mine)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert victim.read_bytes() == PRECIOUS
    assert not os.path.islink(mine / "report.png") and (mine / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert stat.S_IMODE(os.stat(mine / "report.png").st_mode) == 0o600


# ------------------------------------------------------------ the snapshot root
def test_a_snapshot_root_of_another_user_is_refused(shared, victim):
    """The attack as reported: the other user owns a sticky root; once the
    job made its directory there, they rename it and put a link to a
    directory of theirs at its name."""
    from trainguard.core.snapshot import SnapshotDir

    base, attacker = shared
    root = base / "shm"
    attacker(f"mkdir -m1777 {root} && mkdir -m777 {base}/theirs")
    try:
        directory = SnapshotDir.create("job-n0", root)
    except ConfigError as e:
        assert f"belongs to uid {attacker.uid}" in str(e)
        return
    try:  # before: accepted; what follows is what the owner of the root then did
        attacker(f"mv {directory.path} {root}/moved && ln -s {base}/theirs {directory.path}")
        slot = directory.slot(0, 0)
        slot.reserve(4096)
        slot.close()
        written = list((base / "theirs").iterdir())
        assert not written, f"the job wrote its snapshot into the other user's directory: {written}"
    finally:
        shutil.rmtree(root / "moved", ignore_errors=True)
    pytest.fail("a snapshot root of another user was accepted")


# ------------------------------------------------------------ the token file
def test_a_token_file_open_to_others_or_of_another_user_is_refused(shared, tmp_path, caplog):
    from trainguard.core.secret import configured_secret

    root, attacker = shared
    secret = "t0ken-" + "9" * 30
    f = tmp_path / "token"
    f.write_text(secret)
    for mode, refused in ((0o644, True), (0o604, True), (0o620, True), (0o600, False), (0o400, False),
                          (0o640, False)):
        f.chmod(mode)
        if refused:
            with pytest.raises(ConfigError, match="open to other users"):
                configured_secret({"TRAINGUARD_TOKEN_FILE": str(f)})
        else:
            with caplog.at_level(logging.WARNING, logger="trainguard.secret"):
                assert configured_secret({"TRAINGUARD_TOKEN_FILE": str(f)}) == secret
    assert "readable by its group" in caplog.text  # 0640: allowed, said
    attacker(f"printf '%s' {secret} > {root}/theirs && chmod 600 {root}/theirs && ln -s {root}/theirs {root}/link")
    for path in (root / "theirs", root / "link"):  # theirs, or a link to theirs
        with pytest.raises(ConfigError, match=f"belongs to uid {attacker.uid}"):
            configured_secret({"TRAINGUARD_TOKEN_FILE": str(path)})
    link = tmp_path / "k8s-link"  # a Kubernetes Secret is a link into the volume's data: followed
    f.chmod(0o400)
    link.symlink_to(f)
    assert configured_secret({"TRAINGUARD_TOKEN_FILE": str(link)}) == secret
