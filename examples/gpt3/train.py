"""GPT-3-style pretraining with megatron-core, adapted for fault tolerance the
way MindIO's GPT-3 recipe does it -- with trainguard's drop-in modules.

    trainguard run --nproc-per-node 4 examples/gpt3/train.py steps=20 report=report.json

A hydra app (settings: ``conf/config.yaml``). The training function follows
the recipe step by step: ``mega.load_checkpoint`` at start, the controller
and processor started inside ``@ttp.ttp_to_persist def train``, the save and
rename handlers registered, ``barrier -> ttp_start_updating_os -> step ->
ttp_end_updating_os(iteration + 1)`` around every update and
``ttp_set_ckpt_args`` after it. When a rank dies, one healthy replica per
model-parallel slice writes a dying-gasp checkpoint in Megatron's layout
(``iter_0000123/mp_rank_00/model_optim_rng.pt``), every rank exits with 75,
and relaunching the same command resumes from it: compare
``final_state_sha256`` with a fault-free run.

On GPUs, ``optimizer=replicated`` trains with megatron's DDP and distributed
optimizer kept in ``replicas`` instances (``device=cuda``); the dying gasp
then writes one copy of each optimizer shard.
"""

from __future__ import annotations

import time

SCRIPT_STARTED = time.perf_counter()

import json
import logging
import os
import sys
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer.module import Float16Module
from omegaconf import DictConfig
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import trainguard.compat.mindio_ttp.framework_ttp as ttp
import trainguard.compat.mindio_ttp.megatron_ttp as mega
from trainguard.adapters.megatron.kinds import shard_state
from trainguard.adapters.torch.state import state_sha256
from trainguard.compat.mindio_ttp.state import TTP
from trainguard.core import FaultInjector
from trainguard.core.faults import read_fault_log

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import batch, build  # noqa: E402

log = logging.getLogger("gpt3")


def launch_path(value) -> Path | None:
    return None if value in (None, "") else Path(hydra.utils.to_absolute_path(str(value)))


def reduce_grads(model: torch.nn.Module, group) -> None:
    """Average gradients over the data-parallel group in one flat all-reduce
    (parameter order, so the summation order never changes across restarts)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)


def megatron_optimizer(cfg: DictConfig, model: torch.nn.Module, instances: int):
    """megatron's DDP around ``model`` and its distributed optimizer, kept in
    ``instances`` copies (trainguard's replicated optimizer)."""
    if cfg.device != "cuda":
        raise SystemExit(f"optimizer={cfg.optimizer} is megatron's distributed optimizer, which allocates on CUDA: "
                         f"set device=cuda (or optimizer=torch)")
    if cfg.bf16:  # as Megatron-LM wraps it: bf16 weights, inputs cast on the way in, outputs back to fp32
        model = Float16Module(model.config, model)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, num_distributed_optimizer_instances=instances, grad_reduce_in_fp32=True),
        model)
    o = cfg.optim
    config = OptimizerConfig(optimizer="adam", use_distributed_optimizer=True, lr=o.lr, min_lr=o.min_lr,
                             weight_decay=o.weight_decay,
                             adam_beta1=o.betas[0], adam_beta2=o.betas[1], clip_grad=o.clip_grad, bf16=cfg.bf16,
                             params_dtype=torch.bfloat16 if cfg.bf16 else torch.float32)
    return ddp, mega.replicated_optimizer(config, [ddp])


