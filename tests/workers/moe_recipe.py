"""The seed's TTP flow on a model with experts (MoE), under ``trainguard run
--nproc-per-node 4`` with megatron's parallel_state at EP 2.

megatron-core's MoE layers allocate on CUDA, so the model is a stand-in
built the way megatron-core marks expert state: a dense layer every rank
holds, and per expert-parallel rank its own experts (parameters with
``allreduce=False``, initialised from a seed of that expert-parallel rank,
with a buffer counting its updates). One torch AdamW over both;
dense gradients are averaged over the data-parallel group, expert
gradients over the expert data-parallel group, as megatron's DDP does.
Dropout in the dense path draws from torch's random stream.

Usage: moe_recipe.py <report.json> <checkpoint dir>; TRAINGUARD_FAULT picks a fault.
MOE_HOLD=RANK,STEP holds that rank's backward strike at that step until every
other rank has committed the step (marker files beside the report), so no
rank is still inside its update when the fault comes, however loaded the
machine.
Rank 0 writes the report: every rank's state digest, history, recoveries.
"""

import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
from megatron.core import parallel_state as ps  # noqa: E402
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors  # noqa: E402

import trainguard.compat.mindio_ttp.framework_ttp as ttp  # noqa: E402
import trainguard.compat.mindio_ttp.megatron_ttp as mega  # noqa: E402
from trainguard.adapters.megatron.session import TTP  # noqa: E402
from trainguard.adapters.torch import backend  # noqa: E402,F401 - init_process_group("trainguard")
from trainguard.adapters.torch.state import state_sha256  # noqa: E402
from trainguard.core import FaultInjector  # noqa: E402

STEPS, HIDDEN, SEED = 6, 16, 0


class Expert(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN) * 0.1)
        self.bias = torch.nn.Parameter(torch.zeros(HIDDEN))
        for p in (self.weight, self.bias):
            p.allreduce = False  # megatron-core's mark of an expert parameter
        self.register_buffer("updates", torch.zeros(()))  # expert state that is no parameter

    def forward(self, x):
        return x @ self.weight + self.bias


class MoE(torch.nn.Module):
    def __init__(self, ep_rank: int) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.dense = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, 1)
        torch.manual_seed(SEED + 1000 + ep_rank)  # each expert-parallel rank's experts differ
        self.experts = torch.nn.ModuleList([Expert(), Expert()])

    def forward(self, x):
        h = torch.nn.functional.dropout(torch.tanh(self.dense(x)), p=0.1, training=True)
        route = (h.sum(-1) > 0).long()
        out = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            picked = route == i
            out[picked] = expert(h[picked])
        return self.head(h + out).squeeze(-1)


def reduce(params: list, group) -> None:
    grads = [p.grad for p in params]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)


@ttp.ttp_to_persist
def train(model, optimizer, iteration: int, injector: FaultInjector) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    master, port = os.getenv("MASTER_ADDR"), int(os.getenv("TTP_PORT", "8000"))
    dp_ranks = dist.get_process_group_ranks(ps.get_data_parallel_group())
    expert_ranks = dist.get_process_group_ranks(ps.get_expert_data_parallel_group())
    if rank == 0:
        ttp.ttp_init_controller(rank, world, 2, False)
        ttp.ttp_start_controller(master, port)
    ttp.ttp_init_processor(rank, dp_ranks, len(dp_ranks), world, 2, False)
    # the dense state has its copies in the data-parallel group, the experts in the expert data-parallel group
    ttp.tft_set_optimizer_replica(rank, [{"rank_list": dp_ranks, "replica_cnt": len(dp_ranks)},
                                         {"rank_list": expert_ranks, "replica_cnt": len(expert_ranks)}])
    ttp.ttp_start_processor(master, port)
    ttp.ttp_register_save_ckpt_handler(mega.ttp_save_checkpoint)
    ttp.ttp_register_rename_handler(mega.rename_save_result)
    mega.register_recovery_handlers()
    if ttp.tft_get_repair_step() >= 0:
        iteration = ttp.tft_get_repair_step()
    ttp.ttp_set_ckpt_args((iteration, model, optimizer, None))
    held_rank, held_step = map(int, os.environ.get("MOE_HOLD", "-1,-1").split(","))
    marker = lambda r, s: f"{sys.argv[1]}.committed-r{r}-{s}"  # noqa: E731
    dense = [p for p in model.parameters() if getattr(p, "allreduce", True)]
    experts = [p for p in model.parameters() if not getattr(p, "allreduce", True)]
    while iteration < STEPS:
        injector.strike("forward", iteration)
        g = torch.Generator().manual_seed(SEED * 7919 + iteration * 101 + ps.get_data_parallel_rank())
        x, y = torch.randn(32, HIDDEN, generator=g), torch.randn(32, generator=g)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if (rank, iteration) == (held_rank, held_step):
            others = [marker(r, iteration) for r in range(world) if r != rank]
            deadline = time.time() + 60
            while not all(map(os.path.exists, others)) and time.time() < deadline:
                time.sleep(0.01)
        injector.strike("backward", iteration)
        reduce(dense, ps.get_data_parallel_group())
        reduce(experts, ps.get_expert_data_parallel_group())
        dist.barrier()
        ttp.ttp_start_updating_os(-1)
        optimizer.step()
        for expert in model.experts:  # a buffer changed with the update (as megatron's router's expert bias is)
            expert.updates += 1
        ttp.ttp_end_updating_os(iteration + 1)
        if held_rank >= 0:
            open(marker(rank, iteration + 1), "w").close()
        injector.strike("optimizer", iteration)
        iteration += 1
        ttp.ttp_set_ckpt_args((iteration, model, optimizer, None))
        injector.after_step(iteration, 0.0)
    return iteration


def main() -> None:
    report, checkpoints = sys.argv[1], sys.argv[2]
    os.environ["TRAINGUARD_CHECKPOINT_DIR"] = checkpoints
    dist.init_process_group("trainguard")
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    model = MoE(ps.get_expert_model_parallel_rank())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    start = mega.load_checkpoint(model, optimizer, None)
    injector = FaultInjector.from_env(dist.get_rank(), world_size=dist.get_world_size())
    iteration = train(model, optimizer, start, injector)
    digests: list = [None] * dist.get_world_size()
    dist.all_gather_object(digests, state_sha256({"model": model.state_dict(), "optimizer": optimizer.state_dict()}))
    out = {"steps_completed": iteration, "start_step": start, "digests": digests, **TTP.history_report()}
    TTP.processor.close(finished=True)
    if dist.get_rank() == 0:
        with open(report, "w") as f:
            json.dump(out, f)
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    __import__("gc").freeze()  # exit without a last full collection of the heap: ~1 s of CPU per worker
