"""The replicated distributed optimizer (MindIO's ``ReplicatedOptimizer`` idea).

megatron-core's distributed optimizer shards the optimizer state (fp32 main
parameters, Adam moments) across the data-parallel group, one copy of each
shard: losing any rank loses a shard. megatron-core can keep ``r`` instances
of the distributed optimizer instead (``num_distributed_optimizer_instances``:
each instance shards across ``DP / r`` ranks, gradients are reduced across
instances), so every shard lives on ``r`` ranks and any single loss leaves a
complete copy. trainguard uses that rather than re-sharding the optimizer
itself; this module checks the set-up and reports the replica layout.

Memory: with ``P`` parameters and Adam in mixed precision the sharded state is
12 bytes per parameter (fp32 main copy + two moments), so each rank holds
``12 P r / DP`` bytes instead of ``12 P / DP``: ``(r - 1) x 12 P / DP`` more
(DP = 8, r = 2: 1.5 bytes per parameter more, against 18 for the model,
gradients and unsharded optimizer without sharding).

Build it as megatron-core does::

    parallel_state.initialize_model_parallel(tp, pp, num_distributed_optimizer_instances=2)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                               num_distributed_optimizer_instances=2)
    model = [DistributedDataParallel(config, ddp_config, chunk) for chunk in chunks]
    optimizer = replicated_optimizer(OptimizerConfig(optimizer="adam", lr=..., bf16=True,
                                                     use_distributed_optimizer=True), model)

(CUDA only: megatron-core allocates its buffers on the current GPU.)
"""

from __future__ import annotations

from typing import Any, Sequence

from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from trainguard.core import ConfigError, ReplicaGroup

from .layout import replica_groups

__all__ = ["ReplicatedOptimizer", "replicated_optimizer"]


class ReplicatedOptimizer(DistributedOptimizer):
    """megatron-core's ``DistributedOptimizer``, refused unless its shards are
    kept in two or more instances; :attr:`replica_groups` is the layout for
    trainguard's registry. Megatron-LM scripts name it where they named
    ``DistributedOptimizer`` (MindIO's recipe)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.replica_groups: tuple[ReplicaGroup, ...] = replica_groups(distributed_optimizer=True)
        super().__init__(*args, **kwargs)


def replicated_optimizer(config: Any, model_chunks: Sequence[Any], **kwargs: Any) -> Any:
    """``get_megatron_optimizer(config, model_chunks)`` after checking that
    every chunk's DDP config keeps its optimizer in as many instances as
    ``parallel_state`` was initialised with (two or more).

    Returns:
        megatron's optimizer, with ``replica_groups`` set on it.

    Raises:
        ConfigError: a single instance, or chunks that disagree with parallel_state.
    """
    if not getattr(config, "use_distributed_optimizer", False):
        raise ConfigError("the replicated optimizer is megatron's distributed optimizer: pass "
                          "OptimizerConfig(use_distributed_optimizer=True, ...)")
    groups = replica_groups(distributed_optimizer=True)
    copies = groups[0].replica_cnt
    for chunk in model_chunks:
        ddp = getattr(chunk, "ddp_config", None)
        if ddp is None or not ddp.use_distributed_optimizer or ddp.num_distributed_optimizer_instances != copies:
            raise ConfigError(f"wrap every model chunk in megatron's DistributedDataParallel with "
                              f"DistributedDataParallelConfig(use_distributed_optimizer=True, "
                              f"num_distributed_optimizer_instances={copies})")
    optimizer = get_megatron_optimizer(config, list(model_chunks), **kwargs)
    optimizer.replica_groups = groups
    return optimizer
