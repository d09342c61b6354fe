"""Sharded state in one process (world size 1; ``test_fsdp.py`` runs 4
ranks): what the torch Guard does not protect is refused before step 0;
the FSDP2 layout it protects is described for the replica registry, and
its report, snapshots, DCP saves and resume work on DTensor state;
``trainguard ckpt verify`` finds a checkpoint that claims a full state
while its files hold part of it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from trainguard.core import ConfigError
from trainguard.core.checkpoint import CheckpointStore, SavedShard
from trainguard.torch import Guard


@pytest.fixture
def world(tmp_path, monkeypatch):
    for name in [n for n in __import__("os").environ if n.startswith("TRAINGUARD_")]:
        monkeypatch.delenv(name)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield tmp_path
    dist.destroy_process_group()


def test_fsdp1_is_refused_by_name(world):
    """FSDP1 cannot be built on a CPU-only torch ("FSDP needs a non-CPU
    accelerator device"): an instance made without its constructor, inside
    the model as a wrapped layer sits, stands for it."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    wrapped = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    nn.Module.__init__(wrapped)
    model = nn.Sequential(nn.Linear(4, 4))
    model.add_module("wrapped", wrapped)
    with pytest.raises(ConfigError, match=r"FSDP1 \(torch.distributed.fsdp.FullyShardedDataParallel\)"):
        Guard(model, torch.optim.AdamW(model.parameters()))


def test_tensor_parallel_dtensors_are_refused_naming_the_parameter(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    model = nn.Sequential(nn.Linear(4, 8))
    parallelize_module(model, init_device_mesh("cpu", (1,)), {"0": ColwiseParallel()})
    with pytest.raises(ConfigError, match=r"parameter 0.weight is a DTensor \(Shard\(dim=0\),\)"):
        Guard(model, torch.optim.AdamW(model.parameters()))


def test_fsdp_with_tensor_parallelism_is_refused(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    model = nn.Sequential(nn.Linear(4, 8))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    with pytest.raises(ConfigError, match="tensor parallelism"):
        Guard(model, torch.optim.AdamW(model.parameters()))


def test_fully_shard_is_protected_with_each_rank_its_own_shard(world):
    """FSDP2 over a 1-D mesh: the registry's group holds one copy of each
    shard (none full), and a replicas= that says otherwise is refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from trainguard.core import ReplicaGroup
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ConfigError, match="replicas= does not describe this FSDP2 model"):
        Guard(model, opt, replicas=[ReplicaGroup((0,), 1, replica_shift=1)])
    guard = Guard(model, opt)
    assert guard.sharding.kind == "FSDP2" and guard.groups == (ReplicaGroup((0,), 1),)
    guard.close()


def _sharded_state() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = nn.Linear(4, 4)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    return {"model": model.state_dict(), "step": 3}


def _ckpt_verify(directory, capsys) -> tuple[int, str]:
    """``trainguard ckpt verify DIRECTORY``: its exit code and output."""
    from trainguard.cli import main
    capsys.readouterr()
    code = main(["ckpt", "verify", str(directory)])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("sharded", [True, False])
def test_ckpt_verify_breaks_a_full_shard_holding_dtensors(world, sharded, capsys):
    """What a Guard before the refusal wrote for FSDP2: rank 0's shards,
    the manifest saying ``full``; a plain state beside it passes."""
    store = CheckpointStore(world / "ckpt")
    state = _sharded_state() if sharded else {"model": nn.Linear(4, 4).state_dict(), "step": 3}
    info = store.write(3, "shard_k0_r0-1.pt", lambda f: torch.save(state, f))
    shard = SavedShard(kind=0, copies=(0, 1), full=True, rank=0, files=(info,))
    store.finalize(3, [info], layout={"world_size": 2, "shards": [shard.describe()]})
    code, out = _ckpt_verify(world / "ckpt", capsys)
    if sharded:
        assert code == 1, out
        assert "BROKEN  step_00000003: shard_k0_r0-1.pt is listed as the full state but holds DTensors" in out
    else:
        assert code == 0 and out.startswith("ok"), out


def test_ckpt_verify_breaks_a_dcp_checkpoint_whose_chunks_leave_rows_out(world, capsys):
    """A DCP checkpoint whose metadata names a tensor's full size while its
    chunks cover part of it (what torch's ``torch_save_to_dcp`` made of the
    old Guard's FSDP2 saves) is broken; the whole one passes."""
    import dataclasses
    import pickle
    from trainguard.adapters.torch import dcp
    from trainguard.core.checkpoint import FileInfo, sha256_of
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    store = CheckpointStore(world / "ckpt")
    for step, partial in [(3, False), (4, True)]:
        directory = store.tmp_path(step)
        directory.mkdir(parents=True)
        names = dcp.write_part(directory, {"model": nn.Linear(4, 8).state_dict()}, 0)
        dcp.merge(directory, [0])
        if partial:
            meta = dcp.read_metadata(directory / dcp.METADATA)
            weight = meta.state_dict_metadata["model.weight"]
            weight.chunks[0] = ChunkStorageMetadata(offsets=weight.chunks[0].offsets,
                                                    sizes=torch.Size([2, 4]))  # 2 of the 8 rows
            (directory / dcp.METADATA).write_bytes(pickle.dumps(dataclasses.replace(meta)))
        files = [FileInfo(n, (directory / n).stat().st_size, sha256_of(directory / n))
                 for n in [*names, dcp.METADATA]]
        shard = SavedShard(kind=0, copies=(0,), full=False, rank=0, files=tuple(files[:-1]))
        store.finalize(step, files, layout={"world_size": 1, "format": "dcp", "shards": [shard.describe()]})
    code, out = _ckpt_verify(world / "ckpt", capsys)
    assert code == 1, out
    assert "ok      " in out and "step_00000003" in out
    assert ("BROKEN  step_00000004: it does not hold the whole state: model.weight (size [8, 4]) is held in part: "
            "its chunks hold 8 of its 32 elements") in out, out


def _fsdp_model(seed: int = 0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(guard, model, steps):
    for step in guard.steps(steps):
        with guard.protect():
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            loss = model(x).square().mean()
            guard.optimizer.zero_grad()
            loss.backward()
            guard.optimizer.step()


def _whole(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {"model": msd, "optimizer": osd["state"]}


@pytest.mark.parametrize("snapshot_every", [0, 1])
def test_a_sharded_guard_reports_snapshots_saves_and_resumes(world, snapshot_every):
    """guard.report() hashes DTensor state (it raised on ``.numpy()``),
    snapshots take it (they crashed the process), and a resumed Guard
    holds the same state from its DCP checkpoint."""
    model, opt = _fsdp_model()
    guard = Guard(model, opt, checkpoint_dir=world / "ckpt", save_every=2, snapshot_every=snapshot_every)
    _train(guard, model, 4)
    report = guard.report()
    assert report["steps_completed"] == 4 and len(report["final_state_sha256"]) == 64
    guard.close()
    assert (world / "ckpt" / "step_00000004" / ".metadata").exists()
    again, opt2 = _fsdp_model(seed=1)
    resumed = Guard(again, opt2, checkpoint_dir=world / "ckpt", save_every=2)
    assert resumed.step == 4 and resumed.resumed_from["source"] == "storage"
    want, got = _whole(model, opt), _whole(again, opt2)
    assert want["model"].keys() == got["model"].keys() and want["optimizer"].keys() == got["optimizer"].keys()
    assert all(torch.equal(want["model"][k], got["model"][k]) for k in want["model"])
    assert all(torch.equal(v, got["optimizer"][k][n]) for k, s in want["optimizer"].items() for n, v in s.items())
    assert resumed.report()["final_state_sha256"] == report["final_state_sha256"]
    resumed.close()


def _stage(rank: int, world_size: int, store: str, errors) -> None:
    """One rank of a two-stage pipeline in plain torch: each rank its own
    stage (plain tensors, no DTensor), given to the Guard as its model."""
    import os
    for name in [n for n in os.environ if n.startswith("TRAINGUARD_")]:
        del os.environ[name]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        stage = nn.Sequential(nn.Linear(4, 8), nn.ReLU()) if rank == 0 else nn.Sequential(nn.Linear(8, 2))
        try:
            Guard(stage, torch.optim.SGD(stage.parameters(), lr=0.1)).close()
            errors.put((rank, None))
        except ConfigError as e:
            errors.put((rank, str(e)))
    finally:
        dist.destroy_process_group()


def test_pipeline_stages_in_plain_torch_are_refused_on_every_rank(tmp_path):
    """Two ranks, each holding its own pipeline stage as plain tensors: no
    DTensor tells them apart from data parallelism, so the Guard compares the
    ranks' models (names, shapes, dtypes) and every rank refuses before step
    0 (they were taken as two copies of one model: rank 0's checkpoint was
    'the whole state')."""
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_stage, args=(r, 2, str(tmp_path / "store"), errors)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(errors.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert sorted(got) == [0, 1]
    for rank in (0, 1):
        assert got[rank] is not None and "rank 1's model differs from rank 0's" in got[rank], got
        assert "pipeline parallelism in plain torch" in got[rank]


def test_the_model_structure_compared_across_ranks():
    """What the ranks compare: names, shapes and dtypes (not values, which
    differ before DDP's broadcast), a lazy module's too."""
    from trainguard.adapters.torch.sharding import refuse_different_models, structure
    torch.manual_seed(0)
    a = structure(nn.Sequential(nn.Linear(4, 8)))
    torch.manual_seed(1)
    assert structure(nn.Sequential(nn.Linear(4, 8))) == a
    assert structure(nn.Sequential(nn.Linear(4, 8)).double()) != a
    assert structure(nn.Sequential(nn.Linear(8, 4))) != a
    assert structure(nn.Sequential(nn.LazyLinear(8))) == structure(nn.Sequential(nn.LazyLinear(8)))
    refuse_different_models([a, a, a])
    with pytest.raises(ConfigError, match="rank 2's model differs from rank 0's"):
        refuse_different_models([a, a, structure(nn.Sequential(nn.Linear(8, 4)))])
