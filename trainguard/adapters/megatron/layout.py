"""Who holds a copy of what, read from ``megatron.core.parallel_state``.

Megatron arranges ranks as TP x CP x EP x DP x PP. Parameters are split
across tensor- and pipeline-parallel ranks and are identical across the
data-parallel ranks *and* the context-parallel ranks (CP splits the
sequence, not the weights), so the dense state of a rank has its copies in
its DP x CP group: megatron's ``get_data_parallel_group(with_context_parallel=True)``.
Expert parameters (MoE) have their copies in the expert data-parallel group.

A distributed optimizer shards its state across that group. With
``num_distributed_optimizer_instances = r`` (megatron's partial distributed
optimizer, MindIO's ``ReplicatedOptimizer`` idea) the group is cut into
``r`` contiguous instances of ``size / r`` ranks and shard ``i`` lives on
position ``i`` of every instance: MindIO's layout with ``replica_cnt = r``
and ``offset = size / r``, which is what :class:`~trainguard.core.ReplicaGroup`
describes by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from trainguard.core import ConfigError, ReplicaGroup

__all__ = ["FILE", "ParallelRank", "parallel_rank", "replica_groups"]

#: Megatron-LM's file of a rank's model, optimizer and RNG states, in its ``mp_rank_*`` directory.
FILE = "model_optim_rng.pt"


def _ps():
    try:
        from megatron.core import parallel_state
    except ImportError as e:
        raise ConfigError(f"the Megatron adapter needs megatron-core (pip install 'trainguard[megatron]'): {e}") from None
    if not parallel_state.model_parallel_is_initialized():
        raise ConfigError("call megatron.core.parallel_state.initialize_model_parallel(...) first")
    return parallel_state


@dataclass(frozen=True)
class ParallelRank:
    """This rank's coordinates in megatron's layout (sizes and ranks)."""

    tp: int
    pp: int
    ep: int
    tp_size: int
    pp_size: int
    ep_size: int
    dp_cp_ranks: tuple[int, ...]
    expert_dp_ranks: tuple[int, ...]

    @property
    def subdir(self) -> str:
        """Megatron's per-rank checkpoint directory: ``mp_rank_{tp:02d}``,
        then ``_{pp:03d}`` with pipeline parallelism, ``_{ep:03d}`` with
        expert parallelism (as ``megatron.training.checkpointing`` names it)."""
        return f"{self.dense_subdir}_{self.ep:03d}" if self.ep_size > 1 else self.dense_subdir

    @property
    def dense_subdir(self) -> str:
        """:attr:`subdir` without the expert-parallel part: where the shards
        of state that every expert-parallel rank shares are kept (the dense
        distributed optimizer's, with experts)."""
        return f"mp_rank_{self.tp:02d}_{self.pp:03d}" if self.pp_size > 1 else f"mp_rank_{self.tp:02d}"

    @property
    def moe(self) -> bool:
        """Expert parameters have copies of their own: expert parallelism is
        on, or the expert data-parallel group differs from the dense one."""
        return self.ep_size > 1 or set(self.expert_dp_ranks) != set(self.dp_cp_ranks)


def parallel_rank() -> ParallelRank:
    ps = _ps()
    return ParallelRank(
        tp=ps.get_tensor_model_parallel_rank(), pp=ps.get_pipeline_model_parallel_rank(),
        ep=ps.get_expert_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_size=ps.get_pipeline_model_parallel_world_size(), ep_size=ps.get_expert_model_parallel_world_size(),
        dp_cp_ranks=tuple(dist.get_process_group_ranks(ps.get_data_parallel_group(with_context_parallel=True))),
        expert_dp_ranks=tuple(dist.get_process_group_ranks(ps.get_expert_data_parallel_group())),
    )


def _instances(ps) -> int:
    """megatron's ``num_distributed_optimizer_instances`` (1 when not set)."""
    try:
        intra = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
    except AssertionError:
        return 1
    if intra is None:
        return 1
    return ps.get_data_parallel_world_size(with_context_parallel=True) // intra.size()


def _group(kind: str, ranks: tuple[int, ...], replica_cnt: int) -> ReplicaGroup:
    size = len(ranks)
    if size == 1:
        raise ConfigError(f"the {kind} state has one copy (its data-parallel group is [{ranks[0]}]): a lost rank "
                          f"leaves nothing to save or repair from; trainguard needs data parallelism >= 2")
    if replica_cnt < 2 or size % replica_cnt:
        raise ConfigError(f"{replica_cnt} copies of the {kind} optimizer state cannot protect it: the count must be "
                          f">= 2 and divide the data-parallel size {size} (ranks {list(ranks)[:16]})")
    group = ReplicaGroup(ranks, replica_cnt)
    group.check()
    return group


def replica_groups(*, distributed_optimizer: bool = False, moe: bool | None = None) -> tuple[ReplicaGroup, ...]:
    """This rank's replica groups: ``(dense,)`` or ``(dense, experts)``.

    Args:
        distributed_optimizer: the optimizer state is sharded across the
            data-parallel group (megatron's ``use_distributed_optimizer``);
            its copies are megatron's distributed-optimizer instances.
        moe: whether expert parameters exist (default: expert parallelism
            is on, or the expert data-parallel group differs from the dense one).

    Raises:
        ConfigError: a layout that cannot be protected: data parallelism of
            1, or a sharded optimizer kept in a single instance.
    """
    ps = _ps()
    here = parallel_rank()
    copies = _instances(ps) if distributed_optimizer else len(here.dp_cp_ranks)
    if distributed_optimizer and copies == 1:
        raise ConfigError("a distributed optimizer with one instance keeps one copy of each shard: use "
                          "trainguard's ReplicatedOptimizer (num_distributed_optimizer_instances >= 2)")
    groups = [_group("dense", here.dp_cp_ranks, copies)]
    if moe is None:
        moe = here.moe
    if moe:
        # megatron cuts the expert data-parallel group into the same number of instances
        expert_copies = copies if distributed_optimizer else len(here.expert_dp_ranks)
        groups.append(_group("expert", here.expert_dp_ranks, expert_copies))
    return tuple(groups)
