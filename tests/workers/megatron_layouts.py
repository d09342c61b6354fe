"""Under torchrun (4 ranks, gloo): the replica groups trainguard reads from
megatron's parallel_state for several layouts, and a sharded checkpoint of a
distributed optimizer kept in 2 instances saved and loaded back; writes
<out>/rank<r>.json."""

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
from megatron.core import parallel_state as ps  # noqa: E402

from trainguard.adapters.megatron import checkpoint as ckpt  # noqa: E402
from trainguard.adapters.megatron import parallel_rank, replica_groups  # noqa: E402
from trainguard.core import ConfigError  # noqa: E402

from megatron_standins import moe_setup, shard_setup  # noqa: E402

LAYOUTS = {
    "dp4": ({}, {}),
    "tp2": ({"tensor_model_parallel_size": 2}, {}),
    "pp2": ({"pipeline_model_parallel_size": 2}, {}),
    "cp2": ({"context_parallel_size": 2}, {}),
    "ep2": ({"expert_model_parallel_size": 2}, {}),
    "tp4": ({"tensor_model_parallel_size": 4}, {}),
    "distopt1": ({}, {"distributed_optimizer": True}),
    "distopt2": ({"num_distributed_optimizer_instances": 2}, {"distributed_optimizer": True}),
}

dist.init_process_group("gloo")
out = {}
for name, (init, kwargs) in LAYOUTS.items():
    ps.initialize_model_parallel(**init)
    try:
        groups = replica_groups(**kwargs)
        out[name] = {"groups": [{"ranks": list(g.rank_list), "replica_cnt": g.replica_cnt,
                                 "shards": [list(s) for s in g.shard_sets]} for g in groups],
                     "subdir": parallel_rank().subdir}
    except ConfigError as e:
        out[name] = {"error": str(e)}
    ps.destroy_model_parallel()
    dist.barrier()


ps.initialize_model_parallel(num_distributed_optimizer_instances=2)
store = ckpt.megatron_store(f"{sys.argv[1]}/ckpt")
model, shard, opt = shard_setup(1.0)
saved = {"main": shard.detach().clone(), **{k: v.clone() for k, v in opt.optimizer.state[shard].items()}}
ckpt.save(store, 5, model, opt, None)
found = store.latest()
model2, shard2, opt2 = shard_setup(-3.0)  # other values: the load must bring back the saved ones
step, _ = ckpt.load(store, model2, opt2, None)
back = {"main": shard2.detach(), **opt2.optimizer.state[shard2]}
out["sharded"] = {"step": step, "files": sorted(found.manifest["files"]),
                  "shards": found.manifest["layout"]["shards"],
                  "restored": all(torch.equal(saved[k], back[k]) for k in saved),
                  "model_restored": all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))}
ps.destroy_model_parallel()

# Experts (EP 2) with a dense optimizer: a rank's file holds its dense and
# expert state, one per expert data-parallel group ([0, 2] and [1, 3]).
ps.initialize_model_parallel(expert_model_parallel_size=2)
os.environ["TRAINGUARD_CHECKPOINT_DIR"] = f"{sys.argv[1]}/moe-dump"
from trainguard.compat.mindio_ttp import megatron_ttp as mega  # noqa: E402

model, opt = moe_setup(0)
store = ckpt.megatron_store(f"{sys.argv[1]}/moe-ckpt")
ckpt.save(store, 7, model, opt, None)
found = store.latest()
model2, opt2 = moe_setup(1)
step, _ = ckpt.load(store, model2, opt2, None)
here = ckpt.parallel_rank_or_world()
args = (9, model, opt, None)
out["moe"] = {"step": step, "files": sorted(found.manifest["files"]), "shards": found.manifest["layout"]["shards"],
              "restored": all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters())),
              "dense_save": [f.name for f in mega.ttp_save_checkpoint(dist.get_rank(), 9, here.dp_cp_ranks, args)],
              "expert_save": [f.name for f in mega.ttp_save_checkpoint(dist.get_rank(), 9, here.expert_dp_ranks,
                                                                        args)] if dist.get_rank() < 2 else None}
ps.destroy_model_parallel()
with open(f"{sys.argv[1]}/rank{dist.get_rank()}.json", "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
