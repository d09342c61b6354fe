"""One rank of bench/megatron.py's GPU rows: megatron's DDP and distributed
optimizer in R instances around the GPT example's model; prints one JSON line
per rank (peak device memory, optimizer state bytes, median step time).

    R=2 BF16=1 torchrun --nproc-per-node 4 tests/workers/one_gpu_megatron.py bench/_megatron_gpu_worker.py
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.module import Float16Module
from omegaconf import OmegaConf

GPT = Path(__file__).resolve().parent.parent / "examples" / "gpt3"
sys.path.insert(0, str(GPT))
from model import batch, build  # noqa: E402


def main() -> None:
    instances, bf16, steps = int(os.environ["R"]), os.environ.get("BF16") == "1", int(os.environ.get("STEPS", "12"))
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    dist.init_process_group(os.environ.get("BACKEND", "gloo"))
    mpu.initialize_model_parallel(1, 1, num_distributed_optimizer_instances=instances)
    cfg = OmegaConf.load(GPT / "conf" / "config.yaml")
    cfg.bf16 = bf16
    for key, value in json.loads(os.environ["MODEL"]).items():
        cfg.model[key] = value
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model = build(cfg, tensor_parallel=1, device="cuda")
    params = sum(p.numel() for p in model.parameters())
    if bf16:  # as the example (and Megatron-LM) wraps it: bf16 weights, inputs cast on the way in
        model = Float16Module(model.config, model)
    model = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, num_distributed_optimizer_instances=instances, grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", use_distributed_optimizer=True, lr=1e-4, bf16=bf16,
                                                 clip_grad=1.0,
                                                 params_dtype=torch.bfloat16 if bf16 else torch.float32), [model])
    times = []
    for it in range(steps):
        t = time.perf_counter()
        data = batch(0, it, mpu.get_data_parallel_rank(), micro_batch=cfg.micro_batch_size,
                     seq_length=cfg.model.seq_length, vocab_size=cfg.model.vocab_size, device="cuda")
        model.zero_grad_buffer()
        opt.zero_grad()
        model(data["input_ids"], data["position_ids"], data["attention_mask"], labels=data["labels"]).float().mean() \
            .backward()
        model.finish_grad_sync()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    inner = opt.optimizer
    state = sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values() if torch.is_tensor(t))
    mains = sum(p.numel() * p.element_size() for g in inner.param_groups for p in g["params"]) if bf16 else 0
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "instances": instances, "bf16": bf16, "params": params,
                                  "optimizer_state_bytes": state + mains,
                                  "max_allocated_bytes": torch.cuda.max_memory_allocated(),
                                  "step_s": sorted(times[2:])[len(times[2:]) // 2]}), flush=True)
    dist.barrier()
    mpu.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
