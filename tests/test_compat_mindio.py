"""MindIO's ``mindio_ttp.framework_ttp`` / ``megatron_ttp`` names on trainguard:
argument checks, Megatron's checkpoint layout, and the GPT-3 recipe's flow
end to end (a crash, the dying gasp, the relaunch)."""

import json
import os
import random
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")
import trainguard.compat.mindio_ttp.framework_ttp as ttp  # noqa: E402
import trainguard.compat.mindio_ttp.megatron_ttp as mega  # noqa: E402
from trainguard.adapters.megatron import checkpoint as ckpt  # noqa: E402
from trainguard.adapters.megatron.repair import RngHistory  # noqa: E402
from trainguard.adapters.megatron.session import TTP  # noqa: E402
from trainguard.core import CheckpointError, ConfigError, Processor  # noqa: E402
from trainguard.core.checkpoint import SavedShard  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "gpt3" / "train.py"


@pytest.fixture(autouse=True)
def fresh_session():
    TTP.__init__()
    yield
    TTP.__init__()


def test_unknown_and_unsupported_names_say_what_is_missing():
    with pytest.raises(AttributeError, match="DP-group registration"):
        ttp.tft_set_dp_group_info(0, [0, 1])
    with pytest.raises(AttributeError, match="not a MindIO TTP/TFT name"):
        ttp.ttp_no_such_call()
    with pytest.raises(AttributeError, match="not a MindIO megatron_ttp name"):
        mega.no_such_handler
    with pytest.raises(ImportError):
        from trainguard.compat.mindio_ttp.framework_ttp import tft_pause_train  # noqa: F401


def test_processor_arguments_are_checked():
    with pytest.raises(ConfigError, match="not in its own dp_ranks"):
        ttp.ttp_init_processor(3, [0, 1], 2, 4, 1, False)
    with pytest.raises(ConfigError, match="dp_size=3"):
        ttp.ttp_init_processor(0, [0, 1], 3, 4, 1, False)
    with pytest.raises(ConfigError, match="rank must be an int"):
        ttp.ttp_init_processor("0", [0, 1], 2, 4, 1, False)
    with pytest.raises(ConfigError, match="before starting the processor"):
        ttp.ttp_start_processor("127.0.0.1", 8000)
    with pytest.raises(ConfigError, match="before starting the controller"):
        ttp.ttp_start_controller("127.0.0.1", 8000)
    with pytest.raises(ConfigError, match="ttp_start_processor"):
        ttp.ttp_start_updating_os(-1)


def test_data_parallel_of_one_is_refused_and_replicas_are_validated():
    ttp.ttp_init_processor(0, [0], 1, 2, 1, False)
    with pytest.raises(ConfigError, match="data parallelism >= 2"):
        TTP.groups()
    with pytest.raises(ConfigError, match="must be >= 1 and divide"):
        ttp.tft_set_optimizer_replica(0, [{"rank_list": [0, 1, 2, 3], "replica_cnt": 3}])
    with pytest.raises(ConfigError, match="lacks"):
        ttp.tft_set_optimizer_replica(0, [{"rank_list": [0, 1]}])
    ttp.tft_set_optimizer_replica(1, [{"rank_list": [0, 1, 2, 3], "replica_cnt": 2}])
    assert TTP.groups()[0].copies(1) == [1, 3]


def test_handlers_must_be_callable_and_rename_only_runs_inside_a_finalise():
    with pytest.raises(ConfigError, match="must be callable"):
        ttp.ttp_register_save_ckpt_handler("mega.ttp_save_checkpoint")
    with pytest.raises(CheckpointError, match="not on its own"):
        mega.rename_save_result(None)
    with pytest.raises(CheckpointError, match=r"\(iteration, model, optimizer, opt_param_scheduler\)"):
        mega.ttp_save_checkpoint(0, 3, [0, 1], None)


def test_the_legacy_save_handler_shape_is_told_the_kind_when_it_takes_one():
    """MindIO's legacy ``(rank, step, rank_list, args)`` tells no kind; with
    experts and a distributed optimizer a dense shard and an expert shard can
    have the same copies, so trainguard's own handler is passed the kind."""
    from trainguard.adapters.megatron.handlers import TtpHandlers
    from trainguard.core import ReplicaGroup

    TTP.rank, TTP.args = 0, "args"
    TTP.replicas = (ReplicaGroup((0, 1, 2, 3), 2), ReplicaGroup((0, 2), 2))  # dense shard 0 and experts: [0, 2]
    seen = []
    ttp.ttp_register_save_ckpt_handler(lambda rank, step, ranks, args, kind=None: seen.append((ranks, kind)))
    TtpHandlers(TTP).save(3, 0)
    TtpHandlers(TTP).save(3, 1)
    assert seen == [([0, 2], 0), ([0, 2], 1)]
    ttp.ttp_register_save_ckpt_handler(lambda rank, step, ranks, args: seen.append((ranks, "no kind")))
    TtpHandlers(TTP).save(3, 1)
    assert seen[-1] == ([0, 2], "no kind")


