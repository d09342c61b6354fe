"""In-memory snapshots of Megatron ranks (``TRAINGUARD_SNAPSHOT_EVERY`` in the
MindIO TTP flow): a rank's state round-trips exactly through memory and
through a persisted snapshot; the GPT-3 example on CPU (gloo) takes them,
saves asynchronously in Megatron's layout, reuses a snapshot for its dying
gasp, restarts from memory bit-identical to a fault-free run, and takes
storage when its snapshots are corrupted."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
import trainguard.compat.mindio_ttp.framework_ttp as ttp  # noqa: E402
import trainguard.compat.mindio_ttp.megatron_ttp as mega  # noqa: E402
from trainguard.adapters.megatron import checkpoint as ckpt  # noqa: E402
from trainguard.adapters.megatron import snapshot as snapshot_module  # noqa: E402
from trainguard.adapters.megatron.session import TTP  # noqa: E402
from trainguard.adapters.megatron.snapfile import read_file  # noqa: E402
from trainguard.adapters.megatron.snapshot import MegatronSnapshots  # noqa: E402
from trainguard.adapters.torch.snapshot import filled  # noqa: E402
from trainguard.adapters.torch.state import state_sha256  # noqa: E402
from trainguard.core import ConfigError  # noqa: E402
from trainguard.core.snapshot import SnapshotDir, State  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "gpt3" / "train.py"
CORRUPTING = Path(__file__).resolve().parent / "workers" / "gpt_corrupt_snapshots.py"
SHARDS = Path(__file__).resolve().parent / "workers" / "megatron_snapshot_shards.py"


# ---------------------------------------------------------------- in-process
class WithExtraState(torch.nn.Linear):
    """A layer whose extra state (as TransformerEngine's) is neither a
    tensor nor a JSON scalar."""

    extra: object = None

    def get_extra_state(self):
        return {"size": torch.Size([2, 3]), "by_pair": {(1, 2): 3.5}, "raw": b"\x00\xff", "dtype": torch.bfloat16}

    def set_extra_state(self, state) -> None:
        self.extra = state


def _trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(WithExtraState(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()
    random.seed(seed)
    random.random()
    return model, opt, sched


def _same(a, b) -> bool:
    """Equal values of the same types (tuples stay tuples, ints ints)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@pytest.fixture
def ring(tmp_path):
    root = tmp_path / "shm"
    root.mkdir()
    directory = SnapshotDir.create("megatron", root)
    snapshots = MegatronSnapshots(directory, 0, count=2, save_timeout_s=60)
    yield snapshots
    snapshots.shutdown(0)
    directory.remove()
    assert not list(root.iterdir()), "the slots must go with their directory"


def _sealed(ring: MegatronSnapshots, step: int) -> None:
    ring.wait(30)
    for _ in range(600):
        ring.poll(timeout=0.05)
        if any(s.info() and s.info().step == step and s.info().state is State.SEALED for s in ring.slots):
            return
    raise AssertionError(f"the snapshot of step {step} was never sealed")


def _flip(path: Path) -> None:
    """Flip bits of one byte near the end of a slot (in its payload); flipped again, it is as it was."""
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x55]))


@pytest.mark.timeout(60)
def test_a_rank_state_round_trips_exactly_through_memory_and_a_persisted_snapshot(ring, tmp_path):
    model, opt, sched = _trained(1)
    expected = ckpt.rank_state(4, model, opt, sched)
    assert ring.take_rank(4, model, opt, sched, {"records": [], "pids": {"0": [1]}}) is not None
    store = ckpt.megatron_store(tmp_path / "ckpt")
    ring.save(store, 4, model, opt, sched, history={"records": [], "pids": {"0": [1]}})  # reuses the slot
    ring.wait(60)
    assert ring.errors == [] and [p["step"] for p in ring.persisted] == [4] and ring.taken == 1
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    persisted = tmp_path / "ckpt" / "iter_0000004" / "mp_rank_00" / "model_optim_rng.safetensors"
    assert sorted(p.name for p in persisted.parent.iterdir()) == [persisted.name]

    state, shards = read_file(persisted)
    assert shards == {} and _same(state, expected)  # random's state, the extra state, the scheduler: as they were

    # Loaded back from memory, then from storage (the .safetensors), into fresh objects.
    _sealed(ring, 4)
    for load in (lambda m, o, s: ring.load(store, m, o, s), lambda m, o, s: ckpt.load(store, m, o, s)):
        fresh = _trained(2)
        random.seed(99)
        assert load(*fresh)[0] == 4
        assert _same(ckpt.rank_state(4, *fresh), expected)
        assert fresh[0][0].extra == model[0].get_extra_state()
    assert ring.resumed_from == {"step": 4, "source": "memory"}


