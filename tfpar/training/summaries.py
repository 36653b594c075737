"""TensorBoard summaries, written in cross-replica context with explicit steps.

Laid out for a person: TensorBoard draws one chart per tag with a line per run, in
sections named by the tag's part before the first ``/``. The model dir is the session;
its two event folders are the runs::

    <model-dir>/ the session's settings for the HParams dashboard (tfpar.training.hparams)
    train/  per step:   perplexity, loss, speed/tokens_per_sec, update/learning_rate,
                        update/gradient_norm
            per epoch:  weights/<variable> histograms, update/variable_gradient_norms
                        histogram, update/gradient_norm/<layer> scalars, "samples" text
            once:       "config" text, the training calls' graph ("train_steps": the
                        loop of --steps-per-execution steps, 1 by default)
            --profile-steps A,B: a profiler trace in train/plugins/profile/ (of the
                        whole calls that hold A..B)
    eval/   per epoch:  perplexity (valid; also at the last step when the run ends
                        mid-epoch); at the end: "results" text (the final metrics table)

``perplexity`` is one chart: train and valid overlaid. Nothing is a chart of one point:
the epoch count and the once-per-run figures (test perplexity, the final weights) are in
the "results" table and the HParams dashboard.

Processes that are not the chief write nothing (and profile nothing).

Per-layer gradient norms are measured at the end of every epoch, not inside the train
step: the gradient of the mean token loss on one fixed train batch (the first, unshuffled,
without dropout) at the end-of-epoch weights, computed on a copy of the model that lives
outside any strategy. That works the same under every strategy plug-in (no plug-in's step
has to return more, no extra all-reduce or device-to-host copy per step), and the fixed
batch makes the values comparable from epoch to epoch. The global norm of every *training*
step is the per-step ``update/gradient_norm`` scalar. The same copy generates the text
samples.

This module is the event writer; the inspection (``tfpar.training.inspector``), the
graph and profiler hooks around the step functions (``tfpar.training.profiling``) and
the HParams session (``tfpar.training.hparams``) are modules of their own.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from tfpar.training import hparams
from tfpar.training.inspector import EpochInspector
from tfpar.training.profiling import CallHooks

log = logging.getLogger(__name__)
RUNS = ("train", "eval")

# Scalar tags (see the module docstring). A tag's part before "/" is its section.
# TensorBoard's Time Series tab (its first) sorts the sections by name and opens only the
# first two: "loss" and "perplexity" must sort first, so every other section's name
# comes after "perplexity" (a "gradients/" or "optimizer/" section would open instead
# and leave perplexity collapsed; tests/test_summaries.py checks the order).
PERPLEXITY = "perplexity"  # train and eval: one chart, two lines
LOSS = "loss"  # train: the logged step's mean token loss (its call's, N steps per call)
TOKENS_PER_SEC = "speed/tokens_per_sec"
LEARNING_RATE = "update/learning_rate"  # the rate the step used
GLOBAL_NORM = "update/gradient_norm"  # every step's global norm, before clipping
GRADIENTS = "update/gradient_norm/"  # + a layer: its norm on the fixed batch, per epoch
NORMS_HISTOGRAM = "update/variable_gradient_norms"  # every variable's, per epoch
RESULTS = "results"  # eval: the final metrics, a markdown table


class Writer:
    """Thin wrapper over ``tf.summary`` file writers; a no-op when not the chief."""

    def __init__(self, model_dir: str, is_chief: bool = True):
        self.model_dir = model_dir
        self._writers = {}
        self._inspector: EpochInspector | None = None
        self._hooks: CallHooks | None = None
        if is_chief:
            for name in RUNS:
                self._writers[name] = tf.summary.create_file_writer(os.path.join(model_dir, name))

    @property
    def active(self) -> bool:
        return bool(self._writers)

    def scalars(self, run: str, values: dict[str, float], step: int) -> None:
        writer = self._writers.get(run)
        if writer is None:
            return
        with writer.as_default(step=step):
            for name, value in values.items():
                # float64: a diverged run's perplexity (say 6e38) is past float32's range.
                tf.summary.scalar(name, tf.constant(value, tf.float64))

    def text(self, run: str, name: str, value: str | Sequence[str], step: int = 0) -> None:
        """A string, or a list of strings (shown as a table)."""
        writer = self._writers.get(run)
        if writer is None:
            return
        with writer.as_default(step=step):
            tf.summary.text(name, tf.constant(value, tf.string))

    def config_text(self, config) -> None:
        self.text("train", "config", "```\n" + config.to_json() + "\n```")

    def session(self, settings: dict[str, bool | int | float | str]) -> None:
        """The run's ``settings`` (:func:`tfpar.training.hparams.settings`) for the HParams
        dashboard, in the model dir's root; once per model dir (a resumed run finds them)."""
        if self.active:
            hparams.write_session(self.model_dir, settings)

    def results(self, rows: Sequence[tuple[str, str]], step: int) -> None:
        """The run's final figures, ``(name, value)`` rows, as a table in the eval run."""
        table = ["| | |", "|---|---|"] + [f"| {name} | {value} |" for name, value in rows]
        self.text("eval", RESULTS, "\n".join(table), step)

    def histograms(self, model, step: int) -> None:
        writer = self._writers.get("train")
        if writer is None:
            return
        with writer.as_default(step=step):
            for var in model.trainable_variables:
                # A tensor, not var.value: a partitioned (parameter-server) variable's
                # value is a ShardedVariable, which histogram's ops cannot take.
                tf.summary.histogram("weights/" + var.path, tf.convert_to_tensor(var))

    def gradient_norms(self, norms: dict[str, float], step: int) -> None:
        """Per-variable gradient norms (``path -> norm``): one histogram of all of them
        and one scalar per layer (the norm of the layer's variables together)."""
        writer = self._writers.get("train")
        if writer is None or not norms:
            return
        per_layer: dict[str, float] = {}
        for path, norm in norms.items():
            layer = path.split("/")[1] if "/" in path else path
            per_layer[layer] = per_layer.get(layer, 0.0) + norm ** 2
        with writer.as_default(step=step):
            tf.summary.histogram(NORMS_HISTOGRAM, np.array(list(norms.values()), np.float32))
            for layer, square in per_layer.items():
                tf.summary.scalar(GRADIENTS + layer, square ** 0.5)

    # -- hooks called by the training loop
    def enable_inspection(self, config, vocab, data) -> None:
        """Per-epoch gradient norms and text samples (see the module docstring)."""
        if self.active:
            self._inspector = EpochInspector(config, vocab, data)

    def end_epoch(self, model, step: int) -> None:
        """Weight histograms, and with inspection on, gradient norms and text samples."""
        self.histograms(model, step)
        if self._inspector is None:
            return
        self._inspector.refresh(model)
        norms = self._inspector.gradient_norms(model)
        self.gradient_norms(norms, step)
        if not all(np.isfinite(n) for n in norms.values()):
            # Diverged weights (e.g. a huge --lr under --on-nan skip): the next-token
            # scores are not finite either, so there is no text to sample.
            log.warning("the gradient on the fixed train batch is not finite at step %d "
                        "(the weights have diverged): no text samples this epoch", step)
            return
        self.text("train", "samples", self._inspector.samples(seed=step), step)

    def instrument(self, train_steps, next_step: Callable[[], int],
                   profile_steps: Sequence[int] = ()):
        """Wraps ``train_steps`` (``steps(iterator, state, n)``, the loop's training
        call) to write its graph on the first call and to profile the calls holding steps
        ``profile_steps`` = (A, B); ``next_step()`` is the number of the step about to
        run. Returns ``train_steps`` itself when not the chief."""
        if not self.active:
            return train_steps
        self._hooks = CallHooks(self, train_steps, next_step, tuple(profile_steps))
        return self._hooks

    def close(self) -> None:
        if self._hooks is not None:
            self._hooks.stop_profiler()
        for writer in self._writers.values():
            writer.flush()
            writer.close()

    def file_writer(self, run: str):
        return self._writers.get(run)
