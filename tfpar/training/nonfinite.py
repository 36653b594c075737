"""What a run does with a non-finite step (``--on-nan``, ``--nan-patience``).

The step's finite guard (``tfpar.objective.step.update``) never applies a non-finite
update: the weights, the optimizer's slots and the step counter stay the last good ones.
The loop hands every non-finite step to :class:`NonFinitePolicy`, which skips it
(``--on-nan skip``) or gives up (``--on-nan stop``, or ``--nan-patience`` bad steps in a
row). Giving up checkpoints the last good weights with the input position of the first
bad batch of the run (and, in stream mode, the state that batch started from), so a
resumed run, say with a lower ``--lr``, tries those batches again.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from tfpar.errors import TrainingError

log = logging.getLogger(__name__)


def is_finite(out) -> bool:
    """Whether a step's loss and gradient norm are both finite."""
    return math.isfinite(float(out.nll_sum)) and math.isfinite(float(out.grad_norm))


def keeps_state(out, loss_scaled: bool) -> bool:
    """Whether the next stream window starts from the state ``out``'s window ended in:
    yes after a finite step, and after a loss-scale skip (finite loss, overflowing scaled
    gradient: the forward pass, hence the state, was finite)."""
    return is_finite(out) or (loss_scaled and math.isfinite(float(out.nll_sum)))


def restart_state_after_non_finite(train_step, loss_scaled: bool = False):
    """Stream mode: the window after a non-finite one starts from a zero state.

    A window whose loss or gradient is not finite usually ends in a NaN/inf recurrent
    state too; carried on, it would make every later window of the epoch non-finite (all
    skipped under --on-nan skip). The next window starts afresh instead, as an epoch does
    (not after a loss-scale skip, see :func:`keeps_state`).
    """

    def step(batch, state=None):
        out = train_step(batch, state)
        return out if keeps_state(out, loss_scaled) else dataclasses.replace(out, state=None)

    return step


class NonFinitePolicy:
    """Called with every non-finite step; :meth:`finite` after every finite record.

    Args:
      train: the run's ``TrainConfig`` (``on_nan``, ``nan_patience``).
      checkpointer: saves the give-up checkpoint.
      state: the train state (its input position is rewound before that checkpoint).
      carry: the stream carry (``tfpar.training.carry.StreamCarry``), rewound likewise.
      progress: the loop's totals (``skipped`` counts the skipped steps).
    """

    def __init__(self, train, checkpointer, state, carry, progress):
        self.on_nan, self.patience = train.on_nan, train.nan_patience
        self.checkpointer, self.state, self.carry, self.progress = (
            checkpointer, state, carry, progress)
        self.bad_in_a_row = 0  # non-finite batches since the last finite one
        self.first_bad = (0, None)  # position and state of the first of bad_in_a_row

    def finite(self) -> None:
        self.bad_in_a_row = 0

    def __call__(self, step: int, nll: float, norm: float, position: int) -> None:
        """The batch at ``position`` of its epoch, after step ``step``, gave loss ``nll``
        and gradient norm ``norm``, not both finite; its update was not applied."""
        what = f"non-finite loss or gradient in the batch after step {step} (loss {nll}, " \
               f"gradient norm {norm})"
        self.bad_in_a_row += 1
        if self.bad_in_a_row == 1:
            self.first_bad = (position, self.carry.last_in)
        give_up = self.patience and self.bad_in_a_row >= self.patience
        if self.on_nan == "stop" or give_up:
            self.rewind_to_first_bad()
        directory = self.checkpointer.directory
        if self.on_nan == "stop":
            self.checkpointer.save(step)  # the last good weights (no-op if saved already)
            raise TrainingError(f"{what}; the update was not applied and the weights of "
                                f"step {step} are checkpointed in {directory}. "
                                "Lower --lr or --clip-norm, or pass --on-nan skip to drop "
                                "such batches")
        if give_up:
            self.checkpointer.save(step)
            raise TrainingError(f"{self.bad_in_a_row} non-finite batches in a row after step "
                                f"{step} (--nan-patience {self.patience}): giving up; the "
                                f"weights of step {step} are checkpointed in {directory}. "
                                "Lower --lr or --clip-norm")
        self.progress.skipped += 1
        log.warning("%s: skipped (--on-nan skip)", what)

    def rewind_to_first_bad(self) -> None:
        """Sets the input position (and carried state) back to the first batch of the
        current run of non-finite ones: what the give-up checkpoint records."""
        position, started_from = self.first_bad
        self.state.batch_in_epoch.assign(position)
        self.carry.rewind(started_from)