@pytest.mark.timeout(60)
def test_a_corrupt_snapshot_is_detected_and_storage_is_used(ring, tmp_path, caplog):
    store = ckpt.megatron_store(tmp_path / "ckpt")
    m2, o2, s2 = _trained(2)
    ring.save(store, 2, m2, o2, s2, history={})
    ring.wait(60)
    m3, o3, s3 = _trained(3)
    ring.take_rank(3, m3, o3, s3, {})
    _sealed(ring, 3)
    for slot in ring.slots:  # both snapshots (steps 2 and 3) flipped in memory
        _flip(slot.path)
    fresh = _trained(9)
    assert ring.load(store, *fresh) == (2, {})
    assert ring.resumed_from == {"step": 2, "source": "storage"}
    assert "fails its checksum (corrupted in memory)" in caplog.text
    assert _same(fresh[0].state_dict(), m2.state_dict()) and _same(fresh[1].state_dict(), o2.state_dict())


@pytest.mark.timeout(60)
def test_a_load_from_memory_fills_the_objects_in_place_and_only_once_the_checksum_passed(ring, tmp_path,
                                                                                         monkeypatch):
    model, opt, sched = _trained(1)
    expected = ckpt.rank_state(4, model, opt, sched)
    ring.take_rank(4, model, opt, sched, {"records": [], "pids": {}})
    _sealed(ring, 4)
    path = next(s.path for s in ring.slots if s.info() and s.info().step == 4)
    store = ckpt.megatron_store(tmp_path / "ckpt")  # nothing on storage
    fresh = _trained(2)
    before = {k: v.clone() for k, v in fresh[0].state_dict().items() if isinstance(v, torch.Tensor)}
    moments = [t for s in fresh[1].state.values() for t in s.values() if t.numel() > 1]

    _flip(path)
    assert ring.load(store, *fresh) == (0, {}) and ring.resumed_from is None
    assert _same({k: v for k, v in fresh[0].state_dict().items() if k in before}, before), \
        "the model was written before the snapshot's checksum was checked"

    _flip(path)  # back
    held = []
    monkeypatch.setattr(snapshot_module, "filled", lambda read: held.append(filled(read)) or held[-1])
    assert ring.load(store, *fresh)[0] == 4 and ring.resumed_from == {"step": 4, "source": "memory"}
    assert _same(ckpt.rank_state(4, *fresh), expected)
    # The snapshot's tensors were copied once, into the model's parameters and the optimizer's moments.
    params = {k: v.data_ptr() for k, v in fresh[0].state_dict().items() if isinstance(v, torch.Tensor)}
    loaded = held[0][1]["state"]["rank"]
    assert {k: v.data_ptr() for k, v in loaded["model"].items() if k in params} == params
    assert sorted(t.data_ptr() for t in moments) == \
        sorted(t.data_ptr() for s in fresh[1].state.values() for t in s.values() if t.numel() > 1)


@pytest.fixture
def session(tmp_path, monkeypatch):
    """A fresh TTP session with snapshots on, outside any launcher."""
    for name in [k for k in os.environ if k.startswith("TRAINGUARD_")]:
        monkeypatch.delenv(name)
    (tmp_path / "shm").mkdir()
    monkeypatch.setenv("TRAINGUARD_SNAPSHOT_EVERY", "2")
    monkeypatch.setenv("TRAINGUARD_SNAPSHOT_ROOT", str(tmp_path / "shm"))
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    TTP.__init__()
    yield tmp_path
    mega.close_snapshots(0)
    TTP.__init__()


@pytest.mark.timeout(60)
def test_the_ttp_calls_snapshot_save_in_the_background_and_clean_up(session):
    model, opt, sched = _trained(1)
    assert mega.load_checkpoint(model, opt, sched) == 0 and mega.snapshot_report()["snapshots"]["resumed_from"] is None
    for iteration in (1, 2):  # the loop: update, ttp_end_updating_os(iteration), scheduler, ttp_set_ckpt_args
        TTP.step = iteration
        ttp.ttp_set_ckpt_args((iteration, model, opt, sched))
    assert TTP.snapshots.taken == 1  # every 2 iterations
    expected = ckpt.rank_state(2, model, opt, sched)
    mega.save_checkpoint(2, model, opt, sched)  # hands the snapshot of iteration 2 to the persist worker
    mega.close_snapshots()  # waits for it
    report = mega.snapshot_report()["snapshots"]
    assert report["taken"] == 1 and [p["step"] for p in report["persisted"]] == [2] and report["errors"] == []
    assert not list((session / "shm").iterdir()), "a process without a node agent removes its slots"

    TTP.__init__()  # a relaunch: nothing in memory any more, the persisted snapshot on storage
    fresh = _trained(2)
    assert mega.load_checkpoint(*fresh) == 2 and TTP.step == 2
    assert TTP.snapshots.resumed_from == {"step": 2, "source": "storage"}
    assert _same(ckpt.rank_state(2, *fresh), expected)


