"""Sharded state the torch Guard does not protect is refused before step 0,
and ``trainguard ckpt verify`` finds a checkpoint that claims a full state
while its shard holds one rank's part of a sharded one (in one process,
world size 1)."""

from __future__ import annotations

import subprocess
import sys

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


@pytest.mark.parametrize("how", ["tensor parallel", "fully_shard"])
def test_dtensor_state_is_refused_naming_the_parameter(world, how):
    from torch.distributed.device_mesh import init_device_mesh
    model = nn.Sequential(nn.Linear(4, 8))
    if how == "fully_shard":
        from torch.distributed.fsdp import fully_shard
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
        parallelize_module(model, init_device_mesh("cpu", (1,)), {"0": ColwiseParallel()})
    with pytest.raises(ConfigError, match=r"parameter 0.weight is a DTensor \(Shard\(dim=0\),\)"):
        Guard(model, torch.optim.AdamW(model.parameters()))


def _sharded_state() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = nn.Linear(4, 4)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    return {"model": model.state_dict(), "step": 3}


def _ckpt_verify(directory) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainguard.cli", "ckpt", "verify", str(directory)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("sharded", [True, False])
def test_ckpt_verify_breaks_a_full_shard_holding_dtensors(world, sharded):
    """What a Guard before the refusal wrote for FSDP2: rank 0's shards,
    the manifest saying ``full``; a plain state beside it passes."""
    store = CheckpointStore(world / "ckpt")
    state = _sharded_state() if sharded else {"model": nn.Linear(4, 4).state_dict(), "step": 3}
    info = store.write(3, "shard_k0_r0-1.pt", lambda f: torch.save(state, f))
    shard = SavedShard(kind=0, copies=(0, 1), full=True, rank=0, files=(info,))
    store.finalize(3, [info], layout={"world_size": 2, "shards": [shard.describe()]})
    out = _ckpt_verify(world / "ckpt")
    if sharded:
        assert out.returncode == 1, out
        assert "BROKEN  step_00000003: shard_k0_r0-1.pt is listed as the full state but holds DTensors" in out.stdout
    else:
        assert out.returncode == 0 and out.stdout.startswith("ok"), out
