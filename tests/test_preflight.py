"""Start-up checks: what can be proven wrong before step 0 is a clear error
then, on every rank, before any collective a rank could wait in.

An unwritable ``checkpoint_dir`` (found before only when a dying gasp needed
it: the fault showed as UNKNOWN and the ranks exited 76), a fault for a rank
the job does not have (the rehearsal ran to exit 0 without a word), and a
fault in a phase the adapter cannot strike (refused by the targeted rank
alone while its peer waited in a collective). The jobs are real: 2 gloo
ranks under ``trainguard run`` or plain torchrun, 2 msrun workers in
MindSpore's graph mode.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import WORKERS, run_bounded
from ms_jobs import run_ms
from trainguard.core import ConfigError
from trainguard.core.faults import FaultInjector, FaultSpec

HAS_MINDSPORE = importlib.util.find_spec("mindspore") is not None  # find_spec does not import it


def refused_by(log: str) -> dict[int, str]:
    """rank -> the ConfigError its uncaught traceback ended with (torch's
    elastic workers prefix their stderr with ``[rankN]:``)."""
    found = re.findall(r"^\[rank(\d+)\]: trainguard\.core\.api\.ConfigError: (.*)$", log, re.MULTILINE)
    return {int(rank): message for rank, message in found}


def mount_tmpfs(path: Path, options: str, request) -> bool:
    """Mount a small tmpfs at ``path`` until the test ends; ``False`` where
    mounting is not allowed (it needs CAP_SYS_ADMIN)."""
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode:
        return False
    request.addfinalizer(lambda: subprocess.run(["umount", "-l", str(path)], check=True))
    return True


def fill(directory: Path) -> None:
    """Write into ``directory`` until its filesystem is full."""
    with open(directory / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e


@pytest.fixture
def refusing_dir(tmp_path, request) -> tuple[Path, str]:
    """An existing directory in which even root cannot create a file, and
    the system's reason: a read-only tmpfs, or where mounting is not allowed,
    sysfs (it has no files but the kernel's)."""
    if mount_tmpfs(tmp_path / "ro", "ro,size=1m", request):
        return tmp_path / "ro", "Read-only file system"
    sysfs = Path("/sys/kernel")
    try:
        os.close(os.open(sysfs / "trainguard-test", os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    except OSError as e:
        return sysfs, e.strerror
    os.unlink(sysfs / "trainguard-test")
    pytest.skip("no directory here refuses root's files: no tmpfs mount, and sysfs takes files")


# ------------------------------------------------------------- checkpoint_dir
def test_a_checkpoint_dir_is_created_and_left_as_it_was(tmp_path):
    from trainguard.core.preflight import check_checkpoint_dir

    root = check_checkpoint_dir(tmp_path / "a" / "b")
    assert root.is_dir() and list(root.iterdir()) == []
    (root / "kept").write_text("x")
    check_checkpoint_dir(root)
    assert [p.name for p in root.iterdir()] == ["kept"]  # the probe is gone


@pytest.mark.parametrize("where, reason", [
    ("below a file", "cannot be created (Not a directory)"),
    ("a file", "is not a directory"),
    ("under /proc", "cannot be created (No such file or directory)"),
])
def test_a_checkpoint_dir_that_cannot_be_made_is_refused(tmp_path, where, reason):
    from trainguard.core.preflight import check_checkpoint_dir

    (tmp_path / "file").write_text("x")
    path = {"below a file": tmp_path / "file" / "ckpt", "a file": tmp_path / "file",
            "under /proc": Path("/proc/trainguard-test/ckpt")}[where]
    with pytest.raises(ConfigError, match=re.escape(f"checkpoint_dir {path} {reason}")):
        check_checkpoint_dir(path)


def test_a_checkpoint_dir_that_refuses_files_is_refused(refusing_dir):
    from trainguard.core.preflight import check_checkpoint_dir

    path, reason = refusing_dir
    with pytest.raises(ConfigError, match=re.escape(f"checkpoint_dir {path} is not writable ({reason})")):
        check_checkpoint_dir(path)


def test_a_checkpoint_dir_on_a_full_disk_is_refused(tmp_path, request):
    from trainguard.core.preflight import check_checkpoint_dir

    path = tmp_path / "full"
    if not mount_tmpfs(path, "size=16k", request):
        pytest.skip("mounting a tmpfs needs CAP_SYS_ADMIN")
    fill(path)
    with pytest.raises(ConfigError, match=re.escape(f"checkpoint_dir {path} is not writable (No space left on "
                                                    f"device)")):
        check_checkpoint_dir(path)
    assert [p.name for p in path.iterdir()] == ["filler"]  # the probe that could not be written is gone


@pytest.mark.timeout(240)
@pytest.mark.parametrize("where", ["below a file", "refusing files"])
def test_an_unwritable_checkpoint_dir_stops_every_rank_before_step_0(job_runner, tmp_path, request, where):
    if where == "below a file":
        (tmp_path / "file").write_text("x")
        ckpt, reason = tmp_path / "file" / "ckpt", "cannot be created (Not a directory)"
    else:
        ckpt, reason = request.getfixturevalue("refusing_dir")
        reason = f"is not writable ({reason})"
    # The user's case: the dump strategy is what needs the directory.
    job = job_runner("unwritable", nproc=2, steps=6, ckpt=ckpt, fault="uce:rank=1,step=3,phase=backward",
                     strategies="dump,exit")
    assert job.rc == 1 and job.report is None, job
    refused = refused_by(job.log)
    assert sorted(refused) == [0, 1], job  # each rank by itself, none released by a peer's death
    assert all(m.startswith(f"checkpoint_dir {ckpt} {reason}") for m in refused.values()), refused
    assert "fault: rank" not in job.log and "exits with code" not in job.log, job  # no step ran, nothing to recover
    assert not ckpt.is_dir() or not [p for p in ckpt.iterdir() if "trainguard" in p.name or "step" in p.name]


# ------------------------------------------------------------- fault specs
def test_a_fault_for_a_rank_outside_the_job_is_refused_by_every_rank():
    specs = FaultSpec.parse("crash:rank=1,step=2;uce:rank=5,step=3")
    for rank in (0, 1):
        with pytest.raises(ConfigError, match=re.escape("fault 'uce:rank=5,step=3,phase=forward' is for rank 5, but "
                                                        "the world size is 2 (ranks 0-1)")):
            FaultInjector(specs, rank, world_size=2)
    assert FaultInjector(specs, 0, world_size=6).specs == tuple(specs)


def test_a_phase_the_adapter_cannot_strike_is_refused_by_every_rank():
    specs = FaultSpec.parse("uce:rank=1,step=3,phase=reduce;stall:rank=0,step=4")
    # wants() is this rank's own: asking it alone let rank 0 train on and wait for rank 1 in a collective.
    assert not FaultInjector(specs, 0).wants("reduce")
    for rank in (0, 1):
        injector = FaultInjector(specs, rank, world_size=2)
        with pytest.raises(ConfigError, match=re.escape("fault 'uce:rank=1,step=3,phase=reduce': not here")):
            injector.refuse("not here", phases=("reduce",))
        with pytest.raises(ConfigError, match=re.escape("fault 'stall:rank=0,step=4,phase=forward': no stall")):
            injector.refuse("no stall", kinds=("stall",))
        injector.refuse("backward is fine", phases=("backward",))


def trainguard_run(tmp_path: Path, fault: str, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env["TRAINGUARD_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "trainguard.cli", "run", *extra, str(WORKERS / "tiny_train.py"),
                           "6", "r.json", "ck"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)


@pytest.mark.parametrize("fault, named, world", [
    ("uce:rank=5,step=3", "uce:rank=5,step=3,phase=forward", ("--nproc-per-node", "2")),
    ("crash:rank=1,step=1;hang:rank=2,step=4", "hang:rank=2,step=4,phase=forward", ("--nproc-per-node", "2")),
    ("uce:rank=2,step=3", "uce:rank=2,step=3,phase=forward", ("--nnodes", "1", "--nproc-per-node", "2")),
])
def test_the_launcher_refuses_a_fault_for_a_rank_the_job_does_not_have(tmp_path, fault, named, world):
    out = trainguard_run(tmp_path, fault, *world)
    assert out.returncode == 2, out.stderr[-3000:]
    rank = named.split("rank=")[1].split(",")[0]
    assert [line for line in out.stderr.splitlines() if line.startswith("trainguard run:")] == [
        f"trainguard run: fault '{named}' is for rank {rank}, but the world size is 2 (ranks 0-1): it would never "
        f"strike"]
    assert "worker rank" not in out.stderr and not (tmp_path / "ck").exists()  # nothing was started


@pytest.mark.timeout(240)
def test_workers_refuse_it_too_where_no_launcher_checked(tmp_path):
    """Plain torchrun checks no fault: each rank's Guard does, before its first collective."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update({"TRAINGUARD_FAULT": "uce:rank=5,step=3", "PYTHONUNBUFFERED": "1"})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--monitor-interval", "0.1", str(WORKERS / "tiny_train.py"), "6", str(tmp_path / "r.json"),
           str(tmp_path / "ck")]
    out = run_bounded(cmd, env=env, cwd=tmp_path, timeout=180)
    log = out.stdout + out.stderr
    assert out.returncode != 0 and not (tmp_path / "r.json").exists(), log[-6000:]
    refused = refused_by(log)
    assert sorted(refused) == [0, 1], log[-6000:]
    assert all(m.startswith("fault 'uce:rank=5,step=3,phase=forward' is for rank 5, but the world size is 2")
               for m in refused.values()), refused


@pytest.mark.timeout(240)
def test_phase_reduce_on_one_rank_is_refused_by_every_torch_rank(job_runner):
    job = job_runner("reduce", nproc=2, steps=6, fault="uce:rank=1,step=3,phase=reduce")
    assert job.rc == 1 and job.report is None, job
    refused = refused_by(job.log)
    assert sorted(refused) == [0, 1], job  # rank 0 too, instead of a comm fault and exit 76
    assert all(m.startswith("fault 'uce:rank=1,step=3,phase=reduce': phase=reduce is the MindSpore Guard's")
               for m in refused.values()), refused
    assert "fault: rank" not in job.log and "exits with code" not in job.log, job


# ------------------------------------------------------------- MindSpore
needs_mindspore = pytest.mark.skipif(not HAS_MINDSPORE, reason="mindspore is not installed")


@needs_mindspore
@pytest.mark.timeout(240)
def test_a_graph_mode_backward_fault_is_refused_by_every_mindspore_rank(tmp_path):
    job = run_ms(tmp_path, "graph", fault="uce:rank=1,step=3,phase=backward", script=WORKERS / "ms_model_train.py",
                 steps=3, env={"TEST_MS_MODE": "graph"})
    assert job.rc == 1 and job.report is None, job
    workers = dict(re.findall(r"^--- worker_(\d)\.log\n(.*?)(?=^--- |\Z)", job.log, re.MULTILINE | re.DOTALL))
    assert sorted(workers) == ["0", "1"], job
    for text in workers.values():  # printed by the script on each rank: neither waited in its all-reduce
        assert "a backward or reduce fault cannot be injected in graph mode" in text, job
        assert "ConfigError: fault 'uce:rank=1,step=3,phase=backward': " in text, job
    assert "exits with code" not in job.log and not job.ckpt.exists(), job


@needs_mindspore
@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault, where, message", [
    ("stall:rank=0,step=2", "ckpt", "fault 'stall:rank=0,step=2,phase=forward': the MindSpore Guard cannot "
                                    "black-hole a rank's collectives"),
    ("", "file/ckpt", "checkpoint_dir {tmp}/file/ckpt cannot be created (Not a directory)"),
])
def test_the_mindspore_guard_refuses_before_its_first_collective(tmp_path, fault, where, message):
    (tmp_path / "file").write_text("x")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "MS_"))}
    if fault:
        env["TRAINGUARD_FAULT"] = fault
    done = subprocess.run([sys.executable, str(WORKERS / "ms_guard_start.py"), str(tmp_path / where)], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 3, done.stdout + done.stderr[-3000:]
    assert f"ConfigError: {message.format(tmp=tmp_path)}" in done.stdout, done.stdout
    assert not (tmp_path / "ckpt").exists()


@needs_mindspore
@pytest.mark.timeout(240)
@pytest.mark.parametrize("net", ["random", "dense"])
def test_the_mindspore_guard_names_random_ops_whose_streams_no_recovery_sets_back(tmp_path, net):
    """``nn.Dropout`` keeps its random state inside MindSpore's kernel,
    which trainguard cannot save or set: the Guard says so before the first
    step, and its report lists them; a network without such ops starts quietly.
    So do ``nn.Dropout1d/2d/3d`` and ``ops.dropout2d`` (MindSpore marks their
    ``Dropout2D``/``Dropout3D`` neither random nor seeded: they were not
    named); the functional ``ops.dropout`` (op seeds, which a retry sets
    back) is not named."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "MS_"))}
    done = subprocess.run([sys.executable, str(WORKERS / "ms_guard_start.py"), str(tmp_path / "ckpt"), net], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    warning = ("1.dropout keep their random state inside MindSpore's kernels, which trainguard cannot save or set: "
               "steps redone or resumed after a fault draw other numbers there than a run without the fault would")
    if net == "random":
        named = ["1.dropout", "2 (calls ops.dropout1d)", "3.dropout2d", "4.dropout3d", "5 (calls ops.dropout2d)"]
        assert f"started {named}" in done.stdout, done.stdout + done.stderr[-3000:]
        assert ", ".join(named) + warning[len("1.dropout"):] in done.stderr, done.stderr[-3000:]
    else:
        assert "started []" in done.stdout and "keep their random state" not in done.stderr, done.stderr[-3000:]
