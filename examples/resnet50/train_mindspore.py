"""ResNet-50 data-parallel training in MindSpore (PyNative), protected by trainguard.

    trainguard run --framework mindspore --worker_num=2 --local_worker_num=2 --master_port=8118 \
        --join=True --log_dir=logs examples/resnet50/train_mindspore.py \
        steps=20 seed=0 report=report.json checkpoint_dir=ckpt

The MindSpore twin of ``train.py``: a hydra app (settings and their meaning:
``conf/mindspore.yaml``) whose loop is the plain Guard pattern. A fault inside
``guard.protect()`` (a device memory error) is recovered by trainguard's
controller -- retried in place, or dumped to ``checkpoint_dir`` and resumed
by relaunching the same command -- and the job ends in the state a fault-free
run reaches: compare ``final_state_sha256`` in the reports.

``guard=false`` runs the same model, data and update as plain MindSpore,
without importing trainguard: ``nn.DistributedGradReducer`` and the
optimizer, periodic ``mindspore.save_checkpoint`` files, resume from the
newest at start. It is what ``bench/mindspore.py`` compares the Guard with,
and both reach the same ``final_state_sha256``.

Never imports torch (``model_mindspore.py`` and ``data_mindspore.py`` are
numpy and MindSpore only).
"""

from __future__ import annotations

import time

SCRIPT_STARTED = time.perf_counter()  # before the heavy imports: wall_s in the report is the script's wall time
STARTED_AT = time.time()

import os  # noqa: E402

# On this kind of CPU (AVX-512) oneDNN runs MindSpore's 3x3 convolutions with a
# reference kernel, ~30x slower than its AVX2 gemm kernels. oneDNN reads this
# once, at the first convolution, so it must be in the environment before
# mindspore is imported. Results are bit-reproducible under either setting but
# differ between them: setdefault keeps a value the launcher already chose, so
# every rank and every relaunch of a job agree.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

import hashlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import hydra  # noqa: E402
import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402
from mindspore import Tensor, nn, ops  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # model_mindspore.py, data_mindspore.py next to this file
from data_mindspore import SyntheticImages  # noqa: E402
from model_mindspore import resnet50  # noqa: E402

log = logging.getLogger("resnet50")

_ON, _OFF = {"true", "on", "yes", "1"}, {"false", "off", "no", "0"}


def launch_path(path: str | None) -> Path | None:
    """``path`` relative to the directory the job was launched from."""
    return None if path in (None, "") else Path(hydra.utils.to_absolute_path(str(path)))


def switch(value, key: str) -> bool:
    """A yes/no setting: a bool, or on/off, yes/no, true/false, 1/0."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _ON | _OFF:
        return text in _ON
    raise ValueError(f"{key} must be true or false (on/off), got {value!r}")


def learning_rates(cfg: DictConfig) -> np.ndarray:
    """The learning rate of every step, as torch's schedulers in train.py set
    them. Given to the optimizer as MindSpore's dynamic LR, indexed by its
    ``global_step`` (part of the state, so a rolled-back or resumed step gets
    its own rate)."""
    s, t = cfg.sched, np.arange(max(1, cfg.steps))
    if s.name == "cosine":
        lrs = cfg.lr * (1 + np.cos(np.pi * t / max(1, cfg.steps))) / 2
    elif s.name == "step":
        lrs = cfg.lr * s.gamma ** (t // s.step_size)
    elif s.name == "constant":
        lrs = np.full(len(t), float(cfg.lr))
    else:
        raise ValueError(f"sched.name must be cosine, step or constant, got {s.name!r}")
    return lrs.astype(np.float32)


def make_optimizer(cfg: DictConfig, params) -> nn.Optimizer:
    o, lrs = cfg.optim, Tensor(learning_rates(cfg))
    if o.name == "sgd":
        return nn.Momentum(params, lrs, o.momentum, weight_decay=o.weight_decay, use_nesterov=o.nesterov)
    if o.name == "adamw":
        return nn.AdamWeightDecay(params, lrs, beta1=o.betas[0], beta2=o.betas[1], weight_decay=o.weight_decay)
    raise ValueError(f"optim.name must be sgd or adamw, got {o.name!r}")


class Timeline:
    """Rank 0's events, one JSON line each, appended as they happen."""

    def __init__(self, path: Path | None, rank: int) -> None:
        self.path = path if rank == 0 else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def note(self, event: str, **fields) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), **fields}) + "\n")


