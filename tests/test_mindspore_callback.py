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
from trainguard.core import MINDSPORE

if importlib.util.find_spec("mindspore") is None:  # find_spec does not import it
    pytest.skip("mindspore is not installed", allow_module_level=True)

SCRIPT = WORKERS / "ms_model_train.py"
DUMP_3 = MINDSPORE.dirname(3)  # the dying gasp of step 3
DUMP_PREFIX = MINDSPORE.dirname(0)[:-1]  # any dying gasp, _tmp included
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
callback.unwrap_model_train()
assert Model.train is original
print("ok")
""")
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr


@pytest.mark.timeout(240)
def test_callback_takes_mindspores_keywords_and_refuses_what_mindspore_refuses(tmp_path):
    """MindSpore 2.10's ``TrainFaultTolerance(ckpt_save_path=None, **kwargs)``
    (``ckpt_save_fn``, ``ckpt_load_fn``, ``initial_step``): constructed and
    checked without a job; ``ckpt_load_fn``'s dict loaded as MindSpore loads it."""
    done = run_alone(tmp_path, "-c", """
import inspect
import numpy as np
import mindspore as ms
from mindspore import nn
from mindspore.train.callback import TrainFaultTolerance as Theirs
import trainguard.mindspore as tg
from trainguard.core import ConfigError

shape = lambda f: [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]
assert shape(tg.TrainFaultTolerance.__init__) == shape(Theirs.__init__), inspect.signature(Theirs.__init__)
try:  # what MindSpore refuses
    Theirs()
except ValueError as e:
    assert "need to set ckpt_save_fn or ckpt_save_path" in str(e), e
else:
    raise AssertionError("MindSpore accepted TrainFaultTolerance()")

def refused(message, *args, **kwargs):
    try:
        tg.TrainFaultTolerance(*args, **kwargs)
    except ConfigError as e:
        assert isinstance(e, ValueError) and message in str(e), (message, str(e))
    else:
        raise AssertionError(f"accepted {args} {kwargs}")

save = lambda cb_params, append_dict: None
refused("TrainFaultTolerance needs ckpt_save_path or ckpt_save_fn, as MindSpore's")
refused("TrainFaultTolerance needs ckpt_save_path or ckpt_save_fn", initial_step=3)
refused("got 'ckpt_save_dir': MindSpore's TrainFaultTolerance(ckpt_save_path=None, **kwargs) reads only "
        "ckpt_save_fn, ckpt_load_fn, initial_step", ckpt_save_dir="ckpt")
refused("ckpt_save_fn must be a function fn(cb_params, append_dict), got 'ckpt'", ckpt_save_fn="ckpt")
refused("ckpt_load_fn must be a function fn() -> (param_dict, remove_redundancy)", ckpt_save_fn=save,
        ckpt_load_fn={})
refused("ckpt_load_fn loads the files of your ckpt_save_fn", "ckpt", ckpt_load_fn=lambda: ({}, False))
refused("give ckpt_load_fn (its step_num says where training resumes) or initial_step, not both",
        ckpt_save_fn=save, ckpt_load_fn=lambda: ({}, False), initial_step=2)
refused("initial_step must be an int >= 0, got -1", "ckpt", initial_step=-1)
try:
    tg.TFTRegister(0, "127.0.0.1", 8000)
except ConfigError as e:
    assert "TFTRegister needs ckpt_save_path" in str(e)
else:
    raise AssertionError("TFTRegister without a path accepted")

cb = tg.TrainFaultTolerance("ckpt", ckpt_save_fn=save, initial_step=4)  # ckpt_save_fn preferred, as MindSpore's
assert (cb.ckpt_save_path, cb.save_cb, cb.initial_step, cb.ckpt_load_func) == ("ckpt", save, 4, None)
assert tg.TrainFaultTolerance(ckpt_save_path="ckpt").ckpt_save_path == "ckpt"

# ckpt_load_fn: MindSpore's (param_dict, remove_redundancy), loaded into the train network at its step_num.
net = nn.Dense(3, 2)
model = ms.train.Model(net, nn.MSELoss(), optimizer=tg.OptTFTWrapper(nn.Momentum(net.trainable_params(), 0.1, 0.9)))
saved = {p.name: ms.Parameter(ms.Tensor(np.full(p.shape, 7, np.float32)), name=p.name)
         for p in model._train_network.get_parameters() if p.name.endswith(("weight", "bias"))}
saved["step_num"] = ms.Parameter(ms.Tensor(np.array([5], np.int64)), name="step_num")
cb = tg.TrainFaultTolerance(ckpt_save_fn=save, ckpt_load_fn=lambda: (saved, False))
cb._load_with_user_fn(model)
assert cb.initial_step == 5 and float(net.weight.asnumpy().min()) == float(net.bias.asnumpy().max()) == 7.0
cb = tg.TrainFaultTolerance(ckpt_save_fn=save, ckpt_load_fn=lambda: ({"step_num": 9}, None))  # None: loaded itself
cb._load_with_user_fn(model)
assert cb.initial_step == 9
cb = tg.TrainFaultTolerance(ckpt_save_fn=save, ckpt_load_fn=lambda: ({}, False))  # nothing saved yet: from 0
cb._load_with_user_fn(model)
assert cb.initial_step == 0
for bad, message in [(lambda: {}, "must return (param_dict, remove_redundancy)"),
                     (lambda: ({"w": saved["step_num"]}, False), "has no 'step_num'")]:
    try:
        tg.TrainFaultTolerance(ckpt_save_fn=save, ckpt_load_fn=bad)._load_with_user_fn(model)
    except ConfigError as e:
        assert message in str(e), str(e)
    else:
        raise AssertionError(message)
print("ok")
""")
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr


