"""Megatron's checkpoint layout, written so that a reader never sees it half done.

A checkpoint is Megatron-LM's ``torch`` format: ``iter_{:07d}/`` holding one
``mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt`` per model-parallel
rank (:func:`~.state.rank_state`), and ``latest_checkpointed_iteration.txt``
beside it. trainguard writes it through :class:`~trainguard.core.CheckpointStore`:
under ``iter_{:07d}_tmp`` first, with every file's SHA-256 in
``manifest.json``, renamed and tracked by one rank; loading verifies the
manifest and falls back to the newest complete checkpoint.

Only one copy of each shard writes it (any replica holds the same state), so
the dying gasp, where one rank is gone, writes the same files as a periodic
save. Who writes what (:func:`saved_copies`, :func:`write_rank`):

* dense optimizer: the first rank of each data-parallel group writes its
  model file. With experts (MoE) each rank's file holds its dense and its
  expert parameters, so one copy per expert data-parallel group writes it
  (``mp_rank_TT_EEE``: one file per expert-parallel rank) and the dense
  shard writes nothing more.
* megatron's distributed optimizer (kept in ``r`` instances:
  :mod:`.optimizer`): one copy of each shard ``j`` writes
  ``distrib_optim_shard_{j:03d}.pt`` (the fp32 main parameters and the
  inner optimizer's ``state_dict``, for that shard alone), and shard 0's
  saver the model file, whose ``optimizer`` is megatron's
  ``optimizer.state_dict()``, as Megatron-LM's is. With experts the dense
  shards sit in ``mp_rank_TT[_PPP]`` (every expert-parallel rank shares them),
  the expert shards ``distrib_optim_expert_shard_{j:03d}.pt`` in the
  rank's ``mp_rank_TT[_PPP]_EEE``, and expert shard 0's saver writes the
  model file there.

No collective is needed, so a job with a dead rank can write it; it loads
back into the same data-parallel and instance layout. Megatron's
``torch_dist`` format is not used: its save is a collective of the whole
world, which a job with a lost rank cannot run.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Sequence

import torch
import torch.distributed as dist

from trainguard.core import CheckpointError, CheckpointStore
from trainguard.core.checkpoint import MEGATRON, FileInfo, SavedShard, Verified
from trainguard.core.rank.resume import resume

from .kinds import DENSE, EXPERT, shard_of, shard_state, sharded_kinds
from .layout import FILE, ParallelRank, parallel_rank
from .snapfile import holding, read_file
from .state import apply, rank_state

__all__ = ["FILE", "load", "load_found", "megatron_store", "parallel_rank_or_world", "save", "saved_copies",
           "shard_file", "shard_subdir", "write_rank"]

log = logging.getLogger("trainguard.megatron")


def shard_file(index: int, kind: int = DENSE) -> str:
    return f"distrib_optim_{'expert_' if kind == EXPERT else ''}shard_{index:03d}.pt"


def shard_subdir(here: ParallelRank, kind: int) -> str:
    """Where the shards of ``kind`` are kept: the expert shards with the
    rank's model file, the dense ones where every expert-parallel rank finds them."""
    return here.subdir if kind == EXPERT else here.dense_subdir


def model_kind(here: ParallelRank) -> int:
    """The kind whose savers write the model file: with experts, each file
    holds an expert-parallel rank's experts, so the expert savers."""
    return EXPERT if here.moe else DENSE


def megatron_store(root) -> CheckpointStore:
    return CheckpointStore(root, MEGATRON)


