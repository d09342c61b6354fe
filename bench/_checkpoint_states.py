"""What the measures of ``bench/checkpoint.py`` share, on the CPU and (in
``bench/_checkpoint_gpu.py``) on a GPU: the two states wrapped as the Guard
wraps them, each with its own training step (:func:`resnet_state`,
:func:`synthetic_state`), the one-rank persist request, timing helpers,
and torch's own saves as the baselines (:func:`torch_saves`)."""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from trainguard.core.checkpoint import shard_file

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "resnet50"
NAME = shard_file(0, (0,), ".safetensors")  # the file a one-rank Guard's asynchronous save writes
CHUNK, GB = 8 << 20, 1e9
mean, med = statistics.fmean, statistics.median


def wrap(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"state": {"model": model.state_dict(), "optimizer": opt.state_dict(), "host": {}, "step": 1},
            "history": {"records": [], "pids": {}}}


def resnet_state(device: str = "cpu") -> tuple:
    from omegaconf import OmegaConf
    sys.path.insert(0, str(EXAMPLE))
    from model import resnet50
    cfg = OmegaConf.load(EXAMPLE / "conf" / "config.yaml")
    torch.manual_seed(0)
    model = resnet50(cfg.model.num_classes or 10, stem=cfg.model.stem).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.optim.betas),
                            weight_decay=cfg.optim.weight_decay)
    x = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size, device=device)
    y = torch.randint(0, 10, (cfg.batch_size,), device=device)

    def step(before_update=lambda: None) -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        before_update()
        opt.step()
    step()
    n = sum(p.numel() for p in model.parameters())
    return wrap(model, opt), f"ResNet-50 ({n / 1e6:.1f}M params) + AdamW", model, opt, step


def synthetic_state(layers: int, device: str = "cpu") -> tuple:
    torch.manual_seed(0)
    model = torch.nn.ParameterList()
    for _ in range(layers):  # a 1024x832 matrix, its bias and a norm's weight and bias
        for shape in ((1024, 832), (1024,), (1024,), (1024,)):
            model.append(torch.nn.Parameter(torch.randn(shape, device=device)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, 832, device=device)

    def step(before_update=lambda: None) -> None:  # each layer: linear, layer norm, a square loss
        opt.zero_grad()
        sum(torch.nn.functional.layer_norm(torch.nn.functional.linear(x, model[i], model[i + 1]), (1024,),
                                           model[i + 2], model[i + 3]).square().mean()
            for i in range(0, len(model), 4)).backward()
        before_update()
        opt.step()
    step()
    n = sum(p.numel() for p in model)
    return wrap(model, opt), f"synthetic ({n / 1e6:.1f}M fp32 params) + AdamW", model, opt, step


def clock(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def drop_caches() -> bool:
    os.sync()
    try:
        return Path("/proc/sys/vm/drop_caches").write_text("1\n") > 0
    except OSError:
        return False


def on_disk(path: Path, write, buffering: int = -1) -> float:
    """Seconds to write ``path`` with ``write(file)``, flush and fsync it (removed afterwards)."""
    t = time.perf_counter()
    with open(path, "wb", buffering=buffering) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t
    path.unlink()
    return dt


def raw_write(f, view: memoryview) -> None:
    for pos in range(0, len(view), CHUNK):
        chunk = view[pos:pos + CHUNK]
        while chunk:
            chunk = chunk[os.write(f.fileno(), chunk):]


FINALIZE = {"expected": [NAME], "timeout_s": 600, "keep": 0, "meta": {"finalised_by": 0},  # one rank's persist
            "layout": {"world_size": 1, "shards": [{"kind": 0, "copies": [0], "full": True, "saved_by": 0,
                                                    "files": [NAME]}]}}


def torch_saves(state: dict, reps: int, tmp: Path) -> tuple[list[float], list[float], list[float]]:
    """The baselines of measure 1: torch.save + fsync, and DCP async_save
    until it returns and until it is done (each ``reps + 1`` times)."""
    saves = [on_disk(tmp / "save.pt", lambda f: torch.save(state, f)) for _ in range(reps + 1)]
    returned, done = [], []
    for i in range(reps + 1):
        t = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=str(tmp / f"dcp{i}"))
        returned.append(time.perf_counter() - t)
        fut.result()
        done.append(time.perf_counter() - t)
        shutil.rmtree(tmp / f"dcp{i}")
    return saves, returned, done


def table_rows(label: str, measured) -> list[dict]:
    """Rows from ``(measure, method, seconds, bytes or None, note)``."""
    return [{"measure": m, "state": label, "method": how, "seconds": sec, "GB_s": size / sec / GB if size else None,
             "note": note} for m, how, sec, size, note in measured]
