"""Stand-ins for the megatron objects the checkpoint code handles that cannot
be built on CPU, shared by the workers that run under torchrun."""

import torch
from megatron.core import parallel_state as ps


class DistributedOptimizer:
    """megatron's DistributedOptimizer as the checkpoint code sees it (its
    own needs CUDA): an inner torch optimizer over this rank's shard of the
    main parameters; ``state_dict()`` holds no parameter state."""

    def __init__(self, shard: torch.Tensor) -> None:
        self.optimizer = torch.optim.AdamW([shard], lr=0.1)

    def state_dict(self) -> dict:
        return {"optimizer": {"param_groups": [{"lr": 0.1}]}}


def shard_setup(value: float) -> tuple:
    """(model, this rank's shard of the main parameters, its optimizer) after one step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)  # the same on every rank
    index = ps.get_data_parallel_rank(with_context_parallel=True, partial_data_parallel=True)
    shard = torch.nn.Parameter(torch.arange(6.0) + 100 * index)
    opt = DistributedOptimizer(shard)
    shard.grad = torch.full_like(shard, value)
    opt.optimizer.step()
    return model, shard, opt


def moe_setup(seed: int) -> tuple:
    """(model, dense optimizer) whose weights differ across expert-parallel ranks."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        model.weight += ps.get_expert_model_parallel_rank()  # experts differ across expert-parallel ranks
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return model, opt


class ExpertDistributedOptimizer(DistributedOptimizer):
    """The distributed optimizer megatron builds for the expert parameters:
    its param groups say ``is_expert_parallel``."""

    def __init__(self, shard: torch.Tensor) -> None:
        self.optimizer = torch.optim.AdamW([{"params": [shard], "is_expert_parallel": True}], lr=0.1)


class ChainedOptimizer:
    """megatron's chain of a dense and an expert optimizer, as the checkpoint code sees it."""

    def __init__(self, optimizers: list) -> None:
        self.chained_optimizers = optimizers

    def state_dict(self) -> list:
        return [o.state_dict() for o in self.chained_optimizers]


class MoEModel(torch.nn.Module):
    """A dense layer and this expert-parallel rank's expert (``allreduce=False``, as megatron marks it)."""

    def __init__(self, value: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = torch.nn.Linear(4, 4)
        self.expert = torch.nn.Linear(4, 4)
        with torch.no_grad():
            for p in self.parameters():
                p += value
            self.expert.weight += 10 * ps.get_expert_model_parallel_rank()
        for p in self.expert.parameters():
            p.allreduce = False


def moe_shard_setup(value: float) -> tuple:
    """(model, {"dense", "expert"} shards of the main parameters, chained
    distributed optimizers) after one step, under EP 2 and 2 instances."""
    model = MoEModel(value)
    dense_index = ps.get_data_parallel_rank(with_context_parallel=True, partial_data_parallel=True)
    expert_index = ps.get_expert_data_parallel_rank(partial_expert_data_parallel=True)
    ep = ps.get_expert_model_parallel_rank()
    shards = {"dense": torch.nn.Parameter(torch.arange(6.0) + 100 * dense_index + value),
              "expert": torch.nn.Parameter(torch.arange(3.0) + 1000 * ep + 100 * expert_index + value)}
    opts = [DistributedOptimizer(shards["dense"]), ExpertDistributedOptimizer(shards["expert"])]
    for p, opt in zip(shards.values(), opts):
        p.grad = torch.full_like(p, value)
        opt.optimizer.step()
    return model, shards, ChainedOptimizer(opts)


def shard_values(shards: dict, opt) -> dict:
    """Copies of each shard's main parameters and Adam moments."""
    out = {}
    for (name, p), o in zip(shards.items(), opt.chained_optimizers):
        out.update({f"{name}.main": p.detach().clone(),
                    **{f"{name}.{k}": v.clone() for k, v in o.optimizer.state[p].items()}})
    return out