def optimizer_state_mb(optimizer, own_main_params: bool) -> float:
    """This rank's optimizer state: the moments, plus the fp32 main parameters
    when they are copies of their own (a bf16 model; with fp32 the main
    parameters are views of the model's)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    tensors = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t)]
    if own_main_params:
        tensors += [p for g in inner.param_groups for p in g["params"]]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def state_digest(model, optimizer) -> str:
    """SHA-256 of the model and the optimizer state (every rank's shard of it
    with a distributed optimizer)."""
    if not isinstance(model, DistributedDataParallel):
        return state_sha256({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    shards: list = [None] * dist.get_world_size()
    dist.all_gather_object(shards, state_sha256(shard_state(optimizer)))
    return state_sha256({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "shards": shards})


@ttp.ttp_to_persist
def train(cfg: DictConfig, model, optimizer, opt_param_scheduler, iteration: int, injector: FaultInjector) -> int:
    # begin to init ttp processor & controller (the recipe's lines, unchanged)
    cur_rank = torch.distributed.get_rank()
    world_size: int = torch.distributed.get_world_size()
    master_ip = os.getenv("MASTER_ADDR")
    port = int(os.getenv("TTP_PORT", str(cfg.ttp_port)))
    dp_ranks = dist.get_process_group_ranks(mpu.get_data_parallel_group())
    if cur_rank == 0:
        ttp.ttp_init_controller(cur_rank, world_size, max(1, len(dp_ranks) // 2), False)
        ttp.ttp_start_controller(master_ip, port)
    ttp.ttp_init_processor(cur_rank, dp_ranks, len(dp_ranks), world_size, max(1, len(dp_ranks) // 2), False)
    ttp.ttp_start_processor(master_ip, port)
    ttp.ttp_register_save_ckpt_handler(mega.ttp_save_checkpoint)
    ttp.ttp_register_rename_handler(mega.rename_save_result)
    if cfg.backend == "trainguard":  # collectives a STOP can release: in-place recovery (UCE, comm faults)
        mega.register_recovery_handlers()
    if ttp.tft_get_repair_step() >= 0:  # run again after an in-place recovery: from the step it rolled back to
        iteration = ttp.tft_get_repair_step()
    ttp.ttp_set_ckpt_args((iteration, model, optimizer, opt_param_scheduler))

    dp_group, dp_rank = mpu.get_data_parallel_group(), mpu.get_data_parallel_rank()
    megatron_ddp = isinstance(model, DistributedDataParallel)
    global_batch = cfg.micro_batch_size * mpu.get_data_parallel_world_size()
    times = []
    while iteration < cfg.steps:
        started = time.perf_counter()
        injector.strike("forward", iteration)
        data = batch(cfg.seed, iteration, dp_rank, micro_batch=cfg.micro_batch_size,
                     seq_length=cfg.model.seq_length, vocab_size=cfg.model.vocab_size, device=cfg.device)
        loss = model(data["input_ids"], data["position_ids"], data["attention_mask"],
                     labels=data["labels"]).float().mean()
        if megatron_ddp:
            model.zero_grad_buffer()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        injector.strike("backward", iteration)
        if megatron_ddp:
            model.finish_grad_sync()  # reduce-scatter within an instance, all-reduce across instances
        else:
            reduce_grads(model, dp_group)
        torch.distributed.barrier()  # all ranks meet before the update (the recipe's barrier)
        ttp.ttp_start_updating_os(-1)
        optimizer.step()
        ttp.ttp_end_updating_os(iteration + 1)
        injector.strike("optimizer", iteration)
        opt_param_scheduler.step(increment=global_batch)
        iteration += 1
        ttp.ttp_set_ckpt_args((iteration, model, optimizer, opt_param_scheduler))
        injector.after_step(iteration, time.perf_counter() - started)
        if cfg.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        if cfg.log_every and iteration % cfg.log_every == 0 and cur_rank == 0:
            log.info("iteration %d loss %.4f lr %.3g step %.3fs", iteration, loss.item(),
                     optimizer.param_groups[0]["lr"], times[-1])
        if cfg.save_every and iteration % cfg.save_every == 0:
            saving = time.perf_counter()
            mega.save_checkpoint(iteration, model, optimizer, opt_param_scheduler)
            TTP.save_times = [*getattr(TTP, "save_times", []), time.perf_counter() - saving]
    TTP.step_times = times
    return iteration


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    report_path, checkpoint_dir = launch_path(cfg.report), launch_path(cfg.checkpoint_dir)
    if cfg.fault and "TRAINGUARD_FAULT" not in os.environ:
        os.environ["TRAINGUARD_FAULT"] = str(cfg.fault)
    if cfg.snapshot_every and "TRAINGUARD_SNAPSHOT_EVERY" not in os.environ:
        os.environ["TRAINGUARD_SNAPSHOT_EVERY"] = str(cfg.snapshot_every)
    os.environ["TRAINGUARD_CHECKPOINT_DIR"] = str(checkpoint_dir)
    if cfg.backend == "trainguard":
        from trainguard.adapters.torch import backend  # noqa: F401 - registers init_process_group("trainguard")
    dist.init_process_group(cfg.backend)
    p = cfg.parallel
    if cfg.optimizer not in ("torch", "replicated"):
        raise SystemExit(f"optimizer={cfg.optimizer}: choose torch or replicated")
    instances = cfg.replicas if cfg.optimizer == "replicated" else 1
    if cfg.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    mpu.initialize_model_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                  context_parallel_size=p.context_parallel_size,
                                  num_distributed_optimizer_instances=instances)
    if p.pipeline_model_parallel_size != 1 or p.context_parallel_size != 1:
        raise SystemExit("this example's training step runs TP x DP; PP and CP need megatron's schedules "
                         "(parallel_state accepts them, see tests/test_megatron_layout.py)")
    torch.manual_seed(cfg.seed)
    if cfg.device == "cuda":  # megatron's CUDA RNG tracker (dropout in tensor-parallel regions), seeded as Megatron-LM does
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
    model = build(cfg, tensor_parallel=p.tensor_model_parallel_size, device=cfg.device)
    if cfg.optimizer == "torch":
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                                      betas=tuple(cfg.optim.betas))
    else:
        model, optimizer = megatron_optimizer(cfg, model, instances)
    global_batch = cfg.micro_batch_size * mpu.get_data_parallel_world_size()
    opt_param_scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=cfg.optim.lr, min_lr=cfg.optim.min_lr,
        lr_warmup_steps=cfg.optim.warmup_steps * global_batch, lr_decay_steps=cfg.steps * global_batch,
        lr_decay_style="cosine", start_wd=cfg.optim.weight_decay, end_wd=cfg.optim.weight_decay,
        wd_incr_steps=cfg.steps * global_batch, wd_incr_style="constant")
    start = mega.load_checkpoint(model, optimizer, opt_param_scheduler, device=cfg.device)
    rank = dist.get_rank()
    injector = FaultInjector.from_env(rank, world_size=dist.get_world_size(),
                                      log_path=checkpoint_dir / ".trainguard" / "faults.jsonl")

    iteration = train(cfg, model, optimizer, opt_param_scheduler, start, injector)
    times = getattr(TTP, "step_times", [])
    mega.close_snapshots()  # with snapshots: the last saves are on storage before the report says so
    report = {
        "steps_completed": iteration,
        "start_step": start,
        **TTP.history_report(),
        **mega.snapshot_report(),
        "final_state_sha256": state_digest(model, optimizer),
        "step_time_s": sorted(times)[len(times) // 2] if times else None,
        "periodic_save_s": getattr(TTP, "save_times", []),  # each save_checkpoint call, on this rank
        "wall_s": time.perf_counter() - SCRIPT_STARTED,
        "faults": read_fault_log(checkpoint_dir / ".trainguard" / "faults.jsonl"),
        "parallel": {"tp": p.tensor_model_parallel_size, "dp": mpu.get_data_parallel_world_size()},
        "optimizer": {"kind": cfg.optimizer, "instances": instances, "bf16": bool(cfg.bf16),
                      "state_MB": optimizer_state_mb(optimizer, cfg.optimizer != "torch" and cfg.bf16)},
        "cuda_max_allocated_MB": torch.cuda.max_memory_allocated() / 2**20 if cfg.device == "cuda" else None,
    }
    TTP.processor.close(finished=True)
    if rank == 0:
        log.info("done: %d iterations (resumed at %d), lost %d, state %s", iteration, start, report["lost_steps"],
                 report["final_state_sha256"][:16])
        if report_path is not None:
            report_path.parent.mkdir(parents=True, exist_ok=True)
            report_path.write_text(json.dumps(report, indent=1) + "\n")
    dist.barrier()
    mpu.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