class Step:
    """One training step's computation, the same with and without the Guard:
    forward and backward, clip each rank's gradients, then ``update`` (the
    Guard's optimizer wrapper, or plain all-reduce + optimizer)."""

    def __init__(self, cfg: DictConfig, net: nn.Cell, data: SyntheticImages, parameters, global_step,
                 rank: int) -> None:
        loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
        self.grad_fn = ms.value_and_grad(nn.WithLossCell(net, loss_fn), None, parameters)
        self.data, self.rank, self.clip = data, rank, float(cfg.clip_grad_norm)
        self.global_step = global_step

    def __call__(self, step: int, update, strike=lambda phase, step: None) -> Tensor:
        x, y = self.data.batch(step, self.rank)
        strike("forward", step)
        loss, grads = self.grad_fn(Tensor(x), Tensor(y))
        if self.clip:
            grads = ops.clip_by_global_norm(grads, self.clip)
        strike("backward", step)
        update(grads)
        strike("optimizer", step)
        # PyNative queues kernels and returns at once; reading any tensor waits
        # until the queue is empty (ms.runtime.synchronize() is not there on
        # CPU), so a step's time includes its update.
        self.global_step.asnumpy()
        return loss


def state_parameters(net: nn.Cell, optimizer: nn.Cell) -> dict:
    """Every parameter of the network and the optimizer by name, as the
    Guard's ``ModelState`` lists them (so the hashes compare)."""
    params, seen = {}, set()
    for cell in (net, optimizer):
        for _, p in cell.parameters_and_names():
            if id(p) not in seen:
                seen.add(id(p))
                params.setdefault(p.name, p)
    return params