def test_snapshot_settings_are_checked(monkeypatch):
    assert mega.SnapshotConfig.from_env({}) == mega.SnapshotConfig(every=0, in_memory=2)
    assert mega.SnapshotConfig.from_env({"TRAINGUARD_SNAPSHOT_EVERY": "5", "TRAINGUARD_SNAPSHOTS_IN_MEMORY": "1"}) \
        == mega.SnapshotConfig(every=5, in_memory=1)
    with pytest.raises(ConfigError, match="not a whole number"):
        mega.SnapshotConfig.from_env({"TRAINGUARD_SNAPSHOT_EVERY": "often"})
    with pytest.raises(ConfigError, match="must be >= 1"):
        mega.SnapshotConfig.from_env({"TRAINGUARD_SNAPSHOT_EVERY": "1", "TRAINGUARD_SNAPSHOTS_IN_MEMORY": "0"})


@pytest.mark.timeout(120)
def test_sharded_optimizer_and_expert_snapshots_are_saved_once_per_shard_and_load_back(tmp_path):
    """4 gloo ranks under torchrun, with the CPU stand-in of megatron's
    distributed optimizer (megatron's own needs CUDA) in 2 instances -- shard
    0 on ranks 0 and 2, shard 1 on ranks 1 and 3 -- then with experts (EP 2)
    and a dense optimizer, then with experts and the distributed optimizer."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone",
                          str(SHARDS), str(tmp_path)], env=environ, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    ranks = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)}
    for r, got in ranks.items():
        sharded = got["sharded"]
        # One file per shard, each holding its saver's rank state and shard, written by instance 0.
        assert sharded["files"] == ["mp_rank_00/distrib_optim_shard_000.safetensors",
                                    "mp_rank_00/distrib_optim_shard_001.safetensors"], sharded
        assert sorted((s["copies"], s["saved_by"], s["full"]) for s in sharded["shards"]) == \
            [([0, 2], 0, False), ([1, 3], 1, False)]
        assert sharded["restored"] == {"storage": True, "memory": True}, (r, sharded)
        assert sharded["resumed_from"] == {"step": 5, "source": "memory"}
        assert sharded["dump"] == [f"mp_rank_00/distrib_optim_shard_{r % 2:03d}.safetensors"], sharded
        assert sharded["reused"] == [5]
        moe = got["moe"]
        assert moe["files"] == ["mp_rank_00_000/model_optim_rng.safetensors",
                                "mp_rank_00_001/model_optim_rng.safetensors"] and moe["restored"], (r, moe)
        assert sorted((s["kind"], s["copies"], s["saved_by"]) for s in moe["shards"]) == \
            [(1, [0, 2], 0), (1, [1, 3], 1)]
        assert moe["dense_dump"] == [] and moe["expert_dump"] == [f"mp_rank_00_{r % 2:03d}/model_optim_rng.safetensors"]
        both = got["moe_sharded"]
        # Experts with the distributed optimizer: the savers are ranks 0 and 1 (dense shards 0 and 1, and
        # each expert-parallel rank's expert shard 0), one file each, named after the shards it holds.
        assert both["files"] == ["mp_rank_00_000/distrib_optim_shard_000_expert_shard_000.safetensors",
                                 "mp_rank_00_001/distrib_optim_shard_001_expert_shard_000.safetensors"], both
        assert sorted((s["kind"], s["copies"], s["saved_by"], s["full"]) for s in both["shards"]) == [
            (0, [0, 2], 0, False), (0, [1, 3], 1, False), (1, [0, 2], 0, False), (1, [1, 3], 1, False)]
        assert both["restored"] == {"storage": True, "memory": True}, (r, both)
        # a rank saving both kinds in a dying gasp writes its file once
        own = f"mp_rank_00_{r % 2:03d}/distrib_optim_shard_{r % 2:03d}_expert_shard_000.safetensors"
        assert both["dump"] == [own, own], both
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("trainguard-")], "slots left behind"


# ---------------------------------------------------------------- end to end
def gpt(tmp: Path, name: str, *args: str, env: dict | None = None, script: Path = EXAMPLE) -> tuple[int, dict, str]:
    """The GPT-3 example on 2 gloo ranks with a snapshot every iteration,
    under ``trainguard run --max-restarts 1``; (exit code, report, log)."""
    job = f"megasnap-{uuid.uuid4().hex[:8]}"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    environ.update({"TRAINGUARD_HEARTBEAT_INTERVAL_S": "0.5", "PYTHONUNBUFFERED": "1", **(env or {})})
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2", "--monitor-interval", "0.1",
           "--max-restarts", "1", "--job-id", job, str(script), "steps=6", "log_every=0", "backend=gloo",
           "snapshot_every=1", f"report={name}.json", f"checkpoint_dir={name}-ckpt", *args]
    out = subprocess.run(cmd, env=environ, cwd=tmp, capture_output=True, text=True, timeout=200)
    assert not list(Path("/dev/shm").glob(f"trainguard-{job}-*")), "the node agent must remove the slots"
    report = tmp / f"{name}.json"
    return out.returncode, json.loads(report.read_text()) if report.exists() else {}, out.stdout + out.stderr


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    """A fault-free run saving every 2 iterations from its snapshots."""
    tmp = tmp_path_factory.mktemp("gpt-snap")
    rc, report, log = gpt(tmp, "ref", "save_every=2")
    assert rc == 0, log[-4000:]
    return tmp, report, log


@pytest.mark.timeout(200)
def test_periodic_saves_are_written_in_the_background_in_megatrons_layout(fault_free):
    tmp, report, log = fault_free
    snapshots = report["snapshots"]
    assert snapshots["errors"] == [] and snapshots["resumed_from"] is None, snapshots
    assert [p["step"] for p in snapshots["persisted"]] == [2, 4, 6], snapshots
    ckpt_dir = tmp / "ref-ckpt"
    assert (ckpt_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    for step in (2, 4, 6):
        manifest = json.loads((ckpt_dir / f"iter_{step:07d}" / "manifest.json").read_text())
        assert list(manifest["files"]) == ["mp_rank_00/model_optim_rng.safetensors"], manifest
        assert "xxh3" in manifest["files"]["mp_rank_00/model_optim_rng.safetensors"]  # the checksum it was sealed with
    state, shards = read_file(ckpt_dir / "iter_0000006" / "mp_rank_00" / "model_optim_rng.safetensors")
    assert shards == {} and state["iteration"] == 6
    assert state_sha256({"model": state["model"], "optimizer": state["optimizer"]}) == report["final_state_sha256"]


@pytest.mark.timeout(200)
def test_crash_dump_reuses_the_snapshot_and_the_restart_resumes_from_memory(fault_free):
    tmp, ref, _ = fault_free
    rc, report, log = gpt(tmp, "crash", env={"TRAINGUARD_FAULT": "crash:rank=1,step=3"})
    assert rc == 0, log[-4000:]
    assert report["final_state_sha256"] == ref["final_state_sha256"], log[-4000:]
    assert [(r["strategy"], r["step"], r["rank"]) for r in report["recoveries"]] == [("dump", 3, 1)]
    # The survivor wrote its snapshot of step 3 as the dying-gasp file, as it lay in memory.
    assert "rank 0: the save of step 3 reuses its snapshot in memory" in log, log[-4000:]
    dump = tmp / "crash-ckpt" / "iter_0000003"
    assert sorted(str(p.relative_to(dump)) for p in dump.rglob("*.*")) == [
        "manifest.json", "mp_rank_00/model_optim_rng.safetensors"]
    # The restarted ranks (torch's --max-restarts) resumed from this node's memory.
    assert report["start_step"] == 3 and report["snapshots"]["resumed_from"] == {"step": 3, "source": "memory"}
    for rank in (0, 1):
        assert f"rank {rank} resumed from memory at step 3" in log, log[-4000:]


@pytest.mark.timeout(200)
def test_a_corrupt_snapshot_is_detected_and_that_rank_loads_from_storage(fault_free):
    tmp, ref, _ = fault_free
    # No dump (strategy exit): storage holds the background saves of steps 2 and 4. Rank 1's snapshots
    # are corrupted in memory before it restarts; rank 0's are not.
    rc, report, log = gpt(tmp, "corrupt", "save_every=2", script=CORRUPTING,
                          env={"TRAINGUARD_FAULT": "crash:rank=1,step=5", "TRAINGUARD_STRATEGIES": "exit",
                               "CORRUPT_ON_RESTART": "1"})
    assert rc == 0, log[-4000:]
    assert "fails its checksum (corrupted in memory)" in log, log[-4000:]
    assert "rank 1 resumed from storage at step 4" in log and "rank 0 resumed from memory at step 4" in log, \
        log[-4000:]
    assert report["start_step"] == 4 and report["final_state_sha256"] == ref["final_state_sha256"], log[-4000:]
