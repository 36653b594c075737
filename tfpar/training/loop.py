"""The epoch/step loop: one path records every step; periodic work is hooks.

``Loop`` runs synchronous plug-ins: every training call is the runner's multi-step call
(``tfpar.training.runner.make_train_steps``) of ``--steps-per-execution`` steps (1 by
default). ``AsyncLoop`` (``tfpar.training.async_loop``) runs parameter-server training
(steps scheduled on workers, results read at sync points). Both hand the steps' outputs
(each with its outcome, ``applied`` or not, as the step decided it) to :meth:`Loop.record`,
which checks them, keeps the run's totals and calls every hook with a :class:`Record`:
summaries, the progress bar and periodic checkpoints are hooks, not branches of the loop.
The loop's other pieces have one job each: the stream state it carries
(``tfpar.training.carry``), the non-finite policy (``tfpar.training.nonfinite``) and the
stop signal (``tfpar.training.stopping``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import numpy as np
import tensorflow as tf

from tfpar.objective.losses import perplexity
from tfpar.parallel.rows import replica_batches
from tfpar.training import summaries
from tfpar.training.carry import StreamCarry
from tfpar.training.hooks import CheckpointHook, ProgressHook, Record, SummaryHook, wall_time
from tfpar.training.nonfinite import NonFinitePolicy
from tfpar.training.runner import run_steps
from tfpar.training.schedule import applied_learning_rate
from tfpar.training.stopping import StopHook, run_again

log = logging.getLogger(__name__)
# The progress bar counts an epoch's batches beforehand up to this train-split size.
COUNTED_BYTES = 64 << 20


@dataclasses.dataclass
class Progress:
    """Counters of one run (kept in Python; the durable copies live in the checkpoint)."""

    tokens: float = 0.0
    seconds: float = 0.0
    nll: float = 0.0
    count: float = 0.0
    skipped: int = 0
    # Steps skipped by loss scaling (--precision mixed_float16): the scaled gradient
    # overflowed and the scale was halved; not bad batches.
    scale_skips: int = 0
    first_step_time: float | None = None  # time.time() when the first step was recorded


def evaluate(plugin, eval_step, data, split: str, batch_size: int) -> tuple[float, float]:
    """Total (nll, tokens) of ``split``, distributed like training; ppl = exp(nll / tokens)."""
    batches = plugin.distribute(
        lambda ctx: replica_batches(data, split, training=False, input_context=ctx,
                                    batch_size=batch_size)
    )
    stream = data.config.mode == "stream"
    # Every stream window has ``batch_size`` rows; the first starts from zeros.
    zeros = eval_step.zero_state(batch_size) if stream else None
    nll = count = 0.0
    for out in run_steps(eval_step, batches, stream=stream, initial_state=zeros):
        nll += float(out.nll_sum)
        count += float(out.count)
    return nll, count


# One JSON object per finished epoch, appended in the model dir (a resumed run goes on
# appending): the learning curve without TensorBoard.
EPOCH_METRICS = "metrics.jsonl"


def append_epoch_metrics(model_dir: str, line: dict) -> None:
    """Appends ``line`` (epoch, step, train_ppl, valid_ppl, learning_rate,
    tokens_per_sec, seconds) to ``model_dir/metrics.jsonl``."""
    with tf.io.gfile.GFile(os.path.join(model_dir, EPOCH_METRICS), "a") as f:
        f.write(json.dumps(line) + "\n")


class Loop:
    """Epochs of synchronous steps; see the module docstring."""

    #: A stop signal to this process stops the whole job (the parameter-server chief).
    job_chief = False

    def __init__(self, config, plugin, data, state, checkpointer, writer, train,
                 eval_step, *, cluster_resolver=None):
        self.config, self.plugin, self.data, self.state = config, plugin, data, state
        if config.train.steps_per_execution is None:
            raise ValueError("Loop takes a config whose --steps-per-execution is resolved "
                             "(tfpar.training.run.steps_per_execution), not None")
        self.checkpointer, self.writer = checkpointer, writer
        # Loop: steps(iterator, state, n) -> CallOutput, up to n steps per call
        # (make_train_steps); AsyncLoop: the plug-in's schedule(iterators) -> future.
        self.train, self.eval_step = train, eval_step
        self.progress = Progress()
        self.last_epoch_batches = 0  # batches of the last whole epoch (the bar's total)
        # (step, nll, tokens) of the last epoch end's valid evaluation: the final
        # evaluation reuses it when training ended there (the same weights).
        self.valid_at: tuple[int, float, float] | None = None
        self.stream = config.data.mode == "stream"
        self.carry = StreamCarry(plugin, state, stream=self.stream)
        checkpointer.before_save = self.carry.store
        self.non_finite = NonFinitePolicy(config.train, checkpointer, state, self.carry,
                                          self.progress)
        # A multi-worker job's cluster (None: one process): a stop signal then stops
        # every worker after the same call (tfpar.training.preemption), not this one.
        self.stop = StopHook(checkpointer, lambda: self.step,
                             run_again(config.run.model_dir, checkpointer.directory),
                             cluster_resolver=cluster_resolver, job_chief=self.job_chief)
        self.epoch_began = (time.perf_counter(), Progress())  # for the epoch's log line
        # --time-limit: its clock starts with the run's first training call, so a run
        # makes at least one call however short the limit.
        self.started: float | None = None
        self.timed_out = False
        # --early-stop: set (and logged) at an epoch end, or here when a resumed run's
        # checkpoint had reached the patience already; read by done() at every step.
        self.stopped_early = False
        self.check_early_stop()
        self.bar = ProgressHook(config.run.progress_every) if config.run.progress else None
        self.hooks = [SummaryHook(writer, config.run.log_every),
                      CheckpointHook(checkpointer, config.run.checkpoint_every)]
        if self.bar is not None:
            self.hooks.append(self.bar)

    @property
    def step(self) -> int:
        return self.state.step

    def start_clock(self) -> None:
        """Before each training call: --time-limit counts from the run's first."""
        if self.started is None:
            self.started = time.monotonic()

    def done(self) -> bool:
        """--max-steps reached, --time-limit minutes of training spent, or --early-stop
        epochs ended in a row without a better valid perplexity."""
        max_steps = self.config.train.max_steps
        if max_steps and self.step >= max_steps:
            return True
        if self.stopped_early:
            return True
        limit = self.config.train.time_limit
        if limit and self.started is not None and \
                time.monotonic() - self.started >= 60.0 * limit:
            if not self.timed_out:
                log.info("--time-limit %g min reached after step %d: stopping training",
                         limit, self.step)
                self.timed_out = True
            return True
        return False

    def run(self) -> Progress:
        with self.stop:
            cfg = self.config.train
            while int(self.state.epoch.numpy()) < cfg.epochs and not self.done():
                epoch = int(self.state.epoch.numpy())
                self.epoch_began = (time.perf_counter(), dataclasses.replace(self.progress))
                self.train_epoch(epoch, int(self.state.batch_in_epoch.numpy()))
                if self.bar is not None:
                    self.bar.end_epoch()  # off a terminal: the epoch's last progress line
                if self.done() and int(self.state.batch_in_epoch.numpy()) != 0:
                    break
                self.end_epoch(epoch)
            self.stop.close()
            self.checkpointer.save(self.step)
        return self.progress

    def train_batches(self, epoch: int, skip: int, input_context=None):
        return replica_batches(self.data, "train", training=True, epoch=epoch, skip=skip,
                               input_context=input_context,
                               batch_size=self.config.train.batch_size)

    def batches_left(self, epoch: int, skip: int) -> int:
        """The batches of ``epoch`` after the first ``skip`` (one pass of the input)."""
        return count_batches(self.train_batches(epoch, 0)) - skip

    def start_bar(self, todo: int | None, epoch: int) -> None:
        """The progress of ``epoch`` with ``todo`` batches left (fewer by --max-steps;
        None: not known)."""
        if self.bar is not None:
            max_steps = self.config.train.max_steps
            if todo is None:
                todo = max_steps - self.step if max_steps else None
            self.bar.start_epoch(min(todo, max_steps - self.step) if max_steps else todo,
                                 epoch)

    def bar_total(self, epoch: int, skip: int) -> int | None:
        """The batches left for the progress bar: counted by a pass over the input when
        the train split is at most COUNTED_BYTES, else the last epoch's count (None in
        the first): a large corpus's first step does not wait for a pass over it."""
        if self.data.splits["train"].nbytes <= COUNTED_BYTES:
            return self.batches_left(epoch, skip)
        return self.last_epoch_batches - skip if self.last_epoch_batches else None

    def train_epoch(self, epoch: int, skip: int) -> None:
        """The epoch's steps after the first ``skip``, up to --steps-per-execution per
        call (see ``tfpar.training.runner.make_train_steps``)."""
        batches = self.plugin.distribute(lambda ctx: self.train_batches(epoch, skip, ctx))
        if self.bar is not None:
            self.start_bar(self.bar_total(epoch, skip), epoch)
        iterator, carry = iter(batches), self.carry
        # A resumed epoch starts from the state its checkpoint carried; a new one from 0.
        carry.resume(skip)
        while not self.done():
            start = time.perf_counter()
            self.start_clock()
            call = self.train(iterator, carry.current, self.steps_in_next_call())
            if not call.outputs:
                return
            carry.after_call(call.last_state_in, call.state)
            last = call.outputs[-1]  # (a call ends after a step that was not applied)
            if self.stream and not (last.applied or last.scale_skipped):
                # A non-finite window usually ends in a NaN/inf state too; carried on,
                # it would make every later window of the epoch non-finite (all skipped
                # under --on-nan skip). The next starts afresh instead, as an epoch does
                # (not after a loss-scale skip: its forward pass was finite).
                carry.restart()
            self.record(call.outputs, time.perf_counter() - start)
            if call.exhausted:
                return

    def steps_in_next_call(self) -> int:
        """--steps-per-execution, cut so that a call ends on every --checkpoint-every
        multiple and at --max-steps: what is saved there is that step's state."""
        cfg, step = self.config, self.step
        n = cfg.train.steps_per_execution
        if cfg.run.checkpoint_every:
            n = min(n, cfg.run.checkpoint_every - step % cfg.run.checkpoint_every)
        if cfg.train.max_steps:
            n = min(n, cfg.train.max_steps - step)
        return max(n, 1)

    def record(self, outputs: list, seconds: float, *, as_one: bool = False) -> None:
        """The one place finished steps go: steps not applied are reported (a loss-scale
        skip is counted, a non-finite batch goes to ``--on-nan``), the applied ones are
        counted and handed to every hook.

        ``outputs``: StepOutputs (with ``applied`` and ``scale_skipped``) finished since
        the last record, in order; the state (weights, position) is already theirs. Each
        step is its own record with its own step number, unless ``as_one`` (a
        parameter-server sync point, whose steps' order is not known): one for all."""
        position = int(self.state.batch_in_epoch.numpy())
        self.state.batch_in_epoch.assign_add(len(outputs))
        # The first call traces the graph; its steps are kept out of tokens/s.
        warm = self.step > len(outputs)
        if as_one:
            self._record(outputs, seconds, self.step, position, warm)
        else:
            # Steps not applied do not count; the step numbers end at ours.
            step = self.step - sum(bool(out.applied) for out in outputs)
            for i, out in enumerate(outputs):
                step += bool(out.applied)
                self._record([out], seconds / len(outputs), step, position + i, warm)
        self.stop()

    def _record(self, outputs: list, seconds: float, step: int, position: int,
                warm: bool) -> None:
        finite = []
        for i, out in enumerate(outputs):
            nll, count, norm = float(out.nll_sum), float(out.count), float(out.grad_norm)
            if out.applied:
                finite.append((nll, count, norm))
            elif out.scale_skipped:
                self.progress.scale_skips += 1
                log.debug("loss scaling: the scaled gradient overflowed in the batch after "
                          "step %d; skipped, scale halved", step)
            else:
                self.non_finite(step, nll, norm, position + i)
        if finite:
            self.non_finite.finite()
            r = Record(step=step, steps=len(outputs), nll=sum(f[0] for f in finite),
                       count=sum(f[1] for f in finite),
                       grad_norm=sum(f[2] for f in finite) / len(finite), seconds=seconds,
                       learning_rate=applied_learning_rate(self.state.optimizer, step))
            p = self.progress
            if p.first_step_time is None:
                p.first_step_time = time.time()
            if warm:
                p.tokens += r.count
                p.seconds += seconds
            p.nll += r.nll
            p.count += r.count
            for hook in self.hooks:
                hook(r)

    def check_early_stop(self) -> None:
        """Sets ``stopped_early`` once --early-stop epochs in a row ended without a better
        valid perplexity (the selection changes only at epoch ends)."""
        patience = self.config.train.early_stop
        selection = self.state.selection
        if self.stopped_early or not (patience and selection is not None and
                                      int(selection.stale_epochs.numpy()) >= patience):
            return
        log.info("--early-stop %d: %d epochs without a better valid perplexity than "
                 "%.2f (epoch %d); stopping training", patience, patience,
                 float(selection.best_valid_ppl.numpy()), int(selection.best_epoch.numpy()))
        self.stopped_early = True

    def select(self, epoch: int, ppl: float) -> bool:
        """Epoch ``epoch``'s valid perplexity against the best so far: a better one is the
        new best (True); otherwise one more stale epoch, and --lr-decay-on-plateau
        lowers the learning rate."""
        selection = self.state.selection
        if selection is None:
            return False
        if ppl < float(selection.best_valid_ppl.numpy()):
            selection.best_valid_ppl.assign(ppl)
            selection.best_epoch.assign(epoch + 1)
            selection.best_step.assign(self.step)
            selection.stale_epochs.assign(0)
            return True
        selection.stale_epochs.assign_add(1)
        factor = self.config.train.lr_decay_on_plateau
        if factor:
            selection.lr_scale.assign(selection.lr_scale * factor)
            log.info("valid ppl %.2f is no better than %.2f (epoch %d): learning rate x %g "
                     "(x %.4g in all)", ppl, float(selection.best_valid_ppl.numpy()),
                     int(selection.best_epoch.numpy()), factor,
                     float(selection.lr_scale.numpy()))
        return False

    def end_epoch(self, epoch: int) -> None:
        with self.state.averaged():  # (the weights a run reports, keeps and exports)
            nll, count = evaluate(self.plugin, self.eval_step, self.data, "valid",
                                  self.config.train.global_eval_batch_size)
            self.report_epoch(epoch, nll, count)
        self.checkpointer.save(self.step)

    def report_epoch(self, epoch: int, nll: float, count: float) -> None:
        """Epoch ``epoch``'s end, its valid ``nll`` over ``count`` tokens measured: logs,
        metrics, model selection (the best checkpoint saved from the weights in the
        model), summaries; the epoch counters move on."""
        self.valid_at = (self.step, nll, count)
        ppl = perplexity(nll, count)
        began, before = self.epoch_began
        p = self.progress
        tokens, seconds = p.tokens - before.tokens, p.seconds - before.seconds
        train_ppl = perplexity(p.nll - before.nll, p.count - before.count)
        elapsed = time.perf_counter() - began
        log.info("epoch %d/%d: train ppl %.2f, valid ppl %.2f, %s tokens/s, %s",
                 epoch + 1, self.config.train.epochs, train_ppl, ppl,
                 f"{tokens / seconds:,.0f}" if seconds > 0 else "-", wall_time(elapsed))
        if self.plugin.is_chief:
            append_epoch_metrics(os.path.dirname(self.checkpointer.directory), {
                "epoch": epoch + 1, "step": self.step, "train_ppl": train_ppl,
                "valid_ppl": ppl,
                "learning_rate": applied_learning_rate(self.state.optimizer, self.step),
                "tokens_per_sec": tokens / seconds if seconds > 0 else None,
                "seconds": elapsed})
        best = self.select(epoch, ppl)  # (after the line above: its rate is the epoch's)
        self.check_early_stop()
        self.writer.scalars("eval", {summaries.PERPLEXITY: ppl}, self.step)
        self.writer.end_epoch(self.state.model, self.step)
        self.last_epoch_batches = int(self.state.batch_in_epoch.numpy())
        self.state.epoch.assign(epoch + 1)
        self.state.batch_in_epoch.assign(0)
        self.carry.restart()  # the next epoch starts from zeros
        if best:  # before the run's own save: a kill between the two repeats the epoch end
            self.checkpointer.save_best(self.step)


def count_batches(dataset: tf.data.Dataset) -> int:
    """Elements in a finite dataset (runs the input pipeline once)."""
    return int(dataset.reduce(np.int64(0), tf.autograph.experimental.do_not_convert(
        lambda n, _: n + 1)))
