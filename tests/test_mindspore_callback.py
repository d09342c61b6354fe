"""``Model.train`` under trainguard's ``TrainFaultTolerance`` callback
(2 msrun workers, CPU), in PyNative and in graph mode: a device memory error
retried in place, a killed worker dumped and the relaunch resumed mid-epoch,
each ending bit-identical to a fault-free run in the same mode; and what is
refused.

MindSpore is never imported into the test process: every job is a subprocess."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import WORKERS, _assert_no_stray_processes
from ms_jobs import MsJob, run_ms

if importlib.util.find_spec("mindspore") is None:  # find_spec does not import it
    pytest.skip("mindspore is not installed", allow_module_level=True)

SCRIPT = WORKERS / "ms_model_train.py"
EPOCHS = 3  # of 2 batches: 6 steps; a fault at step 3 lands in epoch 1, batch 1


def run_model_train(tmp: Path, name: str, *, fault: str | None = None, ckpt: Path | None = None,
                    mode: str = "pynative", env: dict | None = None) -> MsJob:
    """``trainguard run --framework mindspore`` of the worker, 2 processes,
    in ``mode`` (``pynative`` or ``graph``)."""
    return run_ms(tmp, name, fault=fault, ckpt=ckpt, script=SCRIPT, steps=EPOCHS,
                  env={"TEST_MS_MODE": mode, **(env or {})})


def run_alone(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    """``python ARGS``: one MindSpore process, no launcher."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "MS_"))}
    return subprocess.run([sys.executable, *args], env=env, cwd=tmp, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> MsJob:
    tmp = tmp_path_factory.mktemp("ms-model-baseline")
    job = run_model_train(tmp, "baseline")
    assert job.rc == 0 and job.report is not None, job
    assert job.report["steps_completed"] == 2 * EPOCHS and job.report["recoveries"] == [], job
    _assert_no_stray_processes(tmp)
    return job


@pytest.fixture(scope="module")
def graph_baseline(tmp_path_factory) -> MsJob:
    tmp = tmp_path_factory.mktemp("ms-model-graph-baseline")
    job = run_model_train(tmp, "baseline", mode="graph")
    assert job.rc == 0 and job.report is not None, job
    assert job.report["steps_completed"] == 2 * EPOCHS and job.report["recoveries"] == [], job
    _assert_no_stray_processes(tmp)
    return job


@pytest.mark.timeout(240)
@pytest.mark.parametrize("check, message", [
    ("sink", "dataset_sink_mode=True needs sink_size=1 (got 2, 2 steps a sink)"),
    ("unwrapped", "TrainFaultTolerance needs the Model's optimizer wrapped: Model(net, loss_fn, "
                  "optimizer=OptTFTWrapper(opt))"),
    ("graph-backward", "a backward or reduce fault cannot be injected in graph mode"),
])
def test_refused_before_training(tmp_path, check, message):
    done = run_alone(tmp_path, str(SCRIPT), str(EPOCHS), str(tmp_path / "r.json"), str(tmp_path / "ckpt"), check)
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stdout.startswith("ConfigError: ") and message in done.stdout, done.stdout
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.timeout(240)
def test_model_train_wrapped_once_and_callback_api(tmp_path):
    done = run_alone(tmp_path, "-c", """
import importlib
from mindspore.train import Model
original = Model.train
import trainguard.mindspore as tg
from trainguard.adapters.mindspore import callback
from trainguard.core import ConfigError
wrapped = Model.train
assert wrapped is not original and wrapped.__wrapped__ is original and wrapped.__name__ == "train"
callback.wrap_model_train()
importlib.reload(importlib.import_module("trainguard.adapters.mindspore"))
assert Model.train is wrapped, "wrapped twice"
old = tg.TFTRegister(0, "127.0.0.1", 8000, "ckpt")
assert isinstance(old, tg.TrainFaultTolerance) and old.ckpt_save_path == "ckpt"
try:
    tg.TrainFaultTolerance(ckpt_save_fn="ckpt")
except ConfigError as e:
    assert "ckpt_save_fn must be a function fn(cb_params, append_dict), got 'ckpt'" in str(e)
else:
    raise AssertionError("a ckpt_save_fn that is not callable accepted")
callback.unwrap_model_train()
assert Model.train is original
print("ok")
""")
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr


@pytest.mark.timeout(240)
def test_device_error_is_retried_inside_model_train(tmp_path, baseline):
    job = run_model_train(tmp_path, "uce", fault="uce:rank=1,step=3,phase=forward")
    assert job.rc == 0 and job.report is not None, job
    r = job.report
    assert r["steps_completed"] == 2 * EPOCHS and r["lost_steps"] == 0, job
    assert [(x["fault"], x["rank"], x["step"], x["strategy"]) for x in r["recoveries"]] == [("uce", 1, 3, "retry")]
    assert all(len(pids) == 1 for pids in r["pids"].values()), r["pids"]  # the same processes throughout
    assert r["final_state_sha256"] == baseline.report["final_state_sha256"], job
    assert "Model.train starts at epoch 1, batch 1 (step 3)" in job.log
    _assert_no_stray_processes(tmp_path)


@pytest.mark.timeout(240)
def test_killed_worker_is_dumped_and_the_relaunch_resumes_mid_epoch(tmp_path, baseline):
    ckpt = tmp_path / "ckpt"
    job = run_model_train(tmp_path, "crash", fault="crash:rank=1,step=3,phase=backward", ckpt=ckpt)
    assert job.rc == 75, job
    saved = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("tft_saved_checkpoints"))
    assert saved == ["tft_saved_checkpoints-step_3"], job

    again = run_model_train(tmp_path, "relaunch", ckpt=ckpt)
    assert again.rc == 0 and again.report is not None, again
    r = again.report
    assert r["steps_completed"] == 2 * EPOCHS and r["lost_steps"] == 0, again
    assert [(x["fault"], x["step"], x["strategy"]) for x in r["recoveries"]] == [("process_lost", 3, "dump")]
    assert all(len(pids) == 2 for pids in r["pids"].values()), r["pids"]  # first launch, relaunch
    # Step 3 is epoch 1, batch 1 of the shuffled data: anything else trains other batches.
    assert "Model.train starts at epoch 1, batch 1 (step 3)" in again.log
    assert r["final_state_sha256"] == baseline.report["final_state_sha256"], again
    _assert_no_stray_processes(tmp_path)


