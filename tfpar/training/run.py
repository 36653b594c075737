"""``train_and_evaluate(config)``: wires data, model, strategy, checkpoints and summaries.

The loop talks to a strategy only through ``tfpar.parallel.base.StrategyPlugin``, so a
new strategy is a new plug-in, not a change here. A run:

1. loads the corpus and builds (or, when resuming, reloads) the vocabulary;
2. builds the model and optimizer inside the strategy's scope and restores the latest
   checkpoint of ``model_dir`` if there is one (step, epoch, position in the epoch,
   optimizer slots, RNG state);
3. trains epoch by epoch (``epoch`` picks the shuffle, so a resumed epoch replays the same
   batches and skips the ones already trained), evaluating valid after each epoch;
4. evaluates test, exports a SavedModel and writes the metrics JSON.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import threading
import time
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfpar.training import checkpoints

from tfpar.training import summaries
from tfpar.config import Config
from tfpar.data.sources import LoadedCorpus, load_corpus
from tfpar.errors import ConfigError, Interrupted, TrainingError
from tfpar.data.pipeline import InputData
from tfpar.objective.losses import perplexity
from tfpar.model.lm import build_model
from tfpar.parallel import build_strategy
from tfpar.parallel.base import StrategyPlugin
from tfpar.data.vocab import Vocab

log = logging.getLogger(__name__)


class EpochSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Base LR × decay per epoch past ``decay_after`` × linear warm-up over steps.

    The epoch comes from a variable the loop sets, so the schedule needs no knowledge of
    how many steps an epoch has (bucketed epochs vary), and it is checkpointed.
    """

    def __init__(self, base_lr: float, decay: float, decay_after: int, warmup_steps: int,
                 epoch: tf.Variable):
        self.base_lr, self.decay, self.decay_after = base_lr, decay, decay_after
        self.warmup_steps, self.epoch = warmup_steps, epoch

    def __call__(self, step):
        epoch = tf.cast(self.epoch, tf.float32)
        exponent = tf.maximum(epoch + 1.0 - self.decay_after, 0.0)
        lr = self.base_lr * tf.pow(self.decay, exponent)
        if self.warmup_steps:
            warm = tf.minimum(1.0, (tf.cast(step, tf.float32) + 1.0) / self.warmup_steps)
            lr = lr * warm
        return lr

    def get_config(self):
        return {"base_lr": self.base_lr, "decay": self.decay, "decay_after": self.decay_after,
                "warmup_steps": self.warmup_steps}


def base_learning_rate(config: Config, num_replicas: int) -> float:
    """``--lr``, times the replica count under ``--scale-lr linear``.

    The linear scaling rule (Goyal et al., 2017) keeps the per-example step size when the
    global batch grows with the replica count; it needs warm-up and breaks down for very
    large batches.
    """
    factor = num_replicas if config.train.scale_lr == "linear" else 1
    return config.train.lr * factor


def build_optimizer(config: Config, schedule) -> keras.optimizers.Optimizer:
    if config.train.optimizer == "sgd":
        return keras.optimizers.SGD(learning_rate=schedule)
    return keras.optimizers.Adam(learning_rate=schedule)


@dataclasses.dataclass
class Progress:
    """Counters of one run (kept in Python; the durable copies live in the checkpoint)."""

    tokens: float = 0.0
    seconds: float = 0.0
    nll: float = 0.0
    count: float = 0.0
    skipped: int = 0


def evaluate(plugin: StrategyPlugin, eval_step, data: InputData, split: str,
             batch_size: int) -> tuple[float, float]:
    """Total (nll, tokens) of ``split``, distributed like training; ppl = exp(nll / tokens)."""
    nll = count = 0.0
    state = None
    stream = data.config.mode == "stream"
    batches = plugin.distribute(
        lambda ctx: data.batches(split, training=False, input_context=ctx, batch_size=batch_size)
    )
    for batch in batches:
        out = eval_step(batch, state) if stream else eval_step(batch)
        nll += float(out.nll_sum)
        count += float(out.count)
        state = out.state if stream else None
    return nll, count


def check_batch_sizes(config: Config, num_replicas: int) -> None:
    """Every replica must get at least one row of every full global batch."""
    for flag, size in (("--batch-size", config.train.batch_size),
                       ("--eval-batch-size", config.train.global_eval_batch_size)):
        if size < num_replicas:
            raise ConfigError(
                f"{flag} {size} is a global batch smaller than the {num_replicas} replicas of "
                f"--strategy {config.dist.strategy}; use {flag} >= {num_replicas}"
            )