def _trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def _save(store, step, model, opt):
    files = ckpt.write_rank(store, step, model, opt, None)
    ckpt.finalize(store, step, [SavedShard(kind=0, copies=(0, 1), full=True, rank=0, files=tuple(files))], {}, 0)


def test_a_checkpoint_carries_every_random_stream_numpys_included(tmp_path):
    """Megatron-LM's ``rng_state`` holds Python's, NumPy's and torch's
    streams; NumPy's is kept as tensors, so the file still loads with
    ``weights_only=True``, and a load sets each stream back."""
    import random

    import numpy as np

    store = ckpt.megatron_store(tmp_path)
    model, opt = _trained(3)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    _save(store, 3, model, opt)
    expected = (random.random(), np.random.random(), torch.rand(1).item())
    random.seed(7), np.random.seed(8), torch.manual_seed(9)  # other streams, then the load
    saved = torch.load(tmp_path / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt", weights_only=True)
    assert {"random_rng_state", "np_rng_state", "torch_rng_state"} <= set(saved["rng_state"][0])
    assert ckpt.load(store, *_trained(9), None)[0] == 3
    assert (random.random(), np.random.random(), torch.rand(1).item()) == expected


def test_checkpoints_use_megatrons_layout_and_skip_a_corrupted_one(tmp_path):
    store = ckpt.megatron_store(tmp_path)
    m2, o2 = _trained(2)
    _save(store, 2, m2, o2)
    m5, o5 = _trained(5)
    _save(store, 5, m5, o5)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    saved = torch.load(tmp_path / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt", weights_only=True)
    assert saved["iteration"] == 5 and {"model", "optimizer", "rng_state", "checkpoint_version"} <= set(saved)

    fresh, fresh_opt = _trained(9)
    assert ckpt.load(store, fresh, fresh_opt, None)[0] == 5
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), m5.state_dict().values()))

    with open(tmp_path / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt", "r+b") as f:
        f.seek(100)
        f.write(b"\0" * 16)
    fresh, fresh_opt = _trained(9)
    assert ckpt.load(store, fresh, fresh_opt, None)[0] == 2  # falls back, with a warning naming the checksum
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), m2.state_dict().values()))
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], o2.state_dict()["state"][0]["exp_avg"])


def test_a_checkpoint_that_does_not_fit_the_model_is_a_clear_error(tmp_path):
    store = ckpt.megatron_store(tmp_path)
    m, o = _trained(1)
    _save(store, 1, m, o)
    other = torch.nn.Linear(4, 2)
    with pytest.raises(CheckpointError, match="does not fit"):
        ckpt.load(store, other, None, None)


# ---------------------------------------------------------------- end to end
TORCHRUN_SCRIPT = """\
import sys
import trainguard.compat.mindio_ttp.framework_ttp
from torch.distributed.run import main
sys.exit(main())
"""


def gpt(tmp: Path, name: str, *, launcher: list[str], fault: str | None = None,
        extra_env: dict | None = None) -> tuple[int, dict | None, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update({"TRAINGUARD_HEARTBEAT_INTERVAL_S": "0.5", "PYTHONUNBUFFERED": "1", **(extra_env or {})})
    if fault:
        env["TRAINGUARD_FAULT"] = fault
    cmd = [*launcher, "--nproc-per-node", "2", "--monitor-interval", "0.1", "--max-restarts", "0", str(EXAMPLE), "steps=6", "log_every=0",
           f"report={name}.json", f"checkpoint_dir={name}-ckpt"]
    out = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=240)
    report = tmp / f"{name}.json"
    return out.returncode, json.loads(report.read_text()) if report.exists() else None, out.stdout + out.stderr


