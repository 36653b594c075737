"""TensorBoard summaries, written in cross-replica context with explicit steps.

Two event folders (TensorBoard "runs") under the model dir::

    train/  per step:   loss, perplexity, tokens_per_sec, learning_rate, grad_norm
            per epoch:  weights/<variable> histograms, gradient_norms histogram,
                        gradient_norm/<layer> scalars, "samples" text
            once:       "config" text, the train-step graph ("train_step"), and with
                        --steps-per-execution N > 1 the N-step loop's ("train_steps")
            --profile-steps A,B: a profiler trace in train/plugins/profile/ (with
                        --steps-per-execution, of the whole calls that hold A..B)
    eval/   per epoch:  perplexity (valid), epoch; at the end: final_test_perplexity

Processes that are not the chief write nothing (and profile nothing).

Per-layer gradient norms are measured at the end of every epoch, not inside the train
step: the gradient of the mean token loss on one fixed train batch (the first, unshuffled,
without dropout) at the end-of-epoch weights, computed on a copy of the model that lives
outside any strategy. That works the same under every strategy plug-in (no plug-in's step
has to return more, no extra all-reduce or device-to-host copy per step), and the fixed
batch makes the values comparable from epoch to epoch. The global norm of every *training*
step is the per-step ``grad_norm`` scalar. The same copy generates the text samples.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from tfpar.model.lm import detached_copy
from tfpar.objective import step
from tfpar.serving import sample

log = logging.getLogger(__name__)
RUNS = ("train", "eval")
SAMPLE_TOKENS = 30


class Writer:
    """Thin wrapper over ``tf.summary`` file writers; a no-op when not the chief."""

    def __init__(self, model_dir: str, is_chief: bool = True):
        self.model_dir = model_dir
        self._writers = {}
        self._inspector: EpochInspector | None = None
        self._hooks: StepHooks | None = None
        self._call_hooks: CallHooks | None = None
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
            tf.summary.histogram("gradient_norms", np.array(list(norms.values()), np.float32))
            for layer, square in per_layer.items():
                tf.summary.scalar("gradient_norm/" + layer, square ** 0.5)

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

    def instrument(self, train_step, next_step: Callable[[], int],
                   profile_steps: Sequence[int] = ()):
        """Wraps ``train_step`` to write its graph on the first call and to profile steps
        ``profile_steps`` = (A, B); ``next_step()`` is the number of the step about to run.
        Returns ``train_step`` itself when not the chief."""
        if not self.active:
            return train_step
        self._hooks = StepHooks(self, train_step, next_step, tuple(profile_steps))
        return self._hooks

    def instrument_calls(self, train_steps, next_step: Callable[[], int],
                         profile_steps: Sequence[int] = ()):
        """:meth:`instrument` for the multi-step function (``--steps-per-execution``):
        its graph (``train_steps``) is written on its first call, and the profiler runs
        over every call holding a step of ``profile_steps`` (whole calls, so a superset
        of A..B). Shares the profiler with the one-step function's hooks."""
        if not self.active or train_steps is None:
            return train_steps
        hooks = CallHooks(self, train_steps, next_step, tuple(profile_steps))
        if self._hooks is not None:
            hooks.share_profiler(self._hooks)
        self._call_hooks = hooks
        return hooks

    def close(self) -> None:
        for hooks in (self._hooks, self._call_hooks):
            if hooks is not None:
                hooks.stop_profiler()
        for writer in self._writers.values():
            writer.flush()
            writer.close()

    def file_writer(self, run: str):
        return self._writers.get(run)


