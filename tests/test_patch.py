"""``adapters-patch torchrun``: on copies of the installed ``torch/distributed/run.py``
(apply, idempotence, byte-for-byte revert, refusals), then once for real:
plain ``torchrun`` on the patched install recovers a fault in place (and
restarts a killed worker alone) like
``trainguard run``, and the install is restored byte for byte afterwards."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from plain_torchrun import STEPS, others_launching_torchrun, plain_torchrun
from trainguard.patch import cli, core
from trainguard.patch.torchrun import TARGET

VERSION = "2.13.0"
SUPPORTED = "supported: 2.4 <= torch < 2.14"
START = b"# >>> trainguard: added by `adapters-patch torchrun`"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def installed() -> Path:
    """The real torch/distributed/run.py; whatever happens, it must end as it began."""
    path = core.locate(TARGET, sys.executable).path
    before = sha(path.read_bytes())
    assert core.state(path.read_bytes()) == "not patched", f"{path} was patched before the tests started"
    yield path
    after = sha(path.read_bytes())
    if after != before:  # last line of defence: put the original back, then fail loudly
        cli.main(["torchrun", "--revert"])
    assert after == before, f"{path} was left modified by the tests"
    assert not core.backup_path(path).exists(), "a backup was left beside the installed file"


@pytest.fixture
def copy(installed, tmp_path) -> Path:
    dst = tmp_path / "torch" / "distributed" / "run.py"
    dst.parent.mkdir(parents=True)
    shutil.copyfile(installed, dst)
    return dst


def patch(capsys, path: Path, *flags: str, version: str = VERSION) -> tuple[int, str, str]:
    rc = cli.main(["torchrun", "--file", str(path), "--torch-version", version, *flags])
    out, err = capsys.readouterr()
    return rc, out, err


def patched_twin(path: Path) -> bytes:
    """The bytes the patch produces for ``path`` (computed without writing)."""
    return core.plan_apply(TARGET, path, path.read_bytes(), None).new


# ------------------------------------------------------------ apply / revert
def test_apply_is_idempotent_and_revert_restores_the_original_bytes(copy, capsys):
    original = copy.read_bytes()
    rc, out, _ = patch(capsys, copy)
    assert rc == 0 and "done: insert the trainguard block" in out
    once = copy.read_bytes()
    assert once.count(START) == 1 and b"# <<< trainguard <<<" in once
    assert f"original sha256 {sha(original)}".encode() in once
    compile(once, str(copy), "exec")
    assert core.backup_path(copy).read_bytes() == original

    rc, out, _ = patch(capsys, copy)
    assert rc == 0 and "nothing to do: already patched" in out
    assert copy.read_bytes() == once

    rc, out, _ = patch(capsys, copy, "--revert")
    assert rc == 0 and "restore the original from the backup" in out
    assert copy.read_bytes() == original and sha(copy.read_bytes()) == sha(original)
    assert not core.backup_path(copy).exists()


def test_the_block_calls_trainguard_with_the_same_arguments(copy, capsys):
    patch(capsys, copy)
    text = copy.read_text()
    body = text[text.index("def main(args=None):"):]
    assert body.index(START.decode()) < body.index("args = parse_args(args)")
    assert "from trainguard.launcher.run import main as _tg_main" in body
    assert "_tg_main(sys.argv[1:] if args is None else list(args))" in body
    assert 'os.environ.pop("TRAINGUARD_DISABLE"' in body
    assert "except ImportError" in body


def test_revert_of_an_unpatched_file_changes_nothing(copy, capsys):
    original = copy.read_bytes()
    rc, out, _ = patch(capsys, copy, "--revert")
    assert rc == 0 and "nothing to do: not patched" in out
    assert copy.read_bytes() == original


def test_revert_without_the_backup_removes_the_block_exactly(copy, capsys):
    original = copy.read_bytes()
    patch(capsys, copy)
    core.backup_path(copy).unlink()
    rc, out, _ = patch(capsys, copy, "--revert")
    assert rc == 0 and "restore the original by removing the block" in out
    assert copy.read_bytes() == original


def test_edits_inside_the_block_still_revert_exactly(copy, capsys):
    # The recorded hash proves the result, whatever was written between the markers.
    original = copy.read_bytes()
    patch(capsys, copy)
    core.backup_path(copy).unlink()
    copy.write_bytes(copy.read_bytes().replace(b"running plain torchrun", b"hand-edited"))
    rc, _, _ = patch(capsys, copy, "--revert")
    assert rc == 0 and copy.read_bytes() == original


@pytest.mark.parametrize("edit", [
    pytest.param(lambda b: b.replace(b"    run(args)\n", b"    run(args)  # mine\n"), id="edited-outside-the-block"),
    pytest.param(lambda b: b.replace(b"    # <<< trainguard <<<\n", b""), id="end-marker-deleted"),
    pytest.param(lambda b: b.replace(b"original sha256 ", b"original sha256 0"), id="hash-edited"),
])
def test_a_block_that_cannot_be_removed_exactly_is_refused(copy, capsys, edit):
    patch(capsys, copy)
    core.backup_path(copy).unlink()
    copy.write_bytes(edit(copy.read_bytes()))
    edited = copy.read_bytes()
    for flags in (("--revert",), ()):
        rc, _, err = patch(capsys, copy, *flags)
        assert rc == 2 and "reinstall torch to get a clean file" in err, err
        assert copy.read_bytes() == edited
    assert not core.backup_path(copy).exists()


def test_other_edits_block_a_reapply_and_revert_says_it_discards_them(copy, capsys):
    original = copy.read_bytes()
    patch(capsys, copy)
    copy.write_bytes(copy.read_bytes().replace(b"    run(args)\n", b"    run(args)  # mine\n"))
    edited = copy.read_bytes()
    rc, _, err = patch(capsys, copy)  # applying again would have to discard them: refused
    assert rc == 2 and "was edited after it was patched" in err and "--revert` restores the original" in err
    assert copy.read_bytes() == edited
    rc, out, _ = patch(capsys, copy, "--revert")
    assert rc == 0 and "other edits besides the block; they are discarded" in out
    assert copy.read_bytes() == original


def test_an_older_block_is_replaced_cleanly(copy, capsys):
    original, fresh = copy.read_bytes(), patched_twin(copy)
    older = fresh.replace(b"running plain torchrun", b"an older message")
    copy.write_bytes(older)  # as an older trainguard left it, without a backup
    rc, out, _ = patch(capsys, copy)
    assert rc == 0 and "done: replace the trainguard block" in out
    assert copy.read_bytes() == fresh
    assert core.backup_path(copy).read_bytes() == original


RUN_PATCHED = """
import importlib.util, os, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "trainguard" and os.environ.get("BLOCK_TRAINGUARD"):
            raise ImportError("trainguard blocked by the test")
