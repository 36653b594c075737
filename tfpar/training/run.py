"""``train_and_evaluate(config)``: wires data, state, strategy, checkpoints and summaries.

The loop talks to a strategy only through ``tfpar.parallel.base.StrategyPlugin`` (or,
for asynchronous parameter-server training, its coordinator), so a new strategy is a new
plug-in, not a change here. A run:

1. a cluster's side-car evaluator task only evaluates the checkpoints
   (``tfpar.training.sidecar``), a parameter-server cluster's worker and ps tasks only
   serve (chosen first);
2. loads the corpus and builds the vocabulary (or reads ``--vocab-file``), then opens the
   model dir, where a resumed run's saved ``vocab.txt`` must hold the same tokens;
3. builds the train state inside the strategy's scope and restores the latest
   checkpoint of ``model_dir`` if there is one (step, epoch, position in the epoch,
   optimizer slots, RNG state);
4. trains epoch by epoch (``epoch`` picks the shuffle, so a resumed epoch replays the same
   batches and skips the ones already trained), evaluating valid after each epoch; a stop
   signal checkpoints and ends the run (exit 130), under multi_worker on every worker
   after the same step (exit 75, ``tfpar.training.preemption``);
5. records the last step (``final_step.json``, the side-car evaluator's end), evaluates
   test, writes the final figures to TensorBoard (``tfpar.training.summaries``), exports
   a SavedModel and writes the metrics JSON.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from typing import Any

import numpy as np
import tensorflow as tf

from tfpar import files
from tfpar.config import MODEL_SHAPE, Config
from tfpar.data.pipeline import InputData
from tfpar.data.sources import LoadedCorpus, load_corpus
from tfpar.data.vocab import Vocab, train_counts
from tfpar.errors import ConfigError
from tfpar.model import cells
from tfpar.objective.losses import perplexity
from tfpar.parallel import registry
from tfpar.parallel.cluster import tf_config
from tfpar.serving import export
from tfpar.training import checkpoints, hparams, sidecar, summaries
from tfpar.training.hooks import on_terminal
from tfpar.training.async_loop import AsyncLoop
from tfpar.training.loop import Loop, evaluate
from tfpar.training.schedule import ema_momentum, optimizer_factory
from tfpar.training.state import build_train_state, named_weights
from tfpar.training.stored import (check_cell_named, checkpoint_path, checkpoint_step,
                                   restore_weights, stored_run)
from tfpar.objective.output import output_loss
from tfpar.objective.step import make_eval_step
from tfpar.training.runner import make_train_steps

log = logging.getLogger(__name__)


# Fewer training rows per replica than this leave a GPU mostly idle (each replica runs a
# whole time step's kernels for a handful of rows); warned about, not refused.
FEW_ROWS = 4


def check_batch_sizes(config: Config, num_replicas: int) -> None:
    """Every replica must get at least one row of every full global batch; fewer than
    FEW_ROWS training rows each is warned about."""
    for flag, size in (("--batch-size", config.train.batch_size),
                       ("--eval-batch-size", config.train.global_eval_batch_size)):
        if size < num_replicas:
            raise ConfigError(
                f"{flag} {size} is a global batch smaller than the {num_replicas} replicas of "
                f"--strategy {config.dist.strategy}; use {flag} >= {num_replicas}"
            )
    rows = config.train.batch_size / num_replicas
    if num_replicas > 1 and rows < FEW_ROWS:
        log.warning("--batch-size %d over %d replicas is %.3g rows each: too few to keep a "
                    "device busy; --batch-size %d or more gives each %d", config.train.batch_size,
                    num_replicas, rows, FEW_ROWS * num_replicas, FEW_ROWS)


def init_source(config: Config) -> tuple[Config, str | None]:
    """``--init-from DIR``: the config of a run that starts from DIR's model weights, and
    the checkpoint to read them from (None: no --init-from, or the model dir has a
    checkpoint, which the run resumes instead).

    The weights fit only DIR's model, and their ids only DIR's vocabulary, so the config
    takes DIR's model shape (:data:`tfpar.config.MODEL_SHAPE` and ``num_sampled``),
    tokenizer and vocabulary (``DIR/vocab.txt`` as ``--vocab-file``); the rest (data,
    dropout, optimizer, schedule) is this run's. A resumed run takes them from its own
    model dir, so DIR need not exist any more. Called before anything is written.

    Raises:
      ConfigError: --vocab-file, --vocab-size or --min-count given with --init-from.
      CheckpointError: DIR is no training run's model dir, or has no such checkpoint.
    """
    run, data = config.run, config.data
    if not run.init_from:
        return config, None
    for flag, given in (("--vocab-file", data.vocab_file is not None),
                        ("--vocab-size", data.vocab_size != 0),
                        ("--min-count", data.min_count != 1)):
        if given:
            raise ConfigError(f"{flag} does not apply with --init-from {run.init_from}, whose "
                              "vocabulary the run takes; drop one of them")
    resuming = bool(run.model_dir) and tf.train.latest_checkpoint(
        os.path.join(run.model_dir, "checkpoints")) is not None
    source = run.model_dir if resuming else run.init_from
    stored, vocab = stored_run(source, "--model-dir" if resuming else "--init-from")
    if stored.model.custom_cell:  # its code is imported only when this run names it too
        check_cell_named(stored, config.model.cell if config.model.custom_cell else None,
                         source, "--model-dir" if resuming else "--init-from")
    path = None if resuming else checkpoint_path(run.init_from, run.init_weights,
                                                 "--init-from", "--init-weights")
    fields = (*MODEL_SHAPE, "num_sampled")
    shape = {f: getattr(stored.model, f) for f in fields}
    ignored = [f"{f} {getattr(config.model, f)!r}" for f in fields
               if getattr(config.model, f) != shape[f]]
    if stored.data.tokenizer != data.tokenizer:
        ignored.append(f"tokenizer {data.tokenizer!r}")
    if not resuming:
        log.info("--init-from %s: model %s, tokenizer %s and vocabulary %s are its own%s",
                 run.init_from, ", ".join(f"{f} {shape[f]!r}" for f in fields),
                 stored.data.tokenizer, vocab,
                 f" (not this run's {', '.join(ignored)})" if ignored else "")
    return config.replace(model=shape, data={"tokenizer": stored.data.tokenizer,
                                             "vocab_file": vocab}), path


def load_vocab(config: Config, corpus: LoadedCorpus) -> tuple[Vocab, np.ndarray | None]:
    """The run's vocabulary and the train length histogram of its pass: read from
    ``--vocab-file`` (used whole, no train counts, no pass: the histogram is None) or
    counted in one streaming pass over the train split. Made before the model dir, so a
    bad file leaves nothing on disk; ``checkpoints.open_model_dir`` checks it against a
    resumed run's and saves it."""
    data = config.data
    if data.vocab_file is not None:
        vocab = Vocab.load(data.vocab_file, tokenizer=data.tokenizer)
        log.info("vocabulary: %d entries read from %s; it has no train counts, so "
                 "unigram_valid_ppl is not reported", len(vocab), data.vocab_file)
        return vocab, None
    train = corpus.splits["train"]
    log.info("vocabulary: counting the train split (%s)", train.describe())
    # A bar on a terminal only; off one, the line above and the next say it all.
    counts = train_counts(train, data.tokenizer, progress=config.run.progress and on_terminal())
    return Vocab.from_counts(counts, max_size=data.vocab_size,
                             min_count=data.min_count), counts.lengths