def test_dying_gasp_directory_is_named_as_mindspore_2_10_names_it():
    """MindSpore 2.10's ``_get_ckpt_dir``: ``ttp_saved_checkpoints-step_{n}``
    (``_tmp`` while written), in ``ckpt_save_path``; the older releases that had ``TFTRegister`` wrote
    ``tft_saved_...`` (while its docstring said ``ttp_saved_...``)."""
    path = Path(importlib.util.find_spec("mindspore").submodule_search_locations[0]) / "train" / "callback" / \
        "_train_fault_tolerance.py"
    assert 'mid_dir = f"ttp_saved_checkpoints-step_{str(step)}{tmp}"' in path.read_text()  # not imported here
    assert MINDSPORE.dirname(12) == "ttp_saved_checkpoints-step_12" and MINDSPORE.step_of(MINDSPORE.dirname(12)) == 12


@pytest.mark.timeout(240)
def test_ckpt_load_fn_resumes_model_train_from_the_users_files(tmp_path):
    """One process, no launcher: a run saves its state at step 4 the way a
    ``ckpt_save_fn`` would (``step_num`` appended); a second ``Model.train``
    with ``ckpt_load_fn`` on a fresh network starts at epoch 2 and ends
    bit-identical to an uninterrupted run."""
    done = run_alone(tmp_path, "-c", """
import numpy as np
import mindspore as ms
import mindspore.dataset as ds
from mindspore import nn
import trainguard.mindspore as tg

ms.set_context(mode=ms.PYNATIVE_MODE)
data = np.random.default_rng(0)
x, y = data.standard_normal((16, 4)).astype(np.float32), data.standard_normal((16, 1)).astype(np.float32)

def run(epochs, load=None, stop_at=None):
    ms.set_seed(0)
    dataset = ds.NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(8)  # 2 batches an epoch
    net = nn.Dense(4, 1, weight_init="ones", bias_init="zeros")
    model = ms.train.Model(net, nn.MSELoss(), optimizer=tg.OptTFTWrapper(nn.Momentum(net.trainable_params(), 0.1, 0.9)))
    cb = tg.TrainFaultTolerance(ckpt_save_fn=lambda cb_params, append_dict: None, ckpt_load_fn=load)
    model.train(epochs, dataset, callbacks=[cb], dataset_sink_mode=False)
    return model, cb

full, _ = run(3)
model, _ = run(2)  # the first 4 of 6 steps, saved as a ckpt_save_fn would with its step_num
ms.save_checkpoint(model._train_network, "mid.ckpt", append_dict={"step_num": 4})
resumed, cb = run(3, load=lambda: (ms.load_checkpoint("mid.ckpt"), False))
assert cb.guard.step == 2, cb.guard.step  # 6 steps in all, 4 of them loaded
for a, b in zip(full._train_network.get_parameters(), resumed._train_network.get_parameters()):
    assert a.name == b.name and np.array_equal(a.asnumpy(), b.asnumpy()), a.name
print("ok")
""")
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr
    assert "Model.train starts at epoch 2, batch 0 (step 4)" in done.stdout + done.stderr
    # No ckpt_save_path: nowhere to keep the random streams beside the user's files, said before step 0.
    assert "ckpt_save_fn without ckpt_save_path" in done.stdout + done.stderr