sys.meta_path.insert(0, Block())
spec = importlib.util.spec_from_file_location("patched_run", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.main(["--help"])
print("TRAINGUARD_DISABLE left:", os.environ.get("TRAINGUARD_DISABLE"))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env, via_trainguard, warned", [
    ({}, True, False),
    ({"TRAINGUARD_DISABLE": "1"}, False, False),
    ({"BLOCK_TRAINGUARD": "1"}, False, True),
], ids=["enabled", "disabled", "trainguard-missing"])
def test_the_patched_main_routes_or_falls_through(copy, capsys, env, via_trainguard, warned):
    patch(capsys, copy)
    full = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    out = subprocess.run([sys.executable, "-c", RUN_PATCHED, str(copy)], capture_output=True, text=True,
                         env={**full, **env}, timeout=100)
    assert out.returncode == 0, out.stderr
    assert ("--controller-host" in out.stdout) == via_trainguard  # trainguard run's own flag in --help
    assert ("trainguard: cannot import trainguard (trainguard blocked by the test); running plain torchrun"
            in out.stderr) == warned
    assert "TRAINGUARD_DISABLE left: None" in out.stdout  # taken out, so workers never see it


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("version", ["1.13.0", "2.3.1+cu121", "2.14.0", "2.14.0a0+git1234", "3.0"])
def test_unsupported_versions_are_refused(copy, capsys, version):
    original = copy.read_bytes()
    rc, _, err = patch(capsys, copy, version=version)
    assert rc == 2
    assert f"torch {version} is not supported" in err and SUPPORTED in err
    assert copy.read_bytes() == original and not core.backup_path(copy).exists()


