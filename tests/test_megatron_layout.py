"""The replica registry read from megatron-core's parallel_state, on real
processes (torchrun, 4 ranks, gloo), for each parallel layout megatron
builds on CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
WORKER = Path(__file__).resolve().parent / "workers" / "megatron_layouts.py"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                           "--standalone", str(WORKER), str(out)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)}


def dense(layouts, name, rank):
    return layouts[rank][name]["groups"][0]


def test_plain_data_parallel_is_four_full_copies(layouts):
    for r in range(4):
        assert dense(layouts, "dp4", r) == {"ranks": [0, 1, 2, 3], "replica_cnt": 4, "shards": [[0, 1, 2, 3]]}
        assert len(layouts[r]["dp4"]["groups"]) == 1  # no experts
        assert layouts[r]["dp4"]["subdir"] == "mp_rank_00"


def test_tensor_parallel_copies_sit_across_tensor_slices(layouts):
    assert [dense(layouts, "tp2", r)["ranks"] for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [layouts[r]["tp2"]["subdir"] for r in range(4)] == ["mp_rank_00", "mp_rank_01"] * 2


def test_pipeline_parallel_copies_sit_within_a_stage(layouts):
    assert [dense(layouts, "pp2", r)["ranks"] for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [layouts[r]["pp2"]["subdir"] for r in range(4)] == ["mp_rank_00_000"] * 2 + ["mp_rank_00_001"] * 2


def test_context_parallel_ranks_hold_the_same_weights(layouts):
    for r in range(4):
        assert dense(layouts, "cp2", r)["ranks"] == [0, 1, 2, 3]


def test_expert_parallel_adds_an_expert_group(layouts):
    for r in range(4):
        groups = layouts[r]["ep2"]["groups"]
        assert groups[0]["ranks"] == [0, 1, 2, 3]
        assert groups[1]["ranks"] == ([0, 2] if r % 2 == 0 else [1, 3])
        assert layouts[r]["ep2"]["subdir"] == f"mp_rank_00_{r % 2:03d}"


def test_data_parallel_of_one_cannot_be_protected(layouts):
    for r in range(4):
        assert "data parallelism >= 2" in layouts[r]["tp4"]["error"]


def test_a_single_distributed_optimizer_instance_is_refused(layouts):
    for r in range(4):
        assert "ReplicatedOptimizer" in layouts[r]["distopt1"]["error"]


def test_two_optimizer_instances_are_two_copies_of_each_shard(layouts):
    # megatron cuts [0, 1, 2, 3] into instances [0, 1] and [2, 3]: shard i on position i of each
    for r in range(4):
        assert dense(layouts, "distopt2", r) == {"ranks": [0, 1, 2, 3], "replica_cnt": 2,
                                                 "shards": [[0, 2], [1, 3]]}


def test_a_distributed_optimizers_shards_are_saved_once_each_and_load_back(layouts):
    """2 instances of 2 ranks: shard 0 on ranks 0 and 2, shard 1 on ranks 1
    and 3. One copy of each shard is written (by instance 0), the model file
    once, and every rank gets its own shard's main parameters and moments back."""
    for r in range(4):
        got = layouts[r]["sharded"]
        assert got["step"] == 5 and got["restored"] and got["model_restored"], (r, got)
        assert got["format1"], "a shard file of format 1 (before experts) loads as the dense shard"
        assert got["files"] == ["mp_rank_00/distrib_optim_shard_000.pt", "mp_rank_00/distrib_optim_shard_001.pt",
                                "mp_rank_00/model_optim_rng.pt"], got
        assert sorted((s["copies"], s["saved_by"], s["full"]) for s in got["shards"]) == \
            [([0, 2], 0, False), ([1, 3], 1, False)], got


def test_with_experts_one_copy_per_expert_group_writes_its_ranks_whole_state(layouts):
    """EP 2 with a dense optimizer: ranks 0 and 2 hold experts 0, ranks 1 and
    3 experts 1. One file per expert-parallel rank (``mp_rank_00_000``,
    ``mp_rank_00_001``), each written once, each rank loads its own back; a
    dying-gasp save for the dense shard writes nothing (the expert savers'
    files hold the dense state too)."""
    for r in range(4):
        got = layouts[r]["moe"]
        assert got["step"] == 7 and got["restored"], (r, got)
        assert got["files"] == ["mp_rank_00_000/model_optim_rng.pt", "mp_rank_00_001/model_optim_rng.pt"], got
        assert sorted((s["kind"], s["copies"], s["saved_by"]) for s in got["shards"]) == \
            [(1, [0, 2], 0), (1, [1, 3], 1)], got
        assert got["dense_save"] == []
    assert layouts[0]["moe"]["expert_save"] == ["mp_rank_00_000/model_optim_rng.pt"]
    assert layouts[1]["moe"]["expert_save"] == ["mp_rank_00_001/model_optim_rng.pt"]


