"""Periodic work of the training loop, as hooks: each is called with every
:class:`Record` the loop makes (``for hook in hooks: hook(record)``)."""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time

import keras

from tfpar.training import summaries

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Record:
    """The finite steps that finished since the last record."""

    step: int  # updates applied so far
    steps: int  # steps this record covers (1, or a sync point's many)
    nll: float
    count: float
    grad_norm: float  # mean over the steps
    seconds: float
    learning_rate: float

    @property
    def loss(self) -> float:
        return self.nll / max(self.count, 1.0)

    @property
    def tokens_per_sec(self) -> float:
        return self.count / max(self.seconds, 1e-9)

    def reaches(self, every: int) -> bool:
        """Whether a multiple of ``every`` (> 0) lies in (step - steps, step]."""
        return bool(every) and self.step // every > (self.step - self.steps) // every

    def crossed(self, every: int) -> bool:
        """:meth:`reaches`, or this is the first record."""
        return self.step == self.steps or self.reaches(every)


class SummaryHook:
    """Train scalars every ``--log-every`` steps (and at the first)."""

    def __init__(self, writer, every: int):
        self.writer, self.every = writer, every

    def __call__(self, r: Record) -> None:
        if r.crossed(self.every):
            self.writer.scalars("train", {
                summaries.PERPLEXITY: math.exp(min(r.loss, 50.0)), summaries.LOSS: r.loss,
                summaries.LEARNING_RATE: r.learning_rate,
                summaries.TOKENS_PER_SEC: r.tokens_per_sec,
                summaries.GLOBAL_NORM: r.grad_norm,
            }, r.step)


class CheckpointHook:
    """A checkpoint every ``--checkpoint-every`` steps (0: only at epoch ends)."""

    def __init__(self, checkpointer, every: int):
        self.checkpointer, self.every = checkpointer, every

    def __call__(self, r: Record) -> None:
        if r.reaches(self.every):
            self.checkpointer.save(r.step)


def on_terminal() -> bool:
    """Whether ``sys.stdout``, where Keras draws its progress bars, is a terminal: off
    one (a file, a pipe) a bar is a stream of carriage-return redraws."""
    return sys.stdout.isatty()


class ProgressHook:
    """An epoch's progress: on a terminal a Keras progress bar, anywhere else (a file, a
    pipe, a job's log) one plain log line every ``every`` seconds and at the epoch end
    (``every`` 0: at the epoch end only), since a bar written there is a stream of
    carriage-return redraws. Both show the same figures: loss and ppl are the epoch's so
    far, per token (``exp(total nll / total tokens)``, the figure the epoch line prints
    at the end), and tok/s the epoch's rate so far; Keras' own averaging of per-step
    values would show the mean of per-step perplexities, which early high-loss steps
    dominate.

    Args:
      every: seconds between two lines off a terminal (0: only at the epoch end).
      clock: seconds on a monotonic clock (a fake one in tests).
      tty: whether the bar is drawn (None: :func:`on_terminal`, asked at each epoch's
        start).
    """

    def __init__(self, every: float = 30.0, *, clock=time.monotonic, tty: bool | None = None):
        self.every, self.clock, self.tty = every, clock, tty
        self.bar = None
        self.started = False  # an epoch has started
        self.epoch: int | None = None
        self.total: int | None = None
        self.steps = 0
        self.began = self.last_line = 0.0
        self.line_at = -1  # self.steps when the last line was logged
        self.nll = self.count = self.seconds = 0.0

    def start_epoch(self, total: int | None, epoch: int | None = None) -> None:
        """A new epoch (``epoch`` counted from 0) with ``total`` steps to go (None:
        not known)."""
        tty = self.tty if self.tty is not None else on_terminal()
        self.bar = keras.utils.Progbar(total, unit_name="step",
                                       stateful_metrics=["loss", "ppl", "tok/s"]) if tty else None
        self.started = True
        self.epoch, self.total, self.steps, self.line_at = epoch, total, 0, -1
        self.began = self.last_line = self.clock()
        self.nll = self.count = self.seconds = 0.0

    @property
    def loss(self) -> float:
        return self.nll / max(self.count, 1.0)

    @property
    def ppl(self) -> float:
        return math.exp(min(self.loss, 50.0))

    @property
    def tokens_per_sec(self) -> float:
        return self.count / max(self.seconds, 1e-9)

    def __call__(self, r: Record) -> None:
        if not self.started:
            return
        self.nll, self.count = self.nll + r.nll, self.count + r.count
        self.seconds += r.seconds
        self.steps += r.steps
        if self.bar is not None:
            self.bar.add(r.steps, [("loss", self.loss), ("ppl", self.ppl),
                                   ("tok/s", self.tokens_per_sec)])
        elif self.every and self.clock() - self.last_line >= self.every:
            self.log_line()

    def end_epoch(self) -> None:
        """The epoch's training is over (or the run stops in it): off a terminal, its
        last line, unless one was logged at this very step."""
        if self.bar is None and self.started and self.steps and self.line_at != self.steps:
            self.log_line()

    def log_line(self) -> None:
        """``epoch 1: step 120/1001 (11%), loss 5.12, ppl 167.43, 2,918 tok/s, ETA 4m50s``."""
        now = self.clock()
        self.last_line, self.line_at = now, self.steps
        where = f"step {self.steps}"
        eta = ""
        if self.total:
            where += f"/{self.total} ({100 * self.steps // self.total}%)"
            left = max(self.total - self.steps, 0)
            if left:
                eta = f", ETA {wall_time((now - self.began) / self.steps * left)}"
        epoch = f"epoch {self.epoch + 1}: " if self.epoch is not None else ""
        log.info("%s%s, loss %.2f, ppl %.2f, %s tok/s%s", epoch, where, self.loss, self.ppl,
                 f"{self.tokens_per_sec:,.0f}", eta)


def wall_time(seconds: float) -> str:
    """``1h02m03s``, ``4m05s`` or ``6.7s``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"