@pytest.mark.parametrize("version", ["2.4.0", "2.13.0+cpu", "2.13.1+cu128"])
def test_supported_versions_pass_the_check(copy, capsys, version):
    rc, out, _ = patch(capsys, copy, "--check", version=version)
    assert rc == 0 and "action:  insert the trainguard block" in out


@pytest.mark.parametrize("edit, how", [
    (lambda b: b.replace(b"def main(args=None):", b"def main(argv=None):"), "was not found"),
    (lambda b: b + b"\n\ndef main(args=None):\n    pass\n", "was found 2 times"),
])
def test_a_changed_file_is_refused(copy, capsys, edit, how):
    copy.write_bytes(edit(copy.read_bytes()))
    changed = copy.read_bytes()
    rc, _, err = patch(capsys, copy)
    assert rc == 2 and f"the line `def main(args=None):` {how}" in err and "changed by someone else" in err
    assert copy.read_bytes() == changed and not core.backup_path(copy).exists()


def test_a_read_only_install_is_refused(copy, capsys, monkeypatch):
    # Root writes through chmod, so the writability test itself is replaced here.
    original = copy.read_bytes()
    monkeypatch.setattr(core, "is_writable", lambda path: False)
    for flags in (("--check",), ()):
        rc, _, err = patch(capsys, copy, *flags)
        assert rc == 2 and "is read-only" in err
    assert copy.read_bytes() == original and not core.backup_path(copy).exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_a_read_only_directory_is_refused(copy, capsys):
    original = copy.read_bytes()
    copy.chmod(0o444)
    copy.parent.chmod(0o555)
    try:
        rc, _, err = patch(capsys, copy)
    finally:
        copy.parent.chmod(0o755)
    assert rc == 2 and "is read-only" in err
    assert copy.read_bytes() == original


def test_a_failed_write_leaves_the_file_and_no_backup(copy, capsys, monkeypatch):
    original, write = copy.read_bytes(), core._write_atomic

    def refuse_the_file(path, data, mode):
        if path == copy:
            raise PermissionError(13, "Permission denied", str(path))
        write(path, data, mode)

    monkeypatch.setattr(core, "_write_atomic", refuse_the_file)
    rc, _, err = patch(capsys, copy)
    assert rc == 2 and "cannot write" in err and "Permission denied" in err
    assert copy.read_bytes() == original and not core.backup_path(copy).exists()


def test_writes_keep_the_file_mode_and_leave_no_temporary_files(copy, capsys):
    copy.chmod(0o640)
    patch(capsys, copy)
    assert copy.stat().st_mode & 0o777 == 0o640
    patch(capsys, copy, "--revert")
    assert copy.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in copy.parent.iterdir()) == ["run.py"]


# ------------------------------------------------------- --check and --python
def test_check_prints_the_plan_and_changes_nothing(copy, capsys):
    original = copy.read_bytes()
    rc, out, _ = patch(capsys, copy, "--check")
    assert rc == 0
    for line in (f"file:    {copy}", f"torch:   {VERSION} ({SUPPORTED})", "state:   not patched",
                 "action:  insert the trainguard block after `def main(args=None):`"):
        assert line in out, out
    assert copy.read_bytes() == original and not core.backup_path(copy).exists()

    patch(capsys, copy)
    patched = copy.read_bytes()
    rc, out, _ = patch(capsys, copy, "--check", "--revert")
    assert rc == 0 and "state:   patched" in out and "action:  restore the original from the backup" in out
    assert copy.read_bytes() == patched


def test_check_of_an_unsupported_version_fails_with_the_reason(copy, capsys):
    rc, out, err = patch(capsys, copy, "--check", version="1.13.0")
    assert rc == 2 and "torch:   1.13.0" in out and "not supported" in err


