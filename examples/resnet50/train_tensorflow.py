"""ResNet-50 multi-worker training in TensorFlow 2, protected by trainguard.

    trainguard run --framework tensorflow --workers-per-node 2 examples/resnet50/train_tensorflow.py \
        steps=20 seed=0 report=report.json checkpoint_dir=ckpt

``keras.applications.ResNet50(weights=None)`` on synthetic 32x32 images,
``MultiWorkerMirroredStrategy`` (the launcher builds each worker's
``TF_CONFIG``), a custom loop whose steps come from trainguard's
``CheckpointManager``: a verified checkpoint every ``save_every`` steps
(the model, SGD's momentum, the step, each worker's ``tf.data`` iterator
and random streams). When a worker dies or hangs the launcher restarts the
whole job and every worker resumes from the newest checkpoint all of them
verify; the job ends in the state a fault-free run reaches: compare
``final_state_sha256`` in the reports. Settings: ``conf/tensorflow.yaml``.

Never imports torch.
"""

from __future__ import annotations

import time

SCRIPT_STARTED = time.perf_counter()  # before the heavy imports: wall_s in the report is the script's wall time

import hashlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ INFO and WARNING lines

import hydra  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

log = logging.getLogger("resnet50")


def launch_path(path) -> Path | None:
    return None if path in (None, "") else Path(hydra.utils.to_absolute_path(str(path)))


def synthetic(cfg: DictConfig, workers: int, index: int) -> tf.data.Dataset:
    """This worker's shard of a fixed synthetic set, shuffled with the seed
    and repeated: image ``i`` is a function of ``(seed, i)``."""
    size, classes = cfg.image_size, cfg.classes

    def example(i):
        image = tf.random.stateless_normal((size, size, 3), seed=tf.stack([tf.cast(cfg.seed, tf.int64), i]))
        return image, tf.cast(i % classes, tf.int32)

    ds = tf.data.Dataset.range(64 * cfg.batch_size * workers).shard(workers, index).map(example)
    return ds.shuffle(4 * cfg.batch_size, seed=cfg.seed).repeat().batch(cfg.batch_size, drop_remainder=True)


def state_sha256(variables) -> str:
    h = hashlib.sha256()
    for v in variables:
        h.update(np.asarray(v.numpy()).tobytes())
    return h.hexdigest()


@hydra.main(config_path="conf", config_name="tensorflow", version_base=None)
def main(cfg: DictConfig) -> None:
    if cfg.fault and "TRAINGUARD_FAULT" not in os.environ:
        os.environ["TRAINGUARD_FAULT"] = str(cfg.fault)
    from trainguard.tensorflow import CheckpointManager  # after TRAINGUARD_FAULT is final

    report_path, checkpoint_dir = launch_path(cfg.report), launch_path(cfg.checkpoint_dir)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    tf.config.experimental.enable_op_determinism()  # same seed -> same state, bit for bit
    keras.utils.set_random_seed(cfg.seed)
    workers = strategy.num_replicas_in_sync
    index = strategy.cluster_resolver.task_id if workers > 1 else 0
    with strategy.scope():
        model = keras.applications.ResNet50(weights=None, input_shape=(cfg.image_size, cfg.image_size, 3),
                                            classes=cfg.classes, classifier_activation=None)
        optimizer = keras.optimizers.SGD(cfg.lr, momentum=0.9)
        optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    global_batch = cfg.batch_size * workers

    @tf.function
    def train_step(images, labels):
        def step_fn(images, labels):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(loss_fn(labels, model(images, training=True))) / global_batch
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.reduce("SUM", strategy.run(step_fn, args=(images, labels)), axis=None)

    data = iter(synthetic(cfg, workers, index))  # this worker's own iterator: saved in each checkpoint
    manager = CheckpointManager(tf.train.Checkpoint(model=model, optimizer=optimizer), checkpoint_dir,
                                max_to_keep=cfg.keep, data=data, save_every=cfg.save_every)
    start = manager.restore_or_initialize()
    log.info("worker %d of %d: %s at step %d", index, workers, "resumed" if start else "starting", start)
    step_times: list[float] = []
    for step in manager.steps(cfg.steps):
        began = time.perf_counter()
        loss = float(train_step(*next(data)))
        step_times.append(time.perf_counter() - began)
        if index == 0 and cfg.log_every and (step + 1) % cfg.log_every == 0:
            log.info("step %d loss %.4f step %.2f s", step + 1, loss, step_times[-1])
    manager.close()
    report = {
        "framework": "tensorflow", "workers": workers, "steps_completed": cfg.steps, "start_step": start,
        "restart": int(os.environ.get("TRAINGUARD_RESTART") or 0), "pid": os.getpid(),
        "step_time_s": round(statistics.median(step_times[1:]), 3) if len(step_times) > 1 else None,
        "wall_s": round(time.perf_counter() - SCRIPT_STARTED, 2),
        "final_state_sha256": state_sha256(model.variables + optimizer.variables),
        "tensorflow": tf.__version__, "config": OmegaConf.to_container(cfg, resolve=True),
    }
    if index == 0:
        log.info("done: %d steps (resumed at %d), median step %.2f s, final state %s", cfg.steps, start,
                 report["step_time_s"] or 0.0, report["final_state_sha256"])
        if report_path is not None:
            report_path.parent.mkdir(parents=True, exist_ok=True)
            report_path.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