# --steps-per-execution's default where the strategy's devices are GPUs. The host's
# overhead per call (Python loop, tf.function call, reading the losses back) measures
# ~0.9 ms (benchmark's tiny-model probe, tfpar/docs/benchmarks.md): 18% of a 5 ms GPU
# step with one step per call, under 1% with 20. A CPU step (~50 ms) gains nothing.
GPU_STEPS_PER_EXECUTION = 20


def steps_per_execution(config: Config, plugin) -> Config:
    """``config`` with ``--steps-per-execution`` set: the user's value, else
    GPU_STEPS_PER_EXECUTION when a synchronous plug-in computes on GPUs (a pipeline's
    host-CPU embedding stage included), else 1.

    Synchronous worker processes with ``--softmax sampled`` run one step per call: each
    worker's sampled-softmax gradient has its own number of rows, and TensorFlow's
    all-gather of such gradients fails from a call's second step on (a shape mismatch
    between the workers' collectives inside the loop; TensorFlow 2.21).

    Raises:
      ConfigError: more than one step per call asked for in that case.
    """
    synchronous = not registry.is_asynchronous(config.dist.strategy)
    one_per_call = (synchronous and plugin.cluster_resolver is not None
                    and config.model.softmax == "sampled")
    asked = config.train.steps_per_execution
    if asked is not None:
        if one_per_call and asked > 1:
            raise ConfigError(
                f"--steps-per-execution {asked} with --softmax sampled across worker "
                "processes: TensorFlow cannot gather the workers' sampled-softmax "
                "gradients of different sizes inside one call; use --steps-per-execution 1")
        return config
    gpus = (synchronous and plugin.devices and not one_per_call and
            any(tf.DeviceSpec.from_string(d).device_type == "GPU" for d in plugin.devices))
    n = GPU_STEPS_PER_EXECUTION if gpus else 1
    if gpus:
        log.info("--steps-per-execution %d (the default on GPUs)", n)
    return dataclasses.replace(config, train=dataclasses.replace(config.train,
                                                                 steps_per_execution=n))


