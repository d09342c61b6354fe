"""`trainguard run` and the CLI refuse bad input before starting anything."""

import subprocess
import sys

import pytest

from conftest import WORKERS


def trainguard(*args, env=None, cwd=None):
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "trainguard.cli", *args], capture_output=True, text=True,
                          env=full, cwd=cwd, timeout=120)


@pytest.mark.parametrize("env, message", [
    ({"TRAINGUARD_STRATEGY": "dump"}, "unknown setting TRAINGUARD_STRATEGY; did you mean TRAINGUARD_STRATEGIES?"),
    ({"TRAINGUARD_FAULT": "uce:rank=1"}, "bad fault 'uce:rank=1': missing step"),
    ({"TRAINGUARD_STRATEGIES": "retry,reboot"}, "unknown recover strategy 'reboot'"),
    ({"TRAINGUARD_HEARTBEAT_INTERVAL_S": "-1"}, "heartbeat_interval_s must be > 0"),
    ({"TRAINGUARD_SPARE_SLOTS": "two"}, "TRAINGUARD_SPARE_SLOTS='two' must be a whole number >= 0"),
    ({"TRAINGUARD_STANDBY": "maybe"}, "TRAINGUARD_STANDBY='maybe': use on or off"),
])
def test_bad_settings_stop_the_launch_with_a_clear_message(tmp_path, env, message):
    out = trainguard("run", "--nproc-per-node", "2", str(WORKERS / "tiny_train.py"), "2", "r.json", "ck",
                     env=env, cwd=tmp_path)
    assert out.returncode == 2
    assert message in out.stderr
    assert not (tmp_path / "ck").exists()


def test_elastic_node_ranges_are_refused(tmp_path):
    out = trainguard("run", "--nnodes", "1:2", "--nproc-per-node", "1", str(WORKERS / "tiny_train.py"), "1",
                     "r.json", "ck", cwd=tmp_path)
    assert out.returncode == 2 and "but a node range" in out.stderr


def test_cli_usage_and_checkpoint_verification(tmp_path):
    assert trainguard().returncode == 2
    assert "run     launch a training script" in trainguard("--help").stdout
    out = trainguard("ckpt", "verify", str(tmp_path))
    assert out.returncode == 1 and "no complete checkpoints" in out.stdout


# ------------------------------------------------------------ what a job prints
def _loud(stderr: str) -> list[str]:
    """The lines a user would read as trouble: warnings, errors, tracebacks,
    torch's own W/E lines."""
    import re

    return [line for line in stderr.splitlines()
            if re.search(r" (WARNING|ERROR|CRITICAL) |Traceback|^[WE]\d{4} |Exception in", line)]


@pytest.mark.parametrize("fault, code, outcome, budget", [
    ("", 0, None, None),
    ("comm:rank=1,step=3", 0, "fault: rank 1: comm: RuntimeError: SUSPECT REMOTE ERROR", None),
    ("crash:rank=1,step=3", 0, "fault: rank 1: process lost", None),  # the default: restarted in place
    ("crash:rank=1,step=3", 75, "fault: rank 1: process lost", "0"),
])
def test_a_clean_run_prints_no_warning_and_a_handled_fault_one_line(tmp_path, fault, code, outcome, budget):
    """No warning at all in a clean run (none for the agent leaving, for
    torchrun's OMP_NUM_THREADS, for an unused compile cache, no "Event loop
    is closed" at exit); a fault trainguard handles is one WARNING line with
    its cause and outcome, and its tracebacks stay at DEBUG."""
    out = trainguard("run", "--nproc-per-node", "2", *(("--max-restarts", budget) if budget else ()),
                     str(WORKERS / "tiny_train.py"), "6", "r.json", "ck",
                     env={"TRAINGUARD_FAULT": fault} if fault else {}, cwd=tmp_path)
    assert out.returncode == code, out.stderr[-4000:]
    loud = _loud(out.stderr)
    if outcome is None:
        assert loud == [], loud
    else:
        assert len(loud) == 1, loud
        then = {"comm": " -> retry: training resumed at step 3", "crash": " -> recover-in-place: training resumed at "
                "step 3"}[fault.split(":")[0]] if code == 0 else " -> dump: job exiting: "
        assert outcome in loud[0] and then in loud[0], loud[0]