def prepare_vocab(config: Config, corpus: LoadedCorpus, model_dir: str, is_chief: bool) -> Vocab:
    """The train vocabulary; a resumed run checks it against the one saved beside its
    checkpoints, so ids cannot silently change."""
    vocab = Vocab.build(corpus.splits["train"], max_size=config.data.vocab_size,
                        min_count=config.data.min_count)
    saved = os.path.join(model_dir, "vocab.txt")
    if os.path.exists(saved):
        old = Vocab.load(saved)
        if old.tokens != vocab.tokens:
            raise checkpoints.incompatible(
                model_dir, f"vocabulary: {len(old)} entries saved, {len(vocab)} built now")
    elif is_chief:
        vocab.save(model_dir)
    return vocab


def train_and_evaluate(config: Config) -> dict[str, Any]:
    """Trains, evaluates and exports as ``config`` says; returns the final metrics."""
    if config.train.deterministic:
        tf.config.experimental.enable_op_determinism()
    plugin = build_strategy(config.dist)
    log.info("strategy %s", plugin.describe())
    if plugin.is_server:  # a parameter-server cluster's worker or ps task: it only serves
        plugin.serve()
        return {}
    plugin.check_config(config)
    check_batch_sizes(config, plugin.num_replicas)
    model_dir = checkpoints.prepare_model_dir(config, plugin.is_chief)
    corpus = load_corpus(config.data, seed=config.train.seed)
    vocab = prepare_vocab(config, corpus, model_dir, plugin.is_chief)
    data = InputData(corpus.splits, vocab, config.data, seed=config.train.seed)
    log.info("corpus %s: %s sentences; vocabulary %d", corpus.name,
             "/".join(str(len(corpus.splits[s])) for s in ("train", "valid", "test")), len(vocab))

    with plugin.scope():
        model = build_model(config.model, len(vocab), seed=config.train.seed)
        epoch_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
        batch_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="batch_in_epoch")
        schedule = EpochSchedule(base_learning_rate(config, plugin.num_replicas),
                                 config.train.lr_decay, config.train.decay_after,
                                 config.train.warmup_steps, epoch_var)
        optimizer = build_optimizer(config, schedule)
        optimizer.build(model.trainable_variables)
    ckpt = checkpoints.Checkpointer(
        model_dir, plugin.is_chief, config.run.keep_checkpoints,
        model=model, optimizer=optimizer, epoch=epoch_var, batch_in_epoch=batch_var,
        rng=model.seed_states(),
    )
    ckpt.restore_latest()
    writer = summaries.Writer(model_dir, plugin.is_chief)
    writer.config_text(config)
    writer.enable_inspection(config, vocab, data)  # per-epoch gradient norms, text samples

    train_step = plugin.make_train_step(model, optimizer, clip_norm=config.train.clip_norm)
    if not plugin.asynchronous:  # a scheduled step runs on a worker: nothing to trace here
        train_step = writer.instrument(  # writes the step's graph; --profile-steps
            train_step, lambda: int(optimizer.iterations.numpy()) + 1, config.run.profile_steps)
    eval_step = plugin.make_eval_step(model)
    loop = _Loop(config, plugin, data, model, optimizer, ckpt, writer, train_step,
                 epoch_var, batch_var)
    progress = loop.run()

    eval_batch = config.train.global_eval_batch_size
    metrics = _final_metrics(config, plugin, corpus, vocab, progress, model_dir,
                             int(optimizer.iterations.numpy()))
    for split in ("valid", "test"):
        nll, count = evaluate(plugin, eval_step, data, split, eval_batch)
        metrics[f"{split}_ppl"] = perplexity(nll, count)
    writer.scalars("eval", {"final_test_perplexity": metrics["test_ppl"]},
                   int(optimizer.iterations.numpy()))
    if config.run.export and plugin.is_chief:
        from tfpar.serving import export

        metrics["export_path"] = export.export_model(model, vocab, config)
    _report(metrics)
    if config.run.metrics_json and plugin.is_chief:
        _write_json(config.run.metrics_json, metrics)
    writer.close()
    ckpt.close()
    return metrics


