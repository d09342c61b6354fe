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

from megatron_standins import moe_setup, moe_shard_setup, shard_setup, shard_values  # noqa: E402

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
# a shard file written before experts were sharded (format 1: no kind) still loads, as the dense shard
from trainguard.adapters.megatron.kinds import apply_shard, shard_state  # noqa: E402

older = {k: v for k, v in shard_state(opt).items() if k != "kind"}
model3, shard3, opt3 = shard_setup(-5.0)
apply_shard({**older, "format": "trainguard-distrib-optim-1"}, opt3, "a format-1 file")
format1 = torch.equal(shard3.detach(), saved["main"]) and torch.equal(opt3.optimizer.state[shard3]["exp_avg"],
                                                                      saved["exp_avg"])
out["sharded"] = {"format1": format1, "step": step, "files": sorted(found.manifest["files"]),
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

# Experts (EP 2) with megatron's distributed optimizer in 2 instances: a dense
# and an expert optimizer, each sharded across its own group.
ps.initialize_model_parallel(expert_model_parallel_size=2, num_distributed_optimizer_instances=2)
from trainguard.adapters.megatron import repair  # noqa: E402

rank = dist.get_rank()
store = ckpt.megatron_store(f"{sys.argv[1]}/moe-sharded")
model, shards, opt = moe_shard_setup(1.0)
saved, saved_model = shard_values(shards, opt), {k: v.clone() for k, v in model.state_dict().items()}
ckpt.save(store, 5, model, opt, None)
found = store.latest()
model2, shards2, opt2 = moe_shard_setup(-3.0)
step, _ = ckpt.load(store, model2, opt2, None)
back = shard_values(shards2, opt2)
dump = ckpt.megatron_store(f"{sys.argv[1]}/moe-sharded-dump")
out["moe_sharded"] = {
    "step": step, "files": sorted(found.manifest["files"]), "shards": found.manifest["layout"]["shards"],
    "restored": sorted(k for k in saved if torch.equal(saved[k], back[k])),
    "model_restored": all(torch.equal(saved_model[k], v) for k, v in model2.state_dict().items()),
    "dense_save": [f.name for f in ckpt.write_rank(dump, 9, model, opt, None, kind=0)],
    "expert_save": [f.name for f in ckpt.write_rank(dump, 9, model, opt, None, kind=1)]}

# In-place repair of rank 1 from rank 3 (the other copy of its dense shard 1
# and of its expert shard 0): one transfer per kind, each carrying only its kind.
model3, shards3, opt3 = moe_shard_setup(-7.0)
if rank == 3:
    for kind in (0, 1):
        repair.send_replica(dist.group.WORLD, 1, model, opt, None, device=torch.device("cpu"), kind=kind)
elif rank == 1:
    expected, expected_model = saved, saved_model
    repair.receive_replica(dist.group.WORLD, 3, model3, opt3, None, device=torch.device("cpu"), kind=0)
    after_dense = shard_values(shards3, opt3)
    dense_only = {"dense_state": sorted(k for k in expected if torch.equal(expected[k], after_dense[k])),
                  "dense_model": sorted(k for k, v in model3.state_dict().items() if torch.equal(expected_model[k], v))}
    repair.receive_replica(dist.group.WORLD, 3, model3, opt3, None, device=torch.device("cpu"), kind=1)
    after = shard_values(shards3, opt3)
    out["moe_repair"] = {**dense_only, "state": sorted(k for k in expected if torch.equal(expected[k], after[k])),
                         "model": sorted(k for k, v in model3.state_dict().items() if torch.equal(expected_model[k], v))}
ps.destroy_model_parallel()

# megatron-core's own GPT with MoE layers (EP 2; built on CPU, its token
# dispatchers run only on CUDA): which state_dict entries are expert state.
ps.initialize_model_parallel(expert_model_parallel_size=2)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from trainguard.adapters.megatron.kinds import expert_keys  # noqa: E402

config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                           use_cpu_initialization=True, num_moe_experts=4, expert_model_parallel_size=2,
                           moe_router_topk=2, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False)
gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False),
               vocab_size=64, max_sequence_length=8)
experts = expert_keys(gpt)
out["moe_gpt_keys"] = {"expert": sorted(k for k in gpt.state_dict() if k in experts),
                       "dense": sorted(k for k in gpt.state_dict() if k not in experts)}
ps.destroy_model_parallel()
with open(f"{sys.argv[1]}/rank{dist.get_rank()}.json", "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
__import__("gc").freeze()  # exit without a last full collection of the heap: ~1 s of CPU per worker