def train_and_evaluate(config: Config) -> dict[str, Any]:
    """Trains, evaluates and exports as ``config`` says; returns the final metrics."""
    if config.train.deterministic:
        tf.config.experimental.enable_op_determinism()
    if tf_config.is_evaluator(config.dist.strategy, source=config.dist.cluster):  # a side-car: it only evaluates
        return sidecar.run_sidecar(config)
    task = registry.server_task(config.dist)
    if task is not None:  # e.g. a parameter-server cluster's worker or ps task
        log.info("strategy %s", task.describe())
        task.serve()
        return {}
    for flag, path in (("--model-dir", config.run.model_dir),
                       ("--export-dir", config.run.export_dir if config.run.export else ""),
                       ("--metrics-json", config.run.metrics_json)):
        files.check_file_system(path, flag)  # before a step is trained
    config, init = init_source(config)
    plugin = registry.build_for(config)  # settings checked, placement decided: once
    log.info("strategy %s", plugin.describe())
    config = steps_per_execution(config, plugin)  # resolved: an int from here on
    if config.model.custom_cell:  # a cell that cannot work fails before anything is written
        cells.probe(config.model.cell, config.model.hidden_dim, config.model.embed_dim)
    check_batch_sizes(config, plugin.num_replicas)
    # Read before the model dir is made: a corpus that cannot be read leaves nothing on disk.
    started = time.time()
    corpus = load_corpus(config.data, seed=config.train.seed)
    read = time.time()
    vocab, lengths = load_vocab(config, corpus)
    config.model.check_vocab_size(len(vocab))
    timings = {"corpus_seconds": read - started, "vocab_seconds": time.time() - read}
    with checkpoints.open_model_dir(config, plugin.is_chief, vocab=vocab) as model_dir:
        return _train(config, plugin, model_dir, corpus=corpus, vocab=vocab, lengths=lengths,
                      timings=timings, init=init)


