"""A tiny GPT-2 trained by HF's Trainer, protected by trainguard.

    trainguard run --nproc-per-node 2 examples/hf/train.py steps=12 checkpoint_dir=ckpt save_every=4

A standard Trainer script with ``GuardedTrainer`` in place of ``Trainer``
(trainguard.integrations.hf). The model is built from a ``GPT2Config``
(nothing is downloaded), the data is synthetic, dropout is on. Settings as
``key=value``: steps, seed, checkpoint_dir (trainguard's checkpoints),
save_every, report (a JSON file rank 0 writes: steps, recoveries, the
state's hash, every rank's random streams, data position, scheduler and
learning rates as fingerprints), hf_save_steps (the Trainer's own checkpoints under
``<checkpoint_dir>/hf``; 0: none).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments, set_seed

from trainguard.integrations.hf import GuardedTrainer


class Sequences(Dataset):
    """Synthetic token sequences with a learnable rule (each token follows from the one before)."""

    def __init__(self, n: int = 96, length: int = 16, vocab: int = 128, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        self.ids = (start + torch.arange(length) * 7) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv: list[str]) -> None:
    cfg = {"steps": "12", "seed": "0", "checkpoint_dir": "ckpt", "save_every": "0", "report": "",
           "hf_save_steps": "0"}
    for arg in argv:
        key, _, value = arg.partition("=")
        if key not in cfg:
            raise SystemExit(f"unknown setting {key!r} (known: {', '.join(cfg)})")
        cfg[key] = value
    hf_save = int(cfg["hf_save_steps"])
    args = TrainingArguments(
        output_dir=os.path.join(cfg["checkpoint_dir"], "hf"), max_steps=int(cfg["steps"]),
        per_device_train_batch_size=4, learning_rate=1e-3, warmup_steps=2, lr_scheduler_type="linear",
        seed=int(cfg["seed"]), use_cpu=not torch.cuda.is_available(), ddp_backend="gloo", report_to="none",
        logging_steps=4, save_strategy="steps" if hf_save else "no", save_steps=hf_save or 500,
        dataloader_drop_last=True, disable_tqdm=True, ddp_find_unused_parameters=False)
    set_seed(int(cfg["seed"]))  # before the model's initialisation (the Trainer seeds only after it)
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0, loss_type="ForCausalLM")  # dropout 0.1 throughout
    trainer = GuardedTrainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Sequences(),
                             guard_options={"checkpoint_dir": cfg["checkpoint_dir"],
                                            "save_every": int(cfg["save_every"])})
    trainer.train()
    report = trainer.guard_report
    owns, pieces = [None] * dist.get_world_size(), [None] * dist.get_world_size()
    dist.all_gather_object(owns, report["own_fingerprints"])
    dist.all_gather_object(pieces, report["piece_fingerprints"])  # the scheduler's state, the learning rates...
    report["final_own"], report["final_pieces"] = owns, pieces
    report["trainer_global_step"] = trainer.state.global_step
    if cfg["report"] and dist.get_rank() == 0:
        with open(cfg["report"], "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
