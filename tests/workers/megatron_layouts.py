"""Under torchrun (4 ranks, gloo): the replica groups trainguard reads from
megatron's parallel_state for several layouts; writes <out>/rank<r>.json."""

import json
import sys
import warnings

import torch.distributed as dist

warnings.filterwarnings("ignore")
from megatron.core import parallel_state as ps  # noqa: E402

from trainguard.adapters.megatron import parallel_rank, replica_groups  # noqa: E402
from trainguard.core import ConfigError  # noqa: E402

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
with open(f"{sys.argv[1]}/rank{dist.get_rank()}.json", "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