def _train(config: Config, plugin, model_dir: str, *, corpus: LoadedCorpus,
           vocab: Vocab, lengths, timings: dict[str, float],
           init: str | None = None) -> dict[str, Any]:
    """The run itself, on ``corpus`` and ``vocab``, in a model dir this process holds;
    ``lengths`` is the vocabulary pass's length histogram (None without one); ``timings``
    (seconds reading the corpus and making the vocabulary) go to the metrics; ``init``:
    the checkpoint whose model weights a fresh run starts from (:func:`init_source`)."""
    asynchronous = registry.is_asynchronous(config.dist.strategy)
    data = InputData(corpus.splits, vocab, config.data, seed=config.train.seed,
                     lengths=lengths)
    log.info("corpus %s: %s (train/valid/test); vocabulary %d", corpus.name,
             "; ".join(corpus.splits[s].describe() for s in ("train", "valid", "test")),
             len(vocab))
    if plugin.num_workers > 1:
        log.info("input: %s", data.share_summary("train", plugin.num_workers))

    state = build_train_state(plugin.scope(), config.model, len(vocab), seed=config.train.seed,
                              make_optimizer=optimizer_factory(
                                  config.train, plugin.num_replicas, config.model.precision,
                                  ema=ema_momentum(config)),
                              fixed_shapes=config.data.mode == "stream",
                              carry_rows=config.train.batch_size
                              if config.data.mode == "stream" and not asynchronous else 0)
    ckpt = checkpoints.Checkpointer(model_dir, plugin.is_chief, config.run.keep_checkpoints,
                                    **state.trackables())
    if ckpt.restore_latest() is None and init is not None:
        restore_weights(named_weights(state.model), init)  # weights only: step 0
        log.info("initialised from %s (step %d)", init, checkpoint_step(init))
    if plugin.is_chief:
        checkpoints.clear_final_step(model_dir)  # an earlier end: this run trains on
    writer = summaries.Writer(model_dir, plugin.is_chief)
    writer.config_text(config)
    writer.session(hparams.settings(config, plugin.num_replicas))  # once per model dir
    if config.run.epoch_inspection:  # per-epoch gradient norms, text samples
        writer.enable_inspection(config, vocab, data)

    loss = output_loss(config.model)  # the full or sampled softmax the step is handed
    clip = config.train.clip_norm
    if asynchronous:  # a scheduled step runs on a worker: nothing to trace here
        eval_step = plugin.make_eval_step(state.model)
        train = plugin.make_schedule_step(state.model, state.optimizer, clip_norm=clip)
        loop_class = AsyncLoop
    else:
        eval_step = make_eval_step(plugin, state.model, loss)
        train = writer.instrument(  # writes the calls' graph; --profile-steps
            make_train_steps(plugin, state.model, state.optimizer, clip_norm=clip, loss=loss),
            lambda: state.step + 1, config.run.profile_steps)
        loop_class = Loop
    # multi_worker: a stop signal on any worker stops every worker after the same step.
    loop = loop_class(config, plugin, data, state, ckpt, writer, train, eval_step,
                      cluster_resolver=plugin.cluster_resolver)
    progress = loop.run()

    last_step = state.step
    if plugin.is_chief:  # trained and checkpointed to the end (a stop signal raises)
        checkpoints.write_final_step(model_dir, last_step)
    state.use_averages()  # from here on the model holds the weights the run reports
    metrics = _final_metrics(config, plugin, corpus, vocab, progress, model_dir, last_step)
    # Start-up cost, for the corpus-scaling benchmark: when the first step was done (Unix
    # time; None when no step ran), and how long the corpus and the vocabulary took.
    metrics.update(timings, first_step_time=progress.first_step_time)
    metrics["stopped_early"] = loop.stopped_early
    last = _last_weights(config, plugin, data, state, eval_step, loop.valid_at)
    if loop.valid_at is None or loop.valid_at[0] != last_step:
        # A run that ends mid-epoch: the valid curve ends at its last weights too, so its
        # last point (the HParams dashboard's valid perplexity) is theirs.
        writer.scalars("eval", {summaries.PERPLEXITY: last["valid_ppl"]}, last_step)
    final = metrics["final_weights"] = _final_weights(config, state, ckpt, last)
    metrics["valid_ppl"] = final["valid_ppl"]  # measured on the weights now in the model
    nll, count = evaluate(plugin, eval_step, data, "test", config.train.global_eval_batch_size)
    metrics["test_ppl"] = perplexity(nll, count)
    writer.results(_result_rows(metrics, epochs=int(state.epoch.numpy())), last_step)
    if config.run.export and plugin.is_chief:
        metrics["export_path"] = export.export_model(state.model, vocab, config.run)
    _report(metrics)
    if config.run.metrics_json and plugin.is_chief:
        _write_json(config.run.metrics_json, metrics)
    writer.close()
    return metrics


def _last_weights(config: Config, plugin, data: InputData, state, eval_step,
                  valid_at=None) -> dict[str, Any]:
    """The valid perplexity of the weights in ``state`` (the last):
    ``{"kind": "last", "epoch", "step", "valid_ppl"}`` (epoch 0: the weights are not an
    epoch end's). ``valid_at``: (step, nll, tokens) of the last epoch end's valid
    evaluation, reused when training ended there (evaluation is deterministic)."""
    if valid_at is not None and valid_at[0] == state.step:
        nll, count = valid_at[1:]
    else:
        nll, count = evaluate(plugin, eval_step, data, "valid",
                              config.train.global_eval_batch_size)
    epoch = int(state.epoch.numpy()) if int(state.batch_in_epoch.numpy()) == 0 else 0
    return {"kind": "last", "epoch": epoch, "step": state.step,
            "valid_ppl": perplexity(nll, count)}


