"""A small MultiWorkerMirroredStrategy job protected by trainguard.tensorflow.

    python tf_train.py MODE STEPS CKPT_DIR OUT_JSON SAVE_EVERY

MODE ``loop``: a custom loop with ``CheckpointManager`` (each worker's
``tf.data`` iterator over its shard, a Dense model with Dropout, Adam);
MODE ``fit``: the same model under ``model.fit`` with the ``Checkpointing``
callback, STEPS steps per epoch for SAVE_EVERY epochs, a checkpoint after each;
MODE ``probe``: CKPT_DIR is a comma-separated list of directories; load the
newest verified checkpoint of each and append ``{"dir", "step"}`` or
``{"dir", "error"}`` to OUT_JSON (one process, no training).
Every worker appends one JSON line to OUT_JSON at the end: its index, pid,
the step it resumed from, and the SHA-256 of every model and optimizer
variable (the final state) and of the next batch it would read (its data
position).
"""

import hashlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from trainguard.tensorflow import CheckpointManager, Checkpointing  # noqa: E402

mode, steps, ckpt_dir, out, save_every = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])

strategy = tf.distribute.MultiWorkerMirroredStrategy()
tf.config.experimental.enable_op_determinism()
keras.utils.set_random_seed(0)
workers = strategy.num_replicas_in_sync
index = strategy.cluster_resolver.task_id if workers > 1 else 0
BATCH = 8


def dataset(shard: bool) -> tf.data.Dataset:
    gen = np.random.default_rng(1)
    x = gen.standard_normal((512, 12)).astype("float32")
    y = (x[:, :4].argmax(axis=1)).astype("int32")
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    if shard:
        ds = ds.shard(workers, index)
    return ds


def build():
    with strategy.scope():
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dropout(0.2), keras.layers.Dense(4)])
        optimizer = keras.optimizers.Adam(1e-2)
        optimizer.build(model.trainable_variables)
    return model, optimizer


def digest(variables) -> str:
    h = hashlib.sha256()
    for v in variables:
        h.update(np.asarray(v.numpy()).tobytes())
    return h.hexdigest()


model, optimizer = build()
record = {"index": index, "pid": os.getpid(), "restart": os.environ.get("TRAINGUARD_RESTART")}
if mode == "loop":
    it = iter(dataset(True).shuffle(64, seed=2).repeat().batch(BATCH))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    @tf.function
    def train_step(x, y):
        def step_fn(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(loss_fn(y, model(x, training=True))) / (BATCH * workers)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.run(step_fn, args=(x, y))

    manager = CheckpointManager(tf.train.Checkpoint(model=model, optimizer=optimizer), ckpt_dir, max_to_keep=3,
                                data=it, save_every=save_every)
    for step in manager.steps(steps):
        x, y = next(it)
        train_step(x, y)
    record["resumed"] = manager._state.loaded.step if manager._state.loaded else 0
    record["next_batch"] = hashlib.sha256(next(it)[0].numpy().tobytes()).hexdigest()
    manager.close()
elif mode == "probe":
    from trainguard.core import ResumeError

    it = iter(dataset(True).shuffle(64, seed=2).repeat().batch(BATCH))
    for directory in ckpt_dir.split(","):
        manager = CheckpointManager(tf.train.Checkpoint(model=model, optimizer=optimizer), directory, data=it)
        try:
            result = {"dir": directory, "step": manager.restore_or_initialize(),
                      "state": digest(model.variables + optimizer.variables)}
        except ResumeError as e:
            result = {"dir": directory, "error": str(e)}
        with open(out, "a") as f:
            f.write(json.dumps(result) + "\n")
    sys.exit(0)
else:  # fit: STEPS steps per epoch, SAVE_EVERY epochs
    with strategy.scope():
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callback = Checkpointing(ckpt_dir, every_epochs=1)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = dataset(False).batch(BATCH * workers).take(steps).with_options(options)
    model.fit(data, epochs=save_every, verbose=0, callbacks=[callback])
    record["resumed"] = callback.resumed_step
record["step"] = int(optimizer.iterations.numpy())
record["state"] = digest(model.variables + optimizer.variables)
with open(out, "a") as f:
    f.write(json.dumps(record) + "\n")