def state_sha256(params: dict) -> str:
    """``ModelState.sha256``: each parameter's name, dtype, shape and bytes, by name."""
    h = hashlib.sha256()
    for name in sorted(params):
        a = np.ascontiguousarray(params[name].asnumpy())
        h.update(f"{name}:{a.dtype}:{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------ plain MindSpore
_PLAIN = re.compile(r"step_(\d+)\.ckpt")


def plain_save(directory: Path, step: int, params: dict, keep: int) -> None:
    """Rank 0's periodic ``mindspore.save_checkpoint`` of the whole state
    (written under a temporary name, then renamed: a job killed while saving
    leaves the previous one the newest)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f"step_{step:08d}.tmp.ckpt"
    ms.save_checkpoint([{"name": name, "data": p} for name, p in params.items()], str(tmp))
    os.replace(tmp, directory / f"step_{step:08d}.ckpt")
    saved = sorted(p for p in directory.glob("step_*.ckpt") if _PLAIN.fullmatch(p.name))
    for old in saved[:-keep] if keep else []:
        old.unlink()


def plain_resume(directory: Path | None, net: nn.Cell, optimizer: nn.Cell) -> int:
    """Load the newest periodic checkpoint into ``net`` and ``optimizer``;
    return its step (0: none)."""
    found = sorted((int(m.group(1)), p) for p in (directory.glob("step_*.ckpt") if directory else [])
                   if (m := _PLAIN.fullmatch(p.name)))
    if not found:
        return 0
    step, path = found[-1]
    loaded = ms.load_checkpoint(str(path))
    missing = ms.load_param_into_net(net, loaded)[0] + ms.load_param_into_net(optimizer, loaded)[0]
    if missing:
        raise RuntimeError(f"{path} lacks {len(missing)} parameters, e.g. {missing[:3]}")
    return step


def all_gather_pids(world_size: int) -> dict[int, list[int]]:
    if world_size == 1:
        return {0: [os.getpid()]}
    pids = ops.AllGather()(Tensor(np.array([os.getpid()], np.int64))).asnumpy()
    return {r: [int(p)] for r, p in enumerate(pids)}


def train_plain(cfg: DictConfig, net, optimizer, data, rank: int, world_size: int, timeline: Timeline,
                checkpoint_dir: Path | None, step_times: list) -> dict:
    """Plain MindSpore data parallel: all-reduce, update, a periodic checkpoint."""
    plain_dir = checkpoint_dir / "plain" if checkpoint_dir is not None else None
    start = plain_resume(plain_dir, net, optimizer)
    reducer = nn.DistributedGradReducer(optimizer.parameters, mean=True, degree=world_size) if world_size > 1 \
        else None
    strike, faults = (lambda phase, step: None), (lambda: [])
    if os.environ.get("TRAINGUARD_FAULT"):
        # Only to rehearse the fault the Guard recovers: it strikes at the same
        # points, once per job (the same log), and nothing recovers it.
        from trainguard.core.faults import FaultInjector, read_fault_log

        log_path = checkpoint_dir / ".trainguard" / "faults.jsonl" if checkpoint_dir is not None else None
        strike = FaultInjector.from_env(rank, world_size=world_size, log_path=log_path).strike
        faults = lambda: read_fault_log(log_path) if log_path is not None else []  # noqa: E731
    params, pids = state_parameters(net, optimizer), all_gather_pids(world_size)
    update = (lambda g: optimizer(reducer(g))) if reducer is not None else optimizer
    run = Step(cfg, net, data, optimizer.parameters, optimizer.global_step, rank)
    if rank == 0 and start:
        log.info("resumed from %s at step %d", plain_dir, start)
    timeline.note("ready", step=start)
    for step in range(start, cfg.steps):
        began, cpu = time.perf_counter(), time.process_time()
        loss = run(step, update, strike)
        done = step + 1
        if cfg.save_every and plain_dir is not None and done % cfg.save_every == 0 and rank == 0:
            plain_save(plain_dir, done, params, cfg.keep)
        log_step(cfg, rank, timeline, done, loss, began, cpu, step_times)
    return {"steps_completed": cfg.steps, "lost_steps": None, "pids": pids, "recoveries": [],
            "final_state_sha256": state_sha256(params), "start_step": start, "faults": faults()}


# ------------------------------------------------------------------ with trainguard
def train_guarded(cfg: DictConfig, net, optimizer, data, rank: int, timeline: Timeline,
                  checkpoint_dir: Path | None, step_times: list) -> dict:
    """The Guard pattern: ``guard.steps``, ``guard.protect``, ``guard.optimizer``."""
    from trainguard.core.faults import read_fault_log
    from trainguard.mindspore import Guard

    guard = Guard(net, optimizer, checkpoint_dir=checkpoint_dir, save_every=cfg.save_every, keep=cfg.keep)
    start = guard.step
    run = Step(cfg, net, data, guard.optimizer.parameters, optimizer.global_step, rank)
    timeline.note("ready", step=start)
    for step in guard.steps(cfg.steps):
        began, cpu = time.perf_counter(), time.process_time()
        with guard.protect():
            loss = run(step, guard.optimizer)
        if guard.step != step + 1:
            continue  # the step failed and was recovered: it runs again
        log_step(cfg, rank, timeline, guard.step, loss, began, cpu, step_times)
    guard.close()  # waits for the last persist, so the report lists it
    report = guard.report()
    report.update(start_step=start, faults=read_fault_log(checkpoint_dir / ".trainguard" / "faults.jsonl")
                  if checkpoint_dir is not None else [])
    return report


def log_step(cfg, rank: int, timeline: Timeline, done: int, loss: Tensor, began: float, cpu: float,
             step_times: list) -> None:
    seconds = time.perf_counter() - began
    step_times.append(seconds)
    timeline.note("step", step=done, seconds=seconds, cpu_seconds=time.process_time() - cpu)
    if rank == 0 and cfg.log_every and (done % cfg.log_every == 0 or done == cfg.steps):
        lr = learning_rates(cfg)[done - 1]
        log.info("step %d/%d  loss %.4f  lr %.4g  %.3f s/step", done, cfg.steps, float(loss.asnumpy()), lr, seconds)


@hydra.main(config_path="conf", config_name="mindspore", version_base=None)
def main(cfg: DictConfig) -> None:
    guarded = switch(cfg.guard, "guard")
    report_path, checkpoint_dir = launch_path(cfg.report), launch_path(cfg.checkpoint_dir)
    if cfg.data.kind != "synthetic":
        raise ValueError(f"data.kind must be synthetic in the MindSpore example, got {cfg.data.kind!r}")

    # The fault must be in the environment before the Guard (or the plain
    # loop's injector) reads it.
    env_fault = os.environ.get("TRAINGUARD_FAULT")
    if cfg.fault and env_fault is None:
        os.environ["TRAINGUARD_FAULT"] = str(cfg.fault)

    ms.set_context(mode=ms.PYNATIVE_MODE)  # the Guard supports PyNative only
    ms.set_device(cfg.device)
    world_size, rank = 1, 0
    if os.environ.get("MS_ROLE"):  # launched by msrun (or trainguard run --framework mindspore)
        from mindspore.communication import get_group_size, get_rank, init

        init()
        rank, world_size = get_rank(), get_group_size()
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    if rank == 0 and cfg.fault and env_fault is not None and env_fault != cfg.fault:
        log.warning("TRAINGUARD_FAULT=%r is set in the environment and wins over fault=%r", env_fault, cfg.fault)
    timeline = Timeline(launch_path(cfg.timeline), rank)
    timeline.note("start", at=STARTED_AT, guard=guarded)

    ms.set_seed(cfg.seed)
    data = SyntheticImages(cfg.seed, cfg.model.num_classes, cfg.batch_size, cfg.image_size)
    # Initial values come from numpy seeded by (seed, parameter name): every
    # rank builds the same model without a broadcast.
    net = resnet50(cfg.model.num_classes, stem=cfg.model.stem, zero_init_residual=cfg.model.zero_init_residual,
                   seed=cfg.seed)
    net.set_train(True)
    optimizer = make_optimizer(cfg, net.trainable_params())
    if rank == 0:
        log.info("ResNet-50 (%.1fM parameters, %s stem, %d classes) on %d ranks (%s, %s), %dx%d images, "
                 "batch %d per rank, %d steps", sum(p.size for p in net.trainable_params()) / 1e6, cfg.model.stem,
                 cfg.model.num_classes, world_size, cfg.device, "trainguard Guard" if guarded else "plain MindSpore",
                 cfg.image_size, cfg.image_size, cfg.batch_size, cfg.steps)

    step_times: list[float] = []
    if guarded:
        report = train_guarded(cfg, net, optimizer, data, rank, timeline, checkpoint_dir, step_times)
    else:
        report = train_plain(cfg, net, optimizer, data, rank, world_size, timeline, checkpoint_dir, step_times)
    report.update({
        "guard": guarded,
        "world_size": world_size,
        "wall_s": round(time.perf_counter() - SCRIPT_STARTED, 3),
        "step_time_s": round(statistics.median(step_times), 4) if step_times else None,
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
        "config": OmegaConf.to_container(cfg, resolve=True),
    })
    if rank == 0:
        log.info("done: %d steps (this launch from %d), %s lost, median %.3f s/step, final state %s",
                 report["steps_completed"], report["start_step"], report["lost_steps"], report["step_time_s"] or 0.0,
                 report["final_state_sha256"])
        if report_path is not None:
            report_path.parent.mkdir(parents=True, exist_ok=True)
            report_path.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
