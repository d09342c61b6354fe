"""GuardedDDPStrategy given training batches that are not a torch DataLoader
(an iterable of the script's own): refused before step 0
(tests/test_integrations_lightning.py)."""

import sys

import lightning as L
import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "examples" / "lightning"))
from train import Model  # noqa: E402

from trainguard.integrations.lightning import GuardedDDPStrategy  # noqa: E402

L.seed_everything(0, verbose=False)


class Batches:
    def __iter__(self):
        for _ in range(4):
            x = torch.randint(0, 64, (8, 16))
            yield x, x.sum(dim=1) % 64

    def __len__(self) -> int:
        return 4


trainer = L.Trainer(accelerator="cpu", devices=1, strategy=GuardedDDPStrategy(guard_options={"checkpoint_dir": sys.argv[1]}),
                    max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, default_root_dir=sys.argv[1])
trainer.fit(Model(), train_dataloaders=Batches())
print("trained", trainer.global_step)
