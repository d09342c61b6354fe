"""One two-rank job of the rank-runtime contract (``tests/test_rank_contract.py``),
launched by ``trainguard run``: the same small training under one framework's
adapter, ``CONTRACT_FRAMEWORK`` = ``torch`` | ``mindspore`` | ``ttp`` (Megatron's
parallel_state driven through MindIO's TTP API).

    rank_job.py STEPS REPORT CHECKPOINT_DIR

Every step draws from the process's random streams -- the framework's
(dropout: torch's generator, MindSpore's op seeds, whose functional
``ops.dropout`` draws from them), Python's ``random`` and NumPy's global
stream -- and each draw changes the update, so a stream not set back after a
recovery shows in the state as well as in the streams' hash; each rank
draws its own count (``OWN_DRAWS``), so its streams are its own. Batches are
a function of (step, rank). ``TRAINGUARD_FAULT`` picks a fault. Every rank
writes ``REPORT.<rank>``: the same keys whatever the framework (``KEYS``).

The TTP job (no loop object: the script's own code) also draws from each
stream whenever a step fails, before the controller's rollback
(:func:`draws_after_a_fault`), and strikes ``phase=optimizer`` inside its
update window, after its peers committed that update
(:func:`await_peers_commit`).
"""

import hashlib
import json
import os
import random
import sys
import time

import numpy as np

KEYS = ("steps_completed", "lost_steps", "pids", "recoveries", "state_sha256", "streams_sha256", "pid")
STEPS, REPORT, CKPT = int(sys.argv[1]), sys.argv[2], sys.argv[3]
FRAMEWORK = os.environ["CONTRACT_FRAMEWORK"]
SAVE_EVERY = int(os.environ.get("CONTRACT_SAVE_EVERY", "0"))  # the Guard's periodic saves (torch, MindSpore)
SNAPSHOT_EVERY = int(os.environ.get("CONTRACT_SNAPSHOT_EVERY", "0"))  # its snapshots: a save persists one
random.seed(0)
np.random.seed(0)


#: Extra draws per rank and step, so each rank's streams are its own. Not
#: for Megatron: its data-parallel ranks share their streams (one seed), and
#: its checkpoint keeps one ``rng_state`` per model-parallel rank, as
#: Megatron-LM's does without ``data_parallel_random_init``.
OWN_DRAWS = 0 if FRAMEWORK == "ttp" else 1


def script_draws(rank: int) -> float:
    """The script's own draws of a step (an augmentation, say): one number
    from Python's stream and one from NumPy's global stream, after this
    rank's own draws."""
    for _ in range(rank * OWN_DRAWS):
        random.random(), np.random.random()
    return 1.0 + 0.1 * random.random() + 0.1 * float(np.random.random())


def draws_after_a_fault() -> None:
    """What a script's own exception handling may draw before the
    controller's rollback (a sample to log, a reshuffle): one number from
    each stream. The TTP job does it on every rank whose step failed; the
    rollback must undo it, or the redone steps draw other numbers than the
    fault-free run did."""
    import torch

    random.random(), np.random.random(), torch.rand(1)


def mark_commit(step: int, rank: int) -> None:
    """Tell the other ranks that this one committed ``step`` (a file in the
    checkpoint directory's hidden part)."""
    os.makedirs(os.path.join(CKPT, ".commits"), exist_ok=True)
    open(os.path.join(CKPT, ".commits", f"{rank}.{step}"), "w").close()


def await_peers_commit(step: int, rank: int, world: int) -> None:
    """Wait until every other rank committed ``step`` (:func:`mark_commit`).
    A rank whose fault strikes inside its update (``phase=optimizer``) waits
    so before striking: its peers then hold the step it was updating to,
    the controller locks that step, and this rank is repaired to a step it
    never committed -- every run alike, not as a race decides."""
    others = [os.path.join(CKPT, ".commits", f"{r}.{step}") for r in range(world) if r != rank]
    deadline = time.monotonic() + 60
    while not all(map(os.path.exists, others)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: the other ranks did not commit step {step} within 60 s")
        time.sleep(0.01)


def streams_sha256(framework_stream: bytes) -> str:
    h = hashlib.sha256(repr(random.getstate()).encode())
    kind, keys, pos, gauss, cached = np.random.get_state()
    h.update(f"{kind}:{pos}:{gauss}:{cached};".encode() + keys.tobytes() + framework_stream)
    return h.hexdigest()


def write(rank: int, out: dict) -> None:
    out = {**out, "pid": os.getpid(), "pids": {str(k): v for k, v in out["pids"].items()}}
    with open(f"{REPORT}.{rank}", "w") as f:
        json.dump({k: out[k] for k in KEYS}, f)


def torch_job() -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainguard.torch import Guard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)))
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), checkpoint_dir=CKPT,
                  save_every=SAVE_EVERY, snapshot_every=SNAPSHOT_EVERY)
    for step in guard.steps(STEPS):
        with guard.protect():
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank)) * script_draws(rank)
            loss = model(x).square().mean()
            guard.optimizer.zero_grad()
            loss.backward()
            guard.optimizer.step()
    out = guard.report()
    write(rank, {**out, "state_sha256": out["final_state_sha256"],
                 "streams_sha256": streams_sha256(torch.get_rng_state().numpy().tobytes())})
    guard.close()
    dist.destroy_process_group()


