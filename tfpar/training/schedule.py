"""The optimizer and its learning-rate schedule, from the run's configuration."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfpar import compat
from tfpar.config import DEFAULT_EMA_MOMENTUM, Config, TrainConfig
from tfpar.model.precision import with_loss_scaling
from tfpar.parallel import registry


class EpochSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Base LR × decay per epoch past ``decay_after`` × linear warm-up over steps ×
    ``lr_scale`` (the plateau decay's factor, 1 without it).

    The epoch and the factor come from variables the loop sets, so the schedule needs no
    knowledge of how many steps an epoch has (bucketed epochs vary), and they are
    checkpointed.
    """

    def __init__(self, base_lr: float, decay: float, decay_after: int, warmup_steps: int,
                 epoch: tf.Variable, lr_scale: tf.Variable | None = None):
        self.base_lr, self.decay, self.decay_after = base_lr, decay, decay_after
        self.warmup_steps, self.epoch, self.lr_scale = warmup_steps, epoch, lr_scale

    def __call__(self, step):
        epoch = tf.cast(self.epoch, tf.float32)
        exponent = tf.maximum(epoch + 1.0 - self.decay_after, 0.0)
        lr = self.base_lr * tf.pow(self.decay, exponent)
        if self.warmup_steps:
            warm = tf.minimum(1.0, (tf.cast(step, tf.float32) + 1.0) / self.warmup_steps)
            lr = lr * warm
        if self.lr_scale is not None:
            lr = lr * tf.cast(self.lr_scale, tf.float32)
        return lr

    def get_config(self):
        return {"base_lr": self.base_lr, "decay": self.decay, "decay_after": self.decay_after,
                "warmup_steps": self.warmup_steps}


def applied_learning_rate(optimizer: keras.optimizers.Optimizer, step: int) -> float:
    """The rate the ``step``-th update (1-based, as the loop counts) was applied with.

    Keras' ``optimizer.learning_rate`` evaluates the schedule at ``optimizer.iterations``,
    which after update ``step`` is the *next* update's rate: during warm-up a higher one.
    A constant rate is returned as it is.
    """
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # under loss scaling
    schedule = compat.learning_rate_source(optimizer)  # what Keras built the rate from
    if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        return float(schedule(max(step - 1, 0)))
    return float(optimizer.learning_rate)


def base_learning_rate(train: TrainConfig, num_replicas: int) -> float:
    """``--lr``, times the replica count under ``--scale-lr linear``.

    The linear scaling rule (Goyal et al., 2017) keeps the per-example step size when the
    global batch grows with the replica count; it needs warm-up and breaks down for very
    large batches.
    """
    factor = num_replicas if train.scale_lr == "linear" else 1
    return train.lr * factor


def ema_momentum(config: Config) -> float:
    """The run's ``--ema-momentum``: as given, else the default (off under asynchronous
    training, parameter_server, whose per-variable updates bypass the optimizer's
    averaging)."""
    if config.train.ema_momentum is not None:
        return config.train.ema_momentum
    return 0.0 if registry.is_asynchronous(config.dist.strategy) else DEFAULT_EMA_MOMENTUM


def optimizer_factory(train: TrainConfig, num_replicas: int, precision: str = "fp32",
                      ema: float = 0.0):
    """``make_optimizer(epoch_variable, lr_scale_variable)`` for
    :func:`tfpar.training.state.build_train_state`: ``train``'s optimizer and schedule,
    with loss scaling where the model's ``precision`` is mixed_float16, keeping the
    moving average of the weights with momentum ``ema`` (0: none; :func:`ema_momentum`)."""

    def make(epoch: tf.Variable, lr_scale: tf.Variable) -> keras.optimizers.Optimizer:
        schedule = EpochSchedule(base_learning_rate(train, num_replicas), train.lr_decay,
                                 train.decay_after, train.warmup_steps, epoch, lr_scale)
        kinds = {"sgd": keras.optimizers.SGD, "adagrad": keras.optimizers.Adagrad,
                 "adam": keras.optimizers.Adam}
        averaging = {"use_ema": True, "ema_momentum": ema} if ema else {}
        optimizer = kinds[train.optimizer](learning_rate=schedule,
                                           weight_decay=train.weight_decay or None,
                                           **averaging)
        return with_loss_scaling(optimizer, precision)

    return make
