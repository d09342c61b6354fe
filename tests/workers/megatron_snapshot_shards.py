"""Under torchrun (4 ranks, gloo): in-memory snapshots of ranks whose
optimizer is sharded (the stand-in of megatron's distributed optimizer, in
2 instances) and of ranks with experts (EP 2): saved in the background in
Megatron's layout, loaded back from storage and from memory, written for a
dying gasp; writes <out>/rank<r>.json."""

import json
import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
from megatron.core import parallel_state as ps  # noqa: E402

from trainguard.adapters.megatron import checkpoint as ckpt  # noqa: E402
from trainguard.adapters.megatron.snapshot import MegatronSnapshots  # noqa: E402
from trainguard.core.snapshot import SnapshotDir, State  # noqa: E402

from megatron_standins import moe_setup, moe_shard_setup, shard_setup, shard_values  # noqa: E402

root = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
directory = SnapshotDir.create(f"shards-{rank}", root)  # one per rank here; the node agent's under trainguard run
snapshots = MegatronSnapshots(directory, rank, count=2, save_timeout_s=60)


def saved_and_sealed(store, step: int, model, opt) -> None:
    """Save ``step`` from memory and wait until every rank's save is
    final and its snapshot sealed."""
    snapshots.save(store, step, model, opt, None, history={})
    snapshots.wait(60)
    while not any(s.info() and s.info().step == step and s.info().state is State.SEALED for s in snapshots.slots):
        snapshots.poll(timeout=0.05)
    dist.barrier()


def shard_of(shard, opt) -> dict:
    return {"main": shard.detach().clone(), **{k: v.clone() for k, v in opt.optimizer.state[shard].items()}}


out = {}
ps.initialize_model_parallel(num_distributed_optimizer_instances=2)
store = ckpt.megatron_store(f"{root}/sharded")
model, shard, opt = shard_setup(1.0)
saved = shard_of(shard, opt)
saved_and_sealed(store, 5, model, opt)
found = store.latest()
restored = {}
for source in ("storage", "memory"):
    model2, shard2, opt2 = shard_setup(-3.0)  # other values: the load must bring back the saved ones
    step, _ = ckpt.load(store, model2, opt2, None) if source == "storage" else snapshots.load(store, model2, opt2, None)
    back = shard_of(shard2, opt2)
    restored[source] = step == 5 and all(torch.equal(saved[k], back[k]) for k in saved) and \
        all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
out["sharded"] = {"files": sorted(found.manifest["files"]), "shards": found.manifest["layout"]["shards"],
                  "restored": restored, "resumed_from": snapshots.resumed_from,
                  "dump": [f.name for f in snapshots.write_rank(ckpt.megatron_store(f"{root}/sharded-dump"), 5, model,
                                                                opt, None, kind=0, history={})],
                  "reused": list(snapshots.reused)}
ps.destroy_model_parallel()

ps.initialize_model_parallel(expert_model_parallel_size=2)
store = ckpt.megatron_store(f"{root}/moe")
model, opt = moe_setup(0)
saved_and_sealed(store, 7, model, opt)
found = store.latest()
model2, opt2 = moe_setup(1)
step, _ = ckpt.load(store, model2, opt2, None)
dump = ckpt.megatron_store(f"{root}/moe-dump")
out["moe"] = {"files": sorted(found.manifest["files"]), "shards": found.manifest["layout"]["shards"],
              "restored": step == 7 and all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters())),
              "dense_dump": [f.name for f in snapshots.write_rank(dump, 7, model, opt, None, kind=0, history={})],
              "expert_dump": [f.name for f in snapshots.write_rank(dump, 7, model, opt, None, kind=1, history={})]}
ps.destroy_model_parallel()

# Experts (EP 2) and the distributed optimizer in 2 instances: each saver's
# file holds its dense and its expert shard; a rank finds its dense shard
# in whichever file holds it.
ps.initialize_model_parallel(expert_model_parallel_size=2, num_distributed_optimizer_instances=2)
store = ckpt.megatron_store(f"{root}/moe-sharded")
model, shards, opt = moe_shard_setup(1.0)
saved, saved_model = shard_values(shards, opt), {k: v.clone() for k, v in model.state_dict().items()}
saved_and_sealed(store, 6, model, opt)
found = store.latest()
restored = {}
for source in ("storage", "memory"):
    model2, shards2, opt2 = moe_shard_setup(-3.0)
    step, _ = ckpt.load(store, model2, opt2, None) if source == "storage" else snapshots.load(store, model2, opt2, None)
    back = shard_values(shards2, opt2)
    restored[source] = step == 6 and all(torch.equal(saved[k], back[k]) for k in saved) and \
        all(torch.equal(saved_model[k], v) for k, v in model2.state_dict().items())
dump = ckpt.megatron_store(f"{root}/moe-sharded-dump")
out["moe_sharded"] = {"files": sorted(found.manifest["files"]), "shards": found.manifest["layout"]["shards"],
                      "restored": restored,
                      "dump": [f.name for kind in (0, 1)
                               for f in snapshots.write_rank(dump, 6, model, opt, None, kind=kind, history={})]}
ps.destroy_model_parallel()
snapshots.shutdown(0)
directory.remove()
with open(f"{root}/rank{rank}.json", "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
__import__("gc").freeze()  # exit without a last full collection of the heap: ~1 s of CPU per worker