@pytest.mark.timeout(240)
def test_device_error_is_retried_inside_model_train(tmp_path, baseline):
    job = run_model_train(tmp_path, "uce", fault="uce:rank=1,step=3,phase=forward")
    assert job.rc == 0 and job.report is not None, job
    r = job.report
    assert r["steps_completed"] == 2 * EPOCHS and r["lost_steps"] == 0, job
    assert [(x["fault"], x["rank"], x["step"], x["strategy"]) for x in r["recoveries"]] == [("uce", 1, 3, "retry")]
    assert all(len(pids) == 1 for pids in r["pids"].values()), r["pids"]  # the same processes throughout
    (loud,) = job.loud()  # the controller's one line (Model.train's restart and the drain are INFO)
    assert " WARNING " in loud and "-> retry: training resumed at step 3" in loud, job.loud()
    assert r["final_state_sha256"] == baseline.report["final_state_sha256"], job
    assert "Model.train starts at epoch 1, batch 1 (step 3)" in job.log
    _assert_no_stray_processes(tmp_path)


@pytest.mark.timeout(240)
def test_killed_worker_is_dumped_and_the_relaunch_resumes_mid_epoch(tmp_path, baseline):
    ckpt = tmp_path / "ckpt"
    job = run_model_train(tmp_path, "crash", fault="crash:rank=1,step=3,phase=backward", ckpt=ckpt)
    assert job.rc == 75, job
    saved = sorted(p.name for p in ckpt.iterdir() if p.name.startswith(DUMP_PREFIX))
    assert saved == [DUMP_3], job

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
@pytest.mark.parametrize("resume", ["ckpt_load_fn", pytest.param("initial_step", marks=pytest.mark.slow)])
def test_ckpt_save_fn_writes_the_dying_gasp_and_the_user_resumes_from_it(tmp_path, baseline, resume):
    """MindSpore's ``ckpt_save_fn``: the saving replica calls it at the
    consistent step instead of writing trainguard's files; every rank's
    random streams go beside them (``ckpt_save_path``), and the user's own
    resume from that file (``ckpt_load_fn``, or loaded by the script with
    ``initial_step``) ends bit-identical -- the network's ``ops.dropout``
    drawing as in the fault-free run. Before, trainguard wrote no streams
    when a save function was given, and the relaunch trained on other
    dropout masks, without a warning."""
    ckpt = tmp_path / "ckpt"
    env = {"TEST_SAVE_FN": "1", "TEST_SAVE_PATH": "1", **({"TEST_LOAD_FN": "1"} if resume == "ckpt_load_fn" else {})}
    job = run_model_train(tmp_path, "userfn", fault="crash:rank=1,step=3,phase=backward", ckpt=ckpt, env=env)
    assert job.rc == 75, job
    (written,) = sorted((ckpt / "user").glob("*.json"))  # one replica saves: rank 0, the survivor
    assert written.name == "rank_0-step_3.json", job
    assert json.loads(written.read_text()) == {"cur_step_num": 3, "cur_epoch_num": 2,
                                                "append_dict": {"__exception_save__": True}}
    assert not any(p.name.startswith(DUMP_PREFIX) for p in ckpt.iterdir())  # nothing of trainguard's
    # rank 0's own streams, and rank 1's carried over from its record on this node
    assert sorted(p.name for p in (ckpt / ".trainguard" / "streams" / "step_3").iterdir()) == \
        ["own_r0.json", "own_r1.json"], job

    if resume == "initial_step":
        env.update(TEST_RESUME=str(written.with_suffix(".ckpt")), TEST_INITIAL_STEP="3")
    again = run_model_train(tmp_path, "user-resume", ckpt=ckpt, env=env)
    assert again.rc == 0 and again.report is not None, again
    assert again.report["steps_completed"] == 2 * EPOCHS - 3, again
    assert "Model.train starts at epoch 1, batch 1 (step 3)" in again.log
    assert "took its random streams of step 3" in again.log and "no random streams" not in again.log, again
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
    saved = sorted(p.name for p in ckpt.iterdir() if p.name.startswith(DUMP_PREFIX))
    assert saved == [DUMP_3], job

    again = run_model_train(tmp_path, "relaunch", ckpt=ckpt, mode="graph")
    assert again.rc == 0 and again.report is not None, again
    r = again.report
    assert r["steps_completed"] == 2 * EPOCHS and r["lost_steps"] == 0, again
    assert [(x["fault"], x["step"], x["strategy"]) for x in r["recoveries"]] == [("process_lost", 3, "dump")]
    assert all(len(pids) == 2 for pids in r["pids"].values()), r["pids"]
    assert "Model.train starts at epoch 1, batch 1 (step 3)" in again.log
    assert r["final_state_sha256"] == graph_baseline.report["final_state_sha256"], again
    _assert_no_stray_processes(tmp_path)