def mindspore_job() -> None:
    import importlib

    import mindspore as ms
    from mindspore import Tensor, nn, ops
    from mindspore.communication import get_rank, init

    from trainguard.mindspore import Guard

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    init()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    ms.set_seed(0)
    rank = get_rank()
    net = nn.Dense(8, 1, weight_init="ones", bias_init="zeros")
    guard = Guard(net, nn.Momentum(net.trainable_params(), 0.1, 0.9), checkpoint_dir=CKPT, save_every=SAVE_EVERY,
                  snapshot_every=SNAPSHOT_EVERY)
    grad_fn = ms.value_and_grad(nn.WithLossCell(net, nn.MSELoss()), None, guard.optimizer.parameters)
    for step in guard.steps(STEPS):
        with guard.protect():
            data = np.random.default_rng(100 * step + rank)
            x = Tensor(data.standard_normal((4, 8)).astype(np.float32) * script_draws(rank))
            x = ops.dropout(x, p=0.2, training=True)
            _, grads = grad_fn(x, Tensor(data.standard_normal((4, 1)).astype(np.float32)))
            guard.optimizer(grads)
    out = guard.report()
    write(rank, {**out, "state_sha256": out["final_state_sha256"],
                 "streams_sha256": streams_sha256(ms.get_rng_state().asnumpy().tobytes() + repr(sorted(
                     importlib.import_module("mindspore.common.seed")._KERNEL_SEED.items())).encode())})
    guard.close()


def ttp_job() -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps

    import trainguard.compat.mindio_ttp.framework_ttp as ttp
    import trainguard.compat.mindio_ttp.megatron_ttp as mega
    from trainguard.adapters.megatron.session import TTP
    from trainguard.adapters.torch import backend  # noqa: F401 - init_process_group("trainguard")
    from trainguard.adapters.torch.state import state_sha256
    from trainguard.core import FaultInjector

    @ttp.ttp_to_persist
    def train(model, optimizer, iteration: int, injector: FaultInjector) -> int:
        rank, world = dist.get_rank(), dist.get_world_size()
        master, port = os.environ["MASTER_ADDR"], int(os.environ.get("TTP_PORT", "8000"))
        dp_ranks = dist.get_process_group_ranks(ps.get_data_parallel_group())
        if rank == 0:
            ttp.ttp_init_controller(rank, world, 2, False)
            ttp.ttp_start_controller(master, port)
        ttp.ttp_init_processor(rank, dp_ranks, len(dp_ranks), world, 2, False)
        ttp.ttp_start_processor(master, port)
        ttp.ttp_register_save_ckpt_handler(mega.ttp_save_checkpoint)
        ttp.ttp_register_rename_handler(mega.rename_save_result)
        mega.register_recovery_handlers()
        if ttp.tft_get_repair_step() >= 0:
            iteration = ttp.tft_get_repair_step()
        ttp.ttp_set_ckpt_args((iteration, model, optimizer, None))
        in_update_fault = any(s.phase == "optimizer" for s in injector.specs)
        try:
            while iteration < STEPS:
                injector.strike("forward", iteration)
                g = torch.Generator().manual_seed(100 * iteration + rank)
                x = torch.randn(4, 8, generator=g) * script_draws(rank)
                optimizer.zero_grad(set_to_none=True)
                model(x).square().mean().backward()
                injector.strike("backward", iteration)
                for p in model.parameters():
                    dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
                    p.grad /= len(dp_ranks)
                ttp.ttp_start_updating_os(-1)
                optimizer.step()
                if injector.wants("optimizer"):
                    await_peers_commit(iteration + 1, rank, world)
                injector.strike("optimizer", iteration)  # inside the update window: this rank is caught in it
                ttp.ttp_end_updating_os(iteration + 1)
                if in_update_fault:
                    mark_commit(iteration + 1, rank)
                iteration += 1
                ttp.ttp_set_ckpt_args((iteration, model, optimizer, None))
        except Exception:
            draws_after_a_fault()  # the script's own handling of a failed step, before the rollback
            raise
        return iteration

    os.environ["TRAINGUARD_CHECKPOINT_DIR"] = CKPT
    dist.init_process_group("trainguard")
    ps.initialize_model_parallel()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    start = mega.load_checkpoint(model, optimizer, None)
    injector = FaultInjector.from_env(dist.get_rank(), world_size=dist.get_world_size(),  # a fault strikes once
                                      log_path=os.path.join(CKPT, ".trainguard", "faults.jsonl"))
    steps = train(model, optimizer, start, injector)
    write(dist.get_rank(), {"steps_completed": steps, **TTP.history_report(),
                            "state_sha256": state_sha256({"model": model.state_dict(),
                                                          "optimizer": optimizer.state_dict()}),
                            "streams_sha256": streams_sha256(torch.get_rng_state().numpy().tobytes())})
    TTP.processor.close(finished=True)
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    {"torch": torch_job, "mindspore": mindspore_job, "ttp": ttp_job}[FRAMEWORK]()
    __import__("gc").freeze()  # exit without a last full collection of the heap: ~1 s of CPU per worker