def parallel_rank_or_world() -> ParallelRank:
    """This rank's place in megatron's layout, or plain data parallelism over
    the world when parallel_state is not initialised."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        return parallel_rank()
    world = tuple(range(dist.get_world_size())) if dist.is_initialized() else (0,)
    return ParallelRank(0, 0, 0, 1, 1, 1, world, world)


def writes(here: ParallelRank, optimizer: Any, kind: int) -> tuple[bool, bool]:
    """(model file, shard file): what a saver of a ``kind`` shard writes."""
    sharded = kind in sharded_kinds(optimizer)
    model = kind == model_kind(here) and (not sharded or shard_of(kind)[0] == 0)
    return model, sharded


def write_rank(store: CheckpointStore, step: int, model: Any, optimizer: Any, scheduler: Any, *,
               kind: int = DENSE, rng: dict | None = None) -> list[FileInfo]:
    """Write this rank's files of ``step`` under the temporary name, as the
    saver of a ``kind`` shard (0: dense, 1: experts; see the module's
    description for who writes what). ``rng``: the random streams at
    ``step`` (a dying gasp runs after the next step has drawn from them)."""
    here, files = parallel_rank_or_world(), []
    with_model, with_shard = writes(here, optimizer, kind)
    if with_model:
        state = rank_state(step, model, optimizer, scheduler, rng=rng)
        files.append(store.write(step, f"{here.subdir}/{FILE}", lambda f: torch.save(state, f)))
    if with_shard:
        shard = shard_state(optimizer, kind)
        name = f"{shard_subdir(here, kind)}/{shard_file(shard['shard'], kind)}"
        files.append(store.write(step, name, lambda f: torch.save(shard, f)))
    return files


def finalize(store: CheckpointStore, step: int, shards: Sequence[SavedShard], history: dict, rank: int) -> None:
    store.finalize(step, [f for s in shards for f in s.files],
                   layout={"world_size": dist.get_world_size() if dist.is_initialized() else 1,
                           "shards": [s.describe() for s in shards]},
                   meta={"history": history, "finalised_by": rank})


def saved_copies(here: ParallelRank, optimizer: Any) -> list[tuple[int, list[int]]]:
    """``(kind, copies)`` of each shard of this rank's groups that a save
    writes (its first rank saves it): a kind a dense optimizer keeps has
    one shard, its whole group (the expert data-parallel group with
    experts: only that kind then); a kind a distributed optimizer shards
    has one per shard, each on that position of every instance."""
    sharded = sharded_kinds(optimizer)
    ranks = {DENSE: here.dp_cp_ranks, EXPERT: here.expert_dp_ranks}
    kinds = ([DENSE] if DENSE in sharded else []) + [EXPERT] if here.moe else [DENSE]
    out: list[tuple[int, list[int]]] = []
    for kind in kinds:
        if kind in sharded:
            _, size, instances = shard_of(kind)
            span = size // instances  # megatron's instances are contiguous blocks of the group
            out += [(kind, list(ranks[kind][j::span])) for j in range(span)]
        else:
            out.append((kind, list(ranks[kind])))
    return out


def save(store: CheckpointStore, step: int, model: Any, optimizer: Any, scheduler: Any, *,
         history: dict | None = None) -> None:
    """A periodic save (every rank calls it): one copy of each shard writes
    it, rank 0 finalises."""
    here, rank = parallel_rank_or_world(), dist.get_rank()
    sharded = sharded_kinds(optimizer)
    mine = [{"kind": k, "copies": c, "files": [[f.name, f.bytes, f.sha256] for f in
                                               write_rank(store, step, model, optimizer, scheduler, kind=k)]}
            for k, c in saved_copies(here, optimizer) if c[0] == rank]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        shards = [SavedShard(kind=s["kind"], copies=tuple(s["copies"]), full=s["kind"] not in sharded,
                             rank=s["copies"][0], files=tuple(FileInfo(*f) for f in s["files"]))
                  for saver in gathered for s in saver]
        finalize(store, step, shards, history or {}, rank)
    dist.barrier()


def load(store: CheckpointStore, model: Any, optimizer: Any, scheduler: Any, *,
         device: torch.device | str = "cpu") -> tuple[int, dict]:
    """Load the newest complete checkpoint every rank can load into the
    objects (a collective, :func:`trainguard.core.rank.resume.resume`: one whose
    file of some rank does not load gives way to an older one). Returns
    ``(iteration, history)``, ``(0, {})`` when there is none.

    Raises:
        CheckpointError: the ranks share no checkpoint.
        ResumeError: a rank's state did not fit its objects (on every rank).
    """
    found: list[Verified | None] = [None]

    def newest(dropped: set[int]) -> Verified | None:
        found[0] = store.latest(exclude=dropped)
        return found[0]

    def never(*_: Any) -> None:  # no snapshots here
        raise RuntimeError("no memory to load from")
    step = resume({}, newest, gather=all_gather_objects, outcomes=all_gather_objects,
                  rank=dist.get_rank() if dist.is_initialized() else 0, load_memory=never,
                  load_stored=lambda f: load_found(f, model, optimizer, scheduler, device=device))
    if not step:
        return 0, {}
    return step, found[0].manifest.get("meta", {}).get("history", {})


def all_gather_objects(value: Any) -> list:
    """Every rank's ``value`` (picklable; the ranks' own values only), by rank."""
    if not dist.is_initialized():
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _read_pt(path: Any, device: Any) -> dict:
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path} could not be loaded safely: {e}") from None


def load_found(found: Verified, model: Any, optimizer: Any, scheduler: Any, *,
               device: torch.device | str = "cpu") -> None:
    """Load this rank's part of the verified checkpoint ``found`` into the
    objects (no collective): from Megatron's ``.pt`` files, or from the
    persisted snapshots (``.safetensors``, see :mod:`.snapshot`) that hold
    this rank's model state and shards.

    Raises:
        CheckpointError: this rank's file is missing, or does not fit the objects.
    """
    here, names = parallel_rank_or_world(), set(found.manifest.get("files", {}))
    index = {k: shard_of(k)[0] for k in sharded_kinds(optimizer)}
    read: dict[str, tuple[dict | None, dict]] = {}

    def piece(candidates: list[str], kind: int | None, what: str) -> tuple[Any, Any]:
        """The rank state (``kind`` None) or the shard of ``kind`` from the first candidate file there is."""
        name = next((n for n in candidates if n in names), None)
        if name is None:
            raise CheckpointError(f"{found.path} has no {what} (saved with another parallel layout, or without "
                                  f"a distributed optimizer?)")
        where = found.file(name)
        if name not in read:
            with found.open(name) as verified:  # the bytes verified, whatever is at the name now
                if name.endswith(".safetensors"):
                    read[name] = read_file(verified, device)
                else:
                    pt = _read_pt(verified, device)
                    read[name] = (pt, {}) if kind is None else (None, {kind: pt})
        got = read[name][0] if kind is None else read[name][1].get(kind)
        if got is None:
            raise CheckpointError(f"{where} holds no {what}")
        return got, where

    state, where = piece([f"{here.subdir}/{FILE}", *holding(names, here, None, None)], None,
                         f"{here.subdir}/{FILE}")
    if state.get("iteration") != found.step:
        raise CheckpointError(f"{where} holds iteration {state.get('iteration')}, not {found.step}")
    shards = {}
    for kind, j in index.items():
        name = f"{shard_subdir(here, kind)}/{shard_file(j, kind)}"
        shards[kind], _ = piece([name, *holding(names, here, kind, j)], kind, name)
    apply(state, shards, model, optimizer, scheduler, where=where)
    log.info("loaded %s at iteration %d", found.path, found.step)