MOE_SHARDED_FILES = ["mp_rank_00/distrib_optim_shard_000.pt", "mp_rank_00/distrib_optim_shard_001.pt",
                     "mp_rank_00_000/distrib_optim_expert_shard_000.pt", "mp_rank_00_000/model_optim_rng.pt",
                     "mp_rank_00_001/distrib_optim_expert_shard_000.pt", "mp_rank_00_001/model_optim_rng.pt"]


def test_with_experts_and_a_distributed_optimizer_each_kinds_shards_are_saved_once_and_load_back(layouts):
    """EP 2 and 2 optimizer instances (megatron's chain of a dense and an
    expert DistributedOptimizer): dense shard j on ranks [j, j+2], saved once
    under ``mp_rank_00`` (every expert-parallel rank shares it); each
    expert-parallel rank's expert shard and model file under its
    ``mp_rank_00_EEE``. Every rank gets its own model, dense shard and
    expert shard back, and a dying-gasp save of either kind writes only that
    kind's files."""
    for r in range(4):
        got = layouts[r]["moe_sharded"]
        assert got["step"] == 5 and got["model_restored"], (r, got)
        assert got["restored"] == ["dense.exp_avg", "dense.exp_avg_sq", "dense.main", "dense.step",
                                   "expert.exp_avg", "expert.exp_avg_sq", "expert.main", "expert.step"], (r, got)
        assert got["files"] == MOE_SHARDED_FILES
        assert sorted((s["kind"], s["copies"], s["saved_by"], s["full"]) for s in got["shards"]) == [
            (0, [0, 2], 0, False), (0, [1, 3], 1, False), (1, [0, 2], 0, False), (1, [1, 3], 1, False)]
        ep = r % 2
        assert got["dense_save"] == [f"mp_rank_00/distrib_optim_shard_{r % 2:03d}.pt"]
        assert got["expert_save"] == [f"mp_rank_00_{ep:03d}/model_optim_rng.pt",
                                      f"mp_rank_00_{ep:03d}/distrib_optim_expert_shard_000.pt"]


def test_in_place_repair_with_experts_carries_each_kind_in_its_own_transfer(layouts):
    """Rank 1's state (other values everywhere) repaired from rank 3: the
    dense transfer brings the dense parameters and dense shard and leaves
    the experts alone; the expert transfer then brings the rest."""
    got = layouts[1]["moe_repair"]
    assert set(got["dense_model"]) == {"dense.bias", "dense.weight"}, got
    assert set(got["dense_state"]) - {"expert.step"} == {"dense.exp_avg", "dense.exp_avg_sq", "dense.main",
                                                         "dense.step"}, got  # (Adam's step count is 1 either way)
    assert got["model"] == ["dense.bias", "dense.weight", "expert.bias", "expert.weight"], got
    assert got["state"] == ["dense.exp_avg", "dense.exp_avg_sq", "dense.main", "dense.step", "expert.exp_avg",
                            "expert.exp_avg_sq", "expert.main", "expert.step"], got


def test_the_expert_state_of_megatrons_own_moe_gpt_is_told_apart(layouts):
    """megatron-core's GPT with 4 experts over EP 2 (2 local experts per
    rank): exactly the local experts' entries, their ``_extra_state`` too,
    are expert state; the router, attention and norms are dense."""
    for r in range(4):
        got = layouts[r]["moe_gpt_keys"]
        assert got["expert"] and all(".mlp.experts.local_experts." in k for k in got["expert"]), got
        assert not any(".mlp.experts." in k for k in got["dense"]), got
        assert {"decoder.layers.0.mlp.router.weight", "decoder.layers.0.self_attention.linear_qkv.weight",
                "embedding.word_embeddings.weight"} <= set(got["dense"])
        assert "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2._extra_state" in got["expert"]
        assert len(got["expert"]) == 12  # 2 local experts x 2 linears x (weight, bias, extra state)