@pytest.mark.parametrize("python, message", [
    ("/nonexistent/python", "cannot run the Python interpreter /nonexistent/python"),
    ("/bin/false", "the Python interpreter /bin/false failed (exit code 1)"),
])
def test_a_bad_interpreter_is_refused(capsys, python, message):
    rc = cli.main(["torchrun", "--check", "--python", python])
    assert rc == 2 and message in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_an_environment_without_torch_is_refused(tmp_path, capsys):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "env")], check=True, timeout=100)
    python = tmp_path / "env" / "bin" / "python"
    rc = cli.main(["torchrun", "--check", "--python", str(python)])
    assert rc == 2 and f"torch is not installed in the environment of {python}" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_python_option_finds_the_installed_torch(installed, capsys):
    rc = cli.main(["torchrun", "--check", "--python", sys.executable])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"file:    {installed}" in out and f"torch:   {VERSION}" in out and "state:   not patched" in out


def test_help_lists_the_targets(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "torchrun" in out and "msrun" in out


def test_the_patch_package_imports_no_framework():
    code = ("import sys\n"
            "import trainguard.patch.cli\n"
            "assert not {'torch', 'mindspore', 'megatron'} & {m.split('.')[0] for m in sys.modules}\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr


# ------------------------------------------------------- end to end, for real
@pytest.mark.timeout(240)
def test_plain_torchrun_on_the_patched_install_recovers_like_trainguard_run(installed, job_runner, tmp_path):
    if others := others_launching_torchrun():
        pytest.skip(f"other processes use this install's torchrun; patching it would reroute them: {others[:2]}")
    reference = job_runner("ref", nproc=2, steps=STEPS)
    assert reference.rc == 0, reference
    original = installed.read_bytes()
    try:
        assert cli.main(["torchrun"]) == 0
        assert core.state(installed.read_bytes()) == "patched"

        out, report = plain_torchrun(tmp_path, "patched", {"TRAINGUARD_FAULT": "uce:rank=1,step=3,phase=backward"})
        log = out.stdout + out.stderr
        assert out.returncode == 0, log[-6000:]
        assert "all 2 ranks registered" in log  # trainguard's controller ran
        (record,) = report["recoveries"]
        assert (record["fault"], record["rank"], record["step"], record["strategy"]) == ("uce", 1, 3, "retry")
        assert record["lost_steps"] == 0 and report["lost_steps"] == 0
        assert all(len(pids) == 1 for pids in report["pids"].values()), "a process was restarted"
        assert report["steps_completed"] == STEPS
        assert report["final_state_sha256"] == reference.report["final_state_sha256"]

        # A killed worker: plain torchrun now restarts that one process alone.
        out, report = plain_torchrun(tmp_path, "killed", {"TRAINGUARD_FAULT": "crash:rank=1,step=3",
                                                           "TRAINGUARD_STRATEGIES": "recover-in-place,dump"},
                                      ("--max-restarts", "1"))
        log = out.stdout + out.stderr
        assert out.returncode == 0, log[-6000:]
        (record,) = report["recoveries"]
        assert (record["fault"], record["rank"], record["strategy"]) == ("process_lost", 1, "recover-in-place")
        assert len(report["pids"]["0"]) == 1 and len(report["pids"]["1"]) == 2
        assert report["final_state_sha256"] == reference.report["final_state_sha256"]

        # A bug in the script at the same step on every launch: one dump, one restart, then it stops (exit 1)
        # instead of spending --max-restarts on the same failure (no restart loops).
        out, report = plain_torchrun(tmp_path, "loop", {"TINY_BUG": "1,4", "TRAINGUARD_STRATEGIES": "dump,exit"},
                                     ("--max-restarts", "3"))
        log = out.stdout + out.stderr
        assert out.returncode == 1, log[-6000:]
        assert log.count("rank 1 left step 4") == 2, log[-6000:]
        assert "the same fault (unknown ValueError) failed the launch before at the same step" in log

        out, report = plain_torchrun(tmp_path, "disabled", {"TRAINGUARD_DISABLE": "1"})
        log = out.stdout + out.stderr
        assert out.returncode == 0, log[-6000:]
        assert "all 2 ranks registered" not in log and "no trainguard controller in this job" in log
        assert report["recoveries"] == [] and report["steps_completed"] == STEPS
        assert report["final_state_sha256"] == reference.report["final_state_sha256"]
    finally:
        reverted = cli.main(["torchrun", "--revert"])
    assert reverted == 0
    assert installed.read_bytes() == original
    assert sha(installed.read_bytes()) == sha(original)
    assert not core.backup_path(installed).exists()