class _Loop:
    """The epoch/step loop; small methods so each piece can be read on its own."""

    def __init__(self, config, plugin, data, model, optimizer, ckpt, writer, train_step,
                 epoch_var, batch_var):
        self.config, self.plugin, self.data = config, plugin, data
        self.model, self.optimizer, self.ckpt, self.writer = model, optimizer, ckpt, writer
        self.train_step, self.epoch_var, self.batch_var = train_step, epoch_var, batch_var
        self.eval_step = plugin.make_eval_step(model)
        self.progress = Progress()
        self.stop_signal = StopSignal()

    @property
    def step(self) -> int:
        return int(self.optimizer.iterations.numpy())

    def done(self) -> bool:
        max_steps = self.config.train.max_steps
        return bool(max_steps) and self.step >= max_steps

    def run(self) -> Progress:
        with self.stop_signal:
            return self._run()

    def _run(self) -> Progress:
        cfg = self.config.train
        while int(self.epoch_var.numpy()) < cfg.epochs and not self.done():
            epoch = int(self.epoch_var.numpy())
            self.train_epoch(epoch, int(self.batch_var.numpy()))
            if self.done() and int(self.batch_var.numpy()) != 0:
                break
            self.end_epoch(epoch)
        self.ckpt.save(self.step)
        return self.progress

    def end_epoch(self, epoch: int) -> None:
        nll, count = evaluate(self.plugin, self.eval_step, self.data, "valid",
                              self.config.train.global_eval_batch_size)
        ppl = perplexity(nll, count)
        log.info("epoch %d: valid perplexity %.2f", epoch + 1, ppl)
        self.writer.scalars("eval", {"perplexity": ppl, "epoch": epoch + 1}, self.step)
        self.writer.end_epoch(self.model, self.step)
        self.epoch_var.assign(epoch + 1)
        self.batch_var.assign(0)
        self.ckpt.save(self.step)

    def train_epoch(self, epoch: int, skip: int) -> None:
        if self.plugin.asynchronous:
            return self.train_epoch_async(epoch, skip)
        cfg, data = self.config, self.data
        batches = self.plugin.distribute(
            lambda ctx: data.batches("train", training=True, epoch=epoch, skip=skip,
                                     input_context=ctx, batch_size=cfg.train.batch_size)
        )
        bar = keras.utils.Progbar(None, unit_name="step") if cfg.run.progress else None
        stream = cfg.data.mode == "stream"
        state = None
        start = time.perf_counter()
        for batch in batches:
            out = self.train_step(batch, state) if stream else self.train_step(batch)
            state = out.state if stream else None
            nll, count, norm = float(out.nll_sum), float(out.count), float(out.grad_norm)
            now = time.perf_counter()
            self.after_step(epoch, nll, count, norm, now - start, bar)
            self.check_stop_signal()
            start = now
            if self.done():
                break

    def after_step(self, epoch, nll, count, norm, seconds, bar) -> None:
        self.batch_var.assign_add(1)
        step = self.step
        if not (math.isfinite(nll) and math.isfinite(norm)):
            self.non_finite(step, nll, norm)
            return
        p = self.progress
        if step > 1:  # The first step traces the graph; keep it out of the throughput.
            p.tokens += count
            p.seconds += seconds
        p.nll += nll
        p.count += count
        loss = nll / max(count, 1.0)
        if step % self.config.run.log_every == 0 or step == 1:
            self.writer.scalars("train", {
                "loss": loss, "perplexity": math.exp(min(loss, 50.0)),
                "tokens_per_sec": count / max(seconds, 1e-9),
                "learning_rate": float(self.optimizer.learning_rate),
                "grad_norm": norm,
            }, step)
        if bar is not None:
            bar.add(1, [("loss", loss), ("ppl", math.exp(min(loss, 50.0))),
                        ("tok/s", count / max(seconds, 1e-9))])
        every = self.config.run.checkpoint_every
        if every and step % every == 0:
            self.ckpt.save(step)

    def train_epoch_async(self, epoch: int, skip: int) -> None:
        """Asynchronous training (parameter_server): schedules the epoch's steps without
        waiting for any, and reads their results only at sync points - every
        --checkpoint-every steps and at the epoch end - once the plug-in has waited for
        all of them. Summaries are therefore written per sync point, not per --log-every."""
        cfg, data, plugin = self.config, self.data, self.plugin
        size = cfg.train.batch_size
        todo = count_batches(data.batches("train", training=True, epoch=epoch,
                                          batch_size=size)) - skip
        if cfg.train.max_steps:
            todo = min(todo, cfg.train.max_steps - self.step)
        iterators = plugin.distribute_to_workers(
            lambda ctx: data.batches("train", training=True, epoch=epoch, skip=skip,
                                     input_context=ctx, batch_size=size)
        )
        bar = keras.utils.Progbar(todo, unit_name="step") if cfg.run.progress else None
        every = cfg.run.checkpoint_every or todo
        while todo > 0:
            start = time.perf_counter()
            scheduled = min(todo, every - self.step % every)  # sync on checkpoint steps
            futures = [self.train_step(iterators) for _ in range(scheduled)]
            plugin.join()
            outputs = [plugin.fetch(f) for f in futures]
            self.after_sync(outputs, time.perf_counter() - start, bar)
            self.check_stop_signal()
            todo -= scheduled

    def after_sync(self, outputs, seconds, bar) -> None:
        """Bookkeeping of the steps that finished since the last sync point."""
        self.batch_var.assign_add(len(outputs))
        step = self.step
        finite = []
        for out in outputs:
            nll, count, norm = float(out.nll_sum), float(out.count), float(out.grad_norm)
            if math.isfinite(nll) and math.isfinite(norm):
                finite.append((nll, count, norm))
            else:
                self.non_finite(step, nll, norm)
        if not finite:
            return
        nll, count = sum(f[0] for f in finite), sum(f[1] for f in finite)
        p = self.progress
        if step > len(outputs):  # The first steps trace the graph; keep them out.
            p.tokens += count
            p.seconds += seconds
        p.nll += nll
        p.count += count
        loss = nll / max(count, 1.0)
        self.writer.scalars("train", {
            "loss": loss, "perplexity": math.exp(min(loss, 50.0)),
            "tokens_per_sec": count / max(seconds, 1e-9),
            "learning_rate": float(self.optimizer.learning_rate),
            "grad_norm": sum(f[2] for f in finite) / len(finite),
        }, step)
        if bar is not None:
            bar.add(len(outputs), [("loss", loss), ("ppl", math.exp(min(loss, 50.0))),
                                   ("tok/s", count / max(seconds, 1e-9))])
        every = self.config.run.checkpoint_every
        if every and step % every == 0:
            self.ckpt.save(step)

    def check_stop_signal(self) -> None:
        if self.stop_signal.received:
            self.ckpt.save(self.step)
            raise Interrupted(
                f"stopped by {self.stop_signal.received} after step {self.step}; checkpoint "
                f"saved in {self.ckpt.directory}; run the same command again to resume"
            )

    def non_finite(self, step: int, nll: float, norm: float) -> None:
        """A batch gave a non-finite loss or gradient; its update was not applied."""
        what = f"non-finite loss or gradient in the batch after step {step} (loss {nll}, " \
               f"gradient norm {norm})"
        if self.config.train.on_nan == "stop":
            raise TrainingError(f"{what}; the update was not applied. Lower --lr or "
                                "--clip-norm, or pass --on-nan skip to drop such batches")
        self.progress.skipped += 1
        log.warning("%s: skipped (--on-nan skip)", what)