@pytest.mark.timeout(400)
def test_gpt3_recipe_crash_dying_gasp_and_resume_is_bit_identical(tmp_path):
    # The recipe's torchrun script, with the import renamed, launches through trainguard.
    script = tmp_path / "torchrun"
    script.write_text(TORCHRUN_SCRIPT)
    rc, ref, log = gpt(tmp_path, "ref", launcher=[sys.executable, str(script)])
    assert rc == 0, log[-4000:]
    assert "controller listening" in log, "the torchrun script did not route through trainguard"
    assert ref["steps_completed"] == 6 and ref["recoveries"] == [] and ref["lost_steps"] == 0

    trainguard_run = [sys.executable, "-m", "trainguard.cli", "run"]
    rc, _, log = gpt(tmp_path, "crash", launcher=trainguard_run, fault="crash:rank=1,step=3")
    assert rc == 75, log[-4000:]
    ckpt_dir = tmp_path / "crash-ckpt"
    assert (ckpt_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert (ckpt_dir / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt").is_file()
    manifest = json.loads((ckpt_dir / "iter_0000003" / "manifest.json").read_text())
    assert manifest["layout"]["shards"][0]["saved_by"] == 0  # the survivor saved for the lost rank

    # The relaunch records profiling markers: they change no number.
    prof = tmp_path / "prof"
    prof.mkdir()
    (prof / "profilingSwitch").write_text('{"CommunicationOperator":"on","Step":"on","SaveCheckpoint":"on",'
                                          '"FP":"on","DataLoader":"on"}')
    rc, resumed, log = gpt(tmp_path, "crash", launcher=trainguard_run,
                           extra_env={"TRAINGUARD_PROFILING_DIR": str(prof), "TRAINGUARD_JOB_ID": "gpt"})
    assert rc == 0, log[-4000:]
    assert resumed["start_step"] == 3 and resumed["steps_completed"] == 6
    assert resumed["final_state_sha256"] == ref["final_state_sha256"]
    for rank in (0, 1):
        recs = [json.loads(line) for p in (prof / "gpt" / str(rank)).iterdir() if p.name.isdigit()
                for line in p.read_text().splitlines()]
        assert sorted(r["step"] for r in recs if r["name"] == "Step") == [3, 4, 5]  # ttp_end_updating_os closes each
        assert {r["step"] for r in recs if r["name"] == "FP"} == {3, 4, 5}  # the model chunks from ttp_set_ckpt_args
        groups = json.loads((prof / "gpt" / str(rank) / "parallel_group.json").read_text())
        dp = {r["group"] for r in recs if r["name"] == "Communication" and r["op"] == "allreduce"
              and groups[r["group"]]["global_ranks"] == [0, 1]}
        assert dp, "the data-parallel gradient all-reduce (a plain dist.all_reduce on megatron's group)"
    assert resumed["lost_steps"] == 0
    assert [(r["strategy"], r["step"], r["rank"]) for r in resumed["recoveries"]] == [("dump", 3, 1)]
    assert {k: len(v) for k, v in resumed["pids"].items()} == {"0": 2, "1": 2}  # two launches, every rank

    # A rank whose loop hangs in Python (not in a collective): its peer waits in
    # megatron's all-reduce. The watchdog sees that the peer is inside a
    # collective, gives it the longer in-collective limit, so the hung rank
    # names itself; it is told to exit (77), the STOP releases the peer from
    # the all-reduce (the trainguard backend), and the peer saves step 3.
    rc, _, log = gpt(tmp_path, "hang", launcher=trainguard_run, fault="hang:rank=1,step=3")
    assert rc == 75, log[-4000:]
    assert "fault: rank 1: hang: training loop hung" in log and "fault: rank 0: hang" not in log, log[-4000:]
    assert (tmp_path / "hang-ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    rc, resumed, log = gpt(tmp_path, "hang", launcher=trainguard_run)
    assert rc == 0, log[-4000:]
    assert resumed["start_step"] == 3 and resumed["final_state_sha256"] == ref["final_state_sha256"]
    assert [(r["fault"], r["strategy"], r["step"], r["rank"]) for r in resumed["recoveries"]] == [
        ("hang", "dump", 3, 1)]


@pytest.mark.timeout(300)
def test_gpt3_recipe_uce_and_comm_fault_are_repaired_in_place_bit_identical(tmp_path):
    """With the ``trainguard`` backend (megatron's groups abortable) and
    ``mega.register_recovery_handlers()``, a device memory error on rank 1 is
    retried in place: its peer is released from the gradient all-reduce, the
    groups are rebuilt, rank 1's state -- discarded by its clean handler, as
    a device reset leaves it -- is copied from rank 0, and training goes on
    from the locked step in the same processes, ending bit-identical."""
    trainguard_run = [sys.executable, "-m", "trainguard.cli", "run"]
    rc, ref, log = gpt(tmp_path, "ref", launcher=trainguard_run)
    assert rc == 0, log[-4000:]
    for fault, repaired in (("uce:rank=1,step=3,phase=backward", True), ("comm:rank=0,step=2,phase=backward", False)):
        name = fault.split(":")[0]
        rc, got, log = gpt(tmp_path, name, launcher=trainguard_run, fault=fault)
        assert rc == 0, log[-4000:]
        assert got["final_state_sha256"] == ref["final_state_sha256"], (fault, log[-4000:])
        assert got["steps_completed"] == 6 and got["lost_steps"] == 0
        [record] = got["recoveries"]
        assert (record["fault"], record["strategy"]) == (name, "retry"), record
        assert {k: len(v) for k, v in got["pids"].items()} == {"0": 1, "1": 1}, got["pids"]  # nobody restarted
        assert ("rank 1 took its state at step 3 from rank 0" in log) is repaired, log[-4000:]
        assert ("the state on this rank's device is discarded" in log) is repaired
        assert not (tmp_path / f"{name}-ckpt" / "latest_checkpointed_iteration.txt").exists()  # nothing dumped


def test_a_periodic_save_is_left_out_of_the_hang_watchdog(monkeypatch, tmp_path):
    """A save of a large model takes many steps' time; the saver must not be
    taken for hung (seen on an H100: a 200M-parameter save_checkpoint)."""
    import contextlib
    from types import SimpleNamespace

    active: list[str] = []

    @contextlib.contextmanager
    def section(name):
        active.append(name)
        yield
        active.remove(name)

    TTP.processor = SimpleNamespace(watchdog=SimpleNamespace(section=section))
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_DIR", str(tmp_path))
    seen = []
    monkeypatch.setattr(ckpt, "save", lambda *a, **k: seen.append(list(active)))
    mega.save_checkpoint(1, None, None, None)
    assert seen == [["checkpoint"]] and active == []


def test_the_trainguard_backend_is_registered_and_checks_its_inner_backend(monkeypatch):
    import torch.distributed as dist

    from trainguard.adapters.torch import backend

    backend.register()  # idempotent
    assert dist.Backend.backend_list.count("trainguard") == 1
    monkeypatch.setenv("TRAINGUARD_INNER_BACKEND", "mpi")
    monkeypatch.setattr(backend, "_settings", None)  # the rank's settings are read at the first group
    with pytest.raises(ValueError, match="TRAINGUARD_INNER_BACKEND='mpi': choose gloo or nccl"):
        backend._create(dist.HashStore(), 0, 1, timedelta(seconds=5))


def test_in_place_repair_of_expert_state_in_a_job_without_experts_is_refused_before_anything_is_copied():
    from trainguard.core import RecoveryError

    with pytest.raises(RecoveryError, match="cannot repair state of type 1 \\(this job has no experts"):
        mega.repair_callback(3, True, [1], [{"src": 3, "dst": 1, "type": 1}], (3, None, None, None))


def _streams() -> tuple:
    """Python's, NumPy's and torch's streams, comparable with ``==``."""
    kind, keys, pos, gauss, cached = np.random.get_state()
    return random.getstate(), (kind, keys.tobytes(), pos, gauss, cached), torch.get_rng_state().numpy().tobytes()


def _draw() -> None:
    random.random(), np.random.random(), torch.rand(3)


def _tracked_session() -> RngHistory:
    """An offline processor and a fresh :class:`RngHistory` on the session's
    hooks, as ``register_recovery_handlers`` puts the adapter's own."""
    TTP.processor = Processor(None)
    history = RngHistory()
    TTP.update_hooks.append(history.start)
    TTP.commit_hooks.append(history.commit)
    return history


def test_a_rank_caught_inside_its_update_gets_back_the_streams_its_update_began_with():
    """Committed step 1, then stopped inside the update to step 2, with
    draws before the rollback (the fault path, the script's own exception
    handling): a rollback to step 2 -- the step its replica committed --
    sets every stream back, bit for bit, to where the update began."""
    history = _tracked_session()
    ttp.ttp_start_updating_os(-1)
    ttp.ttp_end_updating_os(1)
    _draw()  # step 2's forward pass
    ttp.ttp_start_updating_os(-1)
    began = _streams()
    _draw()  # between the fault and the rollback
    assert _streams() != began and 2 not in history.states  # the update's start is no committed step
    assert history.restore(2)
    assert _streams() == began
    # The rank stands at step 2 now: a dying gasp before its next commit saves these streams.
    assert history.states[2] is history.updating[1] and history.updating[0] == 2


def test_a_committed_steps_streams_win_over_its_updates_start_and_a_step_never_begun_is_said(caplog):
    """An optimizer that draws (stochastic rounding, say) moves the streams
    inside the update: a rank that committed the step goes back to the
    streams at its commit, where its replicas stand. A step this rank
    neither committed nor began leaves the streams as they are, with a
    warning that says so."""
    history = _tracked_session()
    ttp.ttp_start_updating_os(-1)
    _draw()  # the optimizer's own draws
    ttp.ttp_end_updating_os(1)
    committed = _streams()
    _draw()
    assert history.restore(1) and _streams() == committed
    now = _streams()
    with caplog.at_level("WARNING", logger="trainguard.megatron"):
        assert not history.restore(5)
    assert _streams() == now
    assert "no random-number state kept for step 5" in caplog.text and "left as they are" in caplog.text