class StepHooks:
    """A train step that writes its graph once and runs the profiler over steps A..B.

    The profiler starts right *after* step A - 1, so the fetch of step A's batch from the
    input pipeline (``Iterator::…`` events) is inside the trace, and stops after step B.
    The trace lands in ``<model_dir>/train/plugins/profile/<session>/``, where TensorBoard's
    profile plugin finds it.
    """

    graph_name = "train_step"

    def __init__(self, writer: Writer, step_fn, next_step: Callable[[], int],
                 profile_steps: tuple[int, ...]):
        self.writer, self.step_fn, self.next_step = writer, step_fn, next_step
        self.profile = profile_steps
        self.function = getattr(step_fn, "function", None)
        self._graph_written = False
        self._profiler = _ProfilerState()
        self.logdir = os.path.join(writer.model_dir, "train")

    def share_profiler(self, other: "StepHooks") -> None:
        """One profiler session for both hooks (TF runs one per process)."""
        self._profiler = other._profiler

    def __call__(self, *args, **kwargs):
        step = self.next_step()
        if self.profile and self.profile[0] <= step <= self.profile[1]:
            self.start_profiler()
        if self._graph_written:
            out = self.step_fn(*args, **kwargs)
        else:
            out = self._traced(step, *args, **kwargs)
        if self.profile and step >= self.profile[1]:
            self.stop_profiler()
        elif self.profile and step + 1 == self.profile[0]:
            self.start_profiler()
        return out

    def _traced(self, step: int, *args, **kwargs):
        """Runs the first step with graph collection on and writes the graph."""
        tf.summary.trace_on(graph=True, profiler=False)
        try:
            out = self.step_fn(*args, **kwargs)
        except BaseException:
            tf.summary.trace_off()
            raise
        with self.writer.file_writer("train").as_default(step=step):
            tf.summary.trace_export(self.graph_name, step=step)
        self._graph_written = True
        return out

    def start_profiler(self) -> None:
        p = self._profiler
        if p.running or p.done:
            return
        try:
            tf.profiler.experimental.start(self.logdir)
        except tf.errors.AlreadyExistsError:
            log.warning("another profiler is running in this process; --profile-steps skipped")
            p.done = True
            return
        p.running = True
        log.info("profiling steps %d-%d into %s", self.profile[0], self.profile[1], self.logdir)

    def stop_profiler(self) -> None:
        p = self._profiler
        if p.running:
            tf.profiler.experimental.stop()
            p.running, p.done = False, True


class _ProfilerState:
    """Whether the ``--profile-steps`` session is running, or has run."""

    def __init__(self):
        self.running = False
        self.done = False


class CallHooks(StepHooks):
    """:class:`StepHooks` for ``steps(iterator, state, n)``, a call that runs steps
    ``next_step()`` .. ``next_step() + n - 1``: its graph is the multi-step loop's
    (``train_steps``), and the profiler covers every call with a step in A..B."""

    graph_name = "train_steps"

    def __call__(self, iterator, state, n: int):
        first = self.next_step()
        last = first + n - 1
        if self.profile and first <= self.profile[1] and last >= self.profile[0]:
            self.start_profiler()
        if self._graph_written:
            out = self.step_fn(iterator, state, n)
        else:
            out = self._traced(first, iterator, state, n)
        if self.profile and last >= self.profile[1]:
            self.stop_profiler()
        return out


class EpochInspector:
    """A copy of the model outside any strategy, for the per-epoch gradient norms of one
    fixed train batch and for text samples (see the module docstring)."""

    def __init__(self, config, vocab, data):
        self.config, self.vocab, self.data = config, vocab, data
        self.copy = detached_copy(config.model, len(vocab), seed=config.train.seed,
                                  fixed_shapes=config.data.mode == "stream")
        self.sampler = sample.Sampler(self.copy, vocab)
        self._batch = None
        copy = self.copy

        @tf.function(reduce_retracing=True)
        def norms(batch):
            count = tf.reduce_sum(tf.cast(batch["targets"] != 0, tf.float32))
            grads, _, _, _ = step.replica_gradients(copy, batch, count, training=False)
            # A sampled softmax's sparse rows: the norm of the summed rows, never densified.
            return tf.stack([tf.sqrt(step.squared_norm(step.deduplicate(g)))
                             if isinstance(g, tf.IndexedSlices) else tf.norm(g) for g in grads])

        self._norms = norms

    def refresh(self, model) -> None:
        """Copies the current weights of the (possibly distributed) model."""
        self.copy.set_weights(model.get_weights())

    def batch(self) -> dict:
        """The first unshuffled global train batch, fetched once."""
        if self._batch is None:
            ds = self.data.batches("train", training=False,
                                   batch_size=self.config.train.batch_size)
            self._batch = next(iter(ds.take(1)))
        return self._batch

    def gradient_norms(self, model) -> dict[str, float]:
        """``variable path -> gradient norm``, named after ``model``'s variables."""
        values = self._norms(self.batch()).numpy()
        return {v.path: float(n) for v, n in zip(model.trainable_variables, values)}

    def samples(self, *, seed: int, count: int = 3) -> list[str]:
        """``count`` sentences sampled from a sentence start (temperature 1), and the
        greedy continuation of the first words of the first valid sentence."""
        drawn = self.sampler([""] * count, max_tokens=SAMPLE_TOKENS, temperature=1.0,
                             seed=seed)
        prompt = " ".join(self.data.first_line("valid").split()[:3])
        greedy = self.sampler([prompt], max_tokens=SAMPLE_TOKENS, temperature=0.0)[0]
        return [f"sample {i + 1}: {t}" for i, t in enumerate(drawn)] + [
            f"greedy: [{prompt}] {greedy}"]