class StopSignal:
    """Turns SIGINT/SIGTERM into a flag the loop checks after each step.

    Training then stops cleanly: the step in flight finishes, a checkpoint is written,
    and the run exits saying how to resume. A second signal interrupts at once.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received: str | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        if self.received:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name
        log.warning("%s received: stopping after this step", self.received)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


def count_batches(dataset: tf.data.Dataset) -> int:
    """Elements in a finite dataset (runs the input pipeline once)."""
    return int(dataset.reduce(np.int64(0), lambda n, _: n + 1))


def _final_metrics(config, plugin, corpus, vocab, progress, model_dir, steps) -> dict[str, Any]:
    metrics: dict[str, Any] = {
        "strategy": plugin.name,
        "replicas": plugin.num_replicas,
        "devices": list(plugin.devices),
        "workers": plugin.num_workers,
        "steps": steps,
        "tokens_per_sec": progress.tokens / progress.seconds if progress.seconds else None,
        "train_ppl": perplexity(progress.nll, progress.count),
        "skipped_batches": progress.skipped,
        "unigram_valid_ppl": vocab.unigram_perplexity(corpus.splits["valid"]),
        "model_dir": model_dir,
        "corpus": corpus.name,
    }
    if corpus.oracle_ppl:
        metrics["oracle_valid_ppl"] = corpus.oracle_ppl["valid"]
        metrics["oracle_test_ppl"] = corpus.oracle_ppl["test"]
    return metrics


def _report(metrics: dict[str, Any]) -> None:
    parts = [f"{k} {metrics[k]:.2f}" for k in
             ("train_ppl", "valid_ppl", "test_ppl", "oracle_valid_ppl", "oracle_test_ppl",
              "unigram_valid_ppl") if isinstance(metrics.get(k), float)]
    log.info("perplexity: %s", ", ".join(parts))
    if metrics.get("tokens_per_sec"):
        log.info("throughput: %.0f tokens/s over %d steps", metrics["tokens_per_sec"],
                 metrics["steps"])


def _write_json(path: str, metrics: dict[str, Any]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(metrics, f, indent=2, sort_keys=True, default=_json_default)
    os.replace(tmp, path)


def _json_default(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")