def _final_weights(config: Config, state, ckpt, last: dict[str, Any]) -> dict[str, Any]:
    """Chooses the weights the final evaluation and the export use, and says which.

    ``--final-weights best``: the best epoch-end state by valid perplexity
    (``<model_dir>/best``) when it beats ``last``, the last weights
    (:func:`_last_weights`; restored into ``state``); otherwise the last weights (the
    latest checkpoint). ``last``: the last weights. Returns ``{"kind": "best"|"last",
    "epoch", "step", "valid_ppl"}``: "best" when the weights are the kept best epoch's.
    """
    selection = state.selection
    if config.run.final_weights != "best":
        return last
    best = {"kind": "best", "epoch": int(selection.best_epoch.numpy()),
            "step": int(selection.best_step.numpy()),
            "valid_ppl": float(selection.best_valid_ppl.numpy())}
    if not best["epoch"]:  # no epoch has ended
        return last
    if best["step"] == last["step"]:
        return dict(last, kind="best")  # the last epoch end is the best: kept already
    if best["valid_ppl"] < last["valid_ppl"]:
        ckpt.restore_best()
        log.info("final weights: the best, epoch %d (step %d, valid ppl %.2f; the last "
                 "weights': %.2f)", best["epoch"], best["step"], best["valid_ppl"],
                 last["valid_ppl"])
        return best
    return last


def _final_metrics(config, plugin, corpus, vocab, progress, model_dir, steps) -> dict[str, Any]:
    metrics: dict[str, Any] = {
        "strategy": plugin.name,
        "replicas": plugin.num_replicas,
        "devices": list(plugin.devices),
        "workers": plugin.num_workers,
        "steps": steps,
        "tokens_per_sec": progress.tokens / progress.seconds if progress.seconds else None,
        "train_ppl": perplexity(progress.nll, progress.count),
        # "sampled": train_ppl is exp of the sampled-softmax training loss, an estimate and
        # no perplexity; valid and test always use the full softmax.
        "train_softmax": config.model.softmax,
        "skipped_batches": progress.skipped,
        # --precision mixed_float16: steps loss scaling skipped (scale halved).
        "loss_scale_skips": progress.scale_skips,
        # None (null in the JSON) for a --vocab-file vocabulary, which has no counts.
        "unigram_valid_ppl": vocab.unigram_perplexity(corpus.splits["valid"])
        if vocab.has_counts else None,
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
    final = metrics.get("final_weights")
    if final:
        at = f"epoch {final['epoch']}, step {final['step']}" if final["epoch"] else \
            f"step {final['step']}, mid-epoch"
        log.info("valid and test of the %s weights (%s)%s", final["kind"], at,
                 "; training stopped early" if metrics.get("stopped_early") else "")
    if metrics.get("tokens_per_sec"):
        log.info("throughput: %.0f tokens/s over %d steps", metrics["tokens_per_sec"],
                 metrics["steps"])


def _result_rows(metrics: dict[str, Any], *, epochs: int) -> list[tuple[str, str]]:
    """The final figures for TensorBoard's text tab: ``(name, value)`` rows."""
    rows = [(f"{name} perplexity", f"{metrics[key]:.2f}") for name, key in (
        ("valid", "valid_ppl"), ("test", "test_ppl"), ("train", "train_ppl"),
        ("oracle valid", "oracle_valid_ppl"), ("oracle test", "oracle_test_ppl"),
        ("unigram valid", "unigram_valid_ppl")) if isinstance(metrics.get(key), float)]
    final = metrics["final_weights"]
    at = f"epoch {final['epoch']}, step {final['step']}" if final["epoch"] else \
        f"step {final['step']}, mid-epoch"
    rows += [("weights", f"{final['kind']} ({at})"), ("epochs trained", str(epochs)),
             ("steps", str(metrics["steps"]))]
    if metrics.get("tokens_per_sec"):
        rows.append(("tokens per second", f"{metrics['tokens_per_sec']:,.0f}"))
    if metrics.get("skipped_batches"):
        rows.append(("skipped batches (non-finite)", str(metrics["skipped_batches"])))
    if metrics.get("stopped_early"):
        rows.append(("stopped early", "yes (--early-stop)"))
    return rows


def _write_json(path: str, metrics: dict[str, Any]) -> None:
    """``metrics`` as JSON at ``path`` (a local path or a URL), written atomically."""
    tf.io.gfile.makedirs(files.parent(files.absolute(path)))
    # Strict JSON has no NaN or Infinity: a diverged run's perplexities are written as null.
    def strict(v):
        if isinstance(v, dict):
            return {k: strict(x) for k, x in v.items()}
        return None if isinstance(v, float) and not math.isfinite(v) else v

    metrics = strict(metrics)
    files.write_text(path, json.dumps(metrics, indent=2, sort_keys=True, default=_json_default,
                                      allow_nan=False))


def _json_default(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")
