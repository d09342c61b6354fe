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
