"""Periodic work of the training loop, as hooks: each is called with every
:class:`Record` the loop makes (``for hook in hooks: hook(record)``)."""

from __future__ import annotations

import dataclasses
import math

import keras


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
                "loss": r.loss, "perplexity": math.exp(min(r.loss, 50.0)),
                "tokens_per_sec": r.tokens_per_sec, "learning_rate": r.learning_rate,
                "grad_norm": r.grad_norm,
            }, r.step)


class CheckpointHook:
    """A checkpoint every ``--checkpoint-every`` steps (0: only at epoch ends)."""

    def __init__(self, checkpointer, every: int):
        self.checkpointer, self.every = checkpointer, every

    def __call__(self, r: Record) -> None:
        if r.reaches(self.every):
            self.checkpointer.save(r.step)


class ProgressHook:
    """A Keras progress bar per epoch. Its loss and ppl are the epoch's so far, per token
    (``exp(total nll / total tokens)``, the figure the epoch line prints at the end), and
    tok/s the epoch's rate so far; Keras' own averaging of per-step values would show the
    mean of per-step perplexities, which early high-loss steps dominate."""

    def __init__(self):
        self.bar = None
        self.nll = self.count = self.seconds = 0.0

    def start_epoch(self, total: int | None) -> None:
        self.bar = keras.utils.Progbar(total, unit_name="step",
                                       stateful_metrics=["loss", "ppl", "tok/s"])
        self.nll = self.count = self.seconds = 0.0

    def __call__(self, r: Record) -> None:
        if self.bar is not None:
            self.nll, self.count = self.nll + r.nll, self.count + r.count
            self.seconds += r.seconds
            loss = self.nll / max(self.count, 1.0)
            self.bar.add(r.steps, [("loss", loss), ("ppl", math.exp(min(loss, 50.0))),
                                   ("tok/s", self.count / max(self.seconds, 1e-9))])
