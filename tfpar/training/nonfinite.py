"""What a run does with a non-finite step (``--on-nan``, ``--nan-patience``).

The step's finite guard (``tfpar.objective.step.update``) never applies a non-finite
update: the weights, the optimizer's slots and the step counter stay the last good ones,
and the step says so (its output's ``applied``). The loop hands every non-finite step
(neither applied nor a loss-scale skip) to :class:`NonFinitePolicy`, which skips it
(``--on-nan skip``) or gives up (``--on-nan stop``, or ``--nan-patience`` bad steps in a
row). Giving up checkpoints the last good weights with the input position of the first
bad batch of the run (and, in stream mode, the state that batch started from), so a
resumed run, say with a lower ``--lr``, tries those batches again.
"""

from __future__ import annotations

import logging

from tfpar.errors import TrainingError

log = logging.getLogger(__name__)


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