@pytest.mark.timeout(300)
def test_ckpt_save_fn_writes_the_dying_gasp_and_the_user_resumes_from_it(tmp_path, baseline):
    """MindSpore's ``ckpt_save_fn``: the saving replica calls it at the
    consistent step instead of writing trainguard's files; the user's own
    resume from that file (``initial_step``) ends bit-identical."""
    ckpt = tmp_path / "ckpt"
    job = run_model_train(tmp_path, "userfn", fault="crash:rank=1,step=3,phase=backward", ckpt=ckpt,
                          env={"TEST_SAVE_FN": "1"})
    assert job.rc == 75, job
    (written,) = sorted((ckpt / "user").glob("*.json"))  # one replica saves: rank 0, the survivor
    assert written.name == "rank_0-step_3.json", job
    assert json.loads(written.read_text()) == {"cur_step_num": 3, "cur_epoch_num": 2,
                                                "append_dict": {"__exception_save__": True}}
    assert not any(p.name.startswith("tft_saved_checkpoints") for p in ckpt.iterdir())  # nothing of trainguard's

    again = run_model_train(tmp_path, "user-resume", ckpt=ckpt, env={
        "TEST_SAVE_FN": "1", "TEST_RESUME": str(written.with_suffix(".ckpt")), "TEST_INITIAL_STEP": "3"})
    assert again.rc == 0 and again.report is not None, again
    assert again.report["steps_completed"] == 2 * EPOCHS - 3, again
    assert "Model.train starts at epoch 1, batch 1 (step 3)" in again.log
    assert again.report["final_state_sha256"] == baseline.report["final_state_sha256"], again
    _assert_no_stray_processes(tmp_path)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("phase, step", [("forward", 3), pytest.param("optimizer", 4, marks=pytest.mark.slow)])
def test_graph_mode_device_error_is_retried_inside_model_train(tmp_path, graph_baseline, phase, step):
    # forward: struck at the step's start, before the compiled step; the drain replays it voting 0.
    # optimizer: struck at the step's end, after every replica updated; the next step is the one skipped.
    job = run_model_train(tmp_path, "uce", fault=f"uce:rank=1,step=3,phase={phase}", mode="graph")
    assert job.rc == 0 and job.report is not None, job
    r = job.report
    assert r["steps_completed"] == 2 * EPOCHS and r["lost_steps"] == 0, job
    assert [(x["fault"], x["rank"], x["step"], x["strategy"]) for x in r["recoveries"]] == [("uce", 1, step, "retry")]
    assert all(len(pids) == 1 for pids in r["pids"].values()), r["pids"]
    assert r["final_state_sha256"] == graph_baseline.report["final_state_sha256"], job
    assert f"Model.train starts at epoch {step // 2}, batch {step % 2} (step {step})" in job.log
    _assert_no_stray_processes(tmp_path)


@pytest.mark.slow  # CI: the PyNative dump, the graph-mode retry
@pytest.mark.timeout(240)
def test_graph_mode_killed_worker_is_dumped_and_the_relaunch_resumes(tmp_path, graph_baseline):
    ckpt = tmp_path / "ckpt"
    job = run_model_train(tmp_path, "crash", fault="crash:rank=1,step=3,phase=forward", ckpt=ckpt, mode="graph")
    assert job.rc == 75, job  # rank 0 left its compiled step when the vote's all-reduce timed out
    saved = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("tft_saved_checkpoints"))
    assert saved == ["tft_saved_checkpoints-step_3"], job

    again = run_model_train(tmp_path, "relaunch", ckpt=ckpt, mode="graph")
    assert again.rc == 0 and again.report is not None, again
    r = again.report
    assert r["steps_completed"] == 2 * EPOCHS and r["lost_steps"] == 0, again
    assert [(x["fault"], x["step"], x["strategy"]) for x in r["recoveries"]] == [("process_lost", 3, "dump")]
    assert all(len(pids) == 2 for pids in r["pids"].values()), r["pids"]
    assert "Model.train starts at epoch 1, batch 1 (step 3)" in again.log
    assert r["final_state_sha256"] == graph_baseline.report["final_state_sha256"], again
    _assert_no_stray_processes(tmp_path)
