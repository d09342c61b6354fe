"""ResNet-50 data-parallel training, protected by trainguard.

    trainguard run --nproc-per-node 4 examples/resnet50/train.py \
        steps=20 seed=0 report=report.json checkpoint_dir=ckpt

A hydra app (settings and their meaning: ``conf/config.yaml``). The loop is
the plain Guard pattern: a fault inside ``guard.protect()`` (a device memory
error, a lost peer) is recovered by trainguard's controller (retried in
place, or dumped to ``checkpoint_dir`` and resumed by relaunching the same
command), and the final state is the one a fault-free run reaches: compare
``final_state_sha256`` in the reports.
"""

from __future__ import annotations

import time

SCRIPT_STARTED = time.perf_counter()  # before the heavy imports: wall_s in the report is the script's wall time

import json
import logging
import os
import random
import socket
import statistics
import sys
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP

from trainguard.core.faults import read_fault_log
from trainguard.torch import Guard

sys.path.insert(0, str(Path(__file__).resolve().parent))  # model.py, data.py next to this file
from data import ImageFolder, ResumableLoader, SyntheticImages
from model import resnet50

log = logging.getLogger("resnet50")


def launch_path(path: str | None) -> Path | None:
    """``path`` relative to the directory the job was launched from."""
    return None if path in (None, "") else Path(hydra.utils.to_absolute_path(str(path)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_optimizer(cfg: DictConfig, params) -> torch.optim.Optimizer:
    o = cfg.optim
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=o.momentum, nesterov=o.nesterov,
                               weight_decay=o.weight_decay)
    if o.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
    raise ValueError(f"optim.name must be sgd or adamw, got {o.name!r}")


def make_scheduler(cfg: DictConfig, optimizer: torch.optim.Optimizer):
    s = cfg.sched
    if s.name == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, cfg.steps))
    if s.name == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=s.step_size, gamma=s.gamma)
    if s.name == "constant":
        return torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
    raise ValueError(f"sched.name must be cosine, step or constant, got {s.name!r}")


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    report_path, checkpoint_dir = launch_path(cfg.report), launch_path(cfg.checkpoint_dir)

    # The fault must be in the environment before the Guard reads it.
    env_fault = os.environ.get("TRAINGUARD_FAULT")
    if cfg.fault and env_fault is None:
        os.environ["TRAINGUARD_FAULT"] = str(cfg.fault)

    if "WORLD_SIZE" not in os.environ:  # plain `python train.py ...`: a one-process job (checkpoints, no recovery)
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    if cfg.device == "cuda":
        local_rank, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local_rank >= gpus and cfg.backend != "gloo":  # NCCL refuses two ranks on one GPU
            raise ValueError(f"local rank {local_rank} has no GPU of its own ({gpus} visible); use backend=gloo "
                             f"to let ranks share GPUs")
        device = torch.device("cuda", local_rank % gpus)  # gloo: ranks share the GPUs in turn
        torch.cuda.set_device(device)
        if cfg.deterministic:  # a step redone after a fault must compute what it computed the first time
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts (torch's docs)
            torch.backends.cudnn.benchmark = False
            torch.use_deterministic_algorithms(True)  # an op without a deterministic kernel raises, never differs
    elif cfg.device == "cpu":
        device = torch.device("cpu")
    else:
        raise ValueError(f"device must be cpu or cuda, got {cfg.device!r}")
    dist.init_process_group(cfg.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0 and cfg.fault and env_fault is not None and env_fault != cfg.fault:
        log.warning("TRAINGUARD_FAULT=%r is set in the environment and wins over fault=%r", env_fault, cfg.fault)

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    # Data: synthetic batches are a function of (seed, step, rank); the image
    # folder loader carries its position, which the Guard saves and restores.
    loader = synthetic = None
    if cfg.data.kind == "synthetic":
        num_classes = cfg.model.num_classes or 10
        synthetic = SyntheticImages(cfg.seed, num_classes, cfg.batch_size, cfg.image_size)
    elif cfg.data.kind == "imagefolder":
        if not cfg.data.path:
            raise ValueError("data.kind=imagefolder needs data.path=DIR (DIR/<class>/<image>)")
        dataset = ImageFolder(launch_path(cfg.data.path), cfg.image_size, cfg.data.mean, cfg.data.std)
        num_classes = cfg.model.num_classes or len(dataset.classes)
        loader = ResumableLoader(dataset, cfg.batch_size, rank, world_size, cfg.seed)
        if rank == 0:
            log.info("%d images in %d classes under %s; %d batches per epoch per rank", len(dataset),
                     len(dataset.classes), dataset.root, loader.batches_per_epoch)
    else:
        raise ValueError(f"data.kind must be synthetic or imagefolder, got {cfg.data.kind!r}")

    torch.manual_seed(cfg.seed)  # every rank builds the same initial model (DDP broadcasts rank 0's anyway)
    net = resnet50(num_classes, stem=cfg.model.stem, zero_init_residual=cfg.model.zero_init_residual).to(device)
    if cfg.compile:  # compiled at the first step; the Guard keeps the artifacts for restarted processes
        net = torch.compile(net)
    model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = make_optimizer(cfg, model.parameters())
    scheduler = make_scheduler(cfg, optimizer)
    guard = Guard(model, optimizer, scheduler=scheduler, data=loader, checkpoint_dir=checkpoint_dir,
                  save_every=cfg.save_every, keep=cfg.keep, snapshot_every=cfg.snapshot_every,
                  snapshots_in_memory=cfg.snapshots_in_memory, snapshot_shared=cfg.snapshot_shared,
                  compile_cache_key={"batch_size": cfg.batch_size, "image_size": cfg.image_size})
    start_step = guard.step
    if rank == 0:
        log.info("ResNet-50 (%.1fM parameters, %s stem, %d classes) on %d ranks (%s/%s), %dx%d images, "
                 "batch %d per rank, steps %d -> %d", sum(p.numel() for p in net.parameters()) / 1e6,
                 cfg.model.stem, num_classes, world_size, device.type, cfg.backend, cfg.image_size,
                 cfg.image_size, cfg.batch_size, start_step, cfg.steps)

    step_times: list[float] = []
    first_step_s = None  # from the script's start to this launch's first completed step
    for step in guard.steps(cfg.steps):
        began = time.perf_counter()
        with guard.protect():
            with guard.loading():  # the DataLoader marker, when profiling is on
                x, y = synthetic.batch(step, rank) if synthetic is not None else loader.next()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            guard.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.clip_grad_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
            guard.optimizer.step()
            scheduler.step()
        if guard.step != step + 1:
            continue  # the step failed and was recovered: it runs again (or training resumes elsewhere)
        step_times.append(time.perf_counter() - began)
        if first_step_s is None:
            first_step_s = time.perf_counter() - SCRIPT_STARTED
        if rank == 0 and cfg.log_every and (guard.step % cfg.log_every == 0 or guard.step == cfg.steps):
            log.info("step %d/%d  loss %.4f  lr %.4g  %.3f s/step", guard.step, cfg.steps, loss.item(),
                     scheduler.get_last_lr()[0], step_times[-1])

    guard.close()  # waits for the last persist, so the report lists it
    report = guard.report()
    report.update({
        "world_size": world_size,
        "start_step": start_step,
        "wall_s": round(time.perf_counter() - SCRIPT_STARTED, 3),
        "step_time_s": round(statistics.median(step_times), 4) if step_times else None,
        "first_step_s": round(first_step_s, 3) if first_step_s is not None else None,
        "faults": read_fault_log(checkpoint_dir / ".trainguard" / "faults.jsonl") if checkpoint_dir else [],
        "config": OmegaConf.to_container(cfg, resolve=True),
    })
    if rank == 0:
        log.info("done: %d steps (this launch from %d), %d lost, median %.3f s/step, final state %s",
                 report["steps_completed"], start_step, report["lost_steps"], report["step_time_s"] or 0.0,
                 report["final_state_sha256"])
        if report_path is not None:
            report_path.parent.mkdir(parents=True, exist_ok=True)
            report_path.write_text(json.dumps(report, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
