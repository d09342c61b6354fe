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
    assert out.returncode == 2 and "elastic node counts" in out.stderr


def test_cli_usage_and_checkpoint_verification(tmp_path):
    assert trainguard().returncode == 2
    assert "run     launch a training script" in trainguard("--help").stdout
    out = trainguard("ckpt", "verify", str(tmp_path))
    assert out.returncode == 1 and "no complete checkpoints" in out.stdout
