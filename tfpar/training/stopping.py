"""A stop signal (SIGINT, SIGTERM) ends a run cleanly, as a hook the loop calls after
every train call.

The step in flight finishes, the checkpoint of that step is written, and the run ends
with one line saying how to resume: ``Interrupted`` in one process; in a multi-worker
job every worker stops after the same call (``tfpar.training.preemption``) and raises
``Preempted`` (exit status 75), whichever worker got the signal; under parameter-server
training a signal to the chief is a preemption of the whole job. A second signal
interrupts at once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Callable

from tfpar.errors import Interrupted, Preempted
from tfpar.training.preemption import StopTogether

log = logging.getLogger(__name__)


class StopSignal:
    """Turns SIGINT/SIGTERM into a flag (``received``: the signal's name) the loop checks
    after each step."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, then: str = "stopping after this step"):
        self.received: str | None = None
        self.then = then  # what the warning on the first signal says happens next
        self._previous = {}

    def _handle(self, signum, frame):
        if self.received:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name
        log.warning("%s received: %s", self.received, self.then)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


def run_again(model_dir_given: str, checkpoint_dir: str) -> str:
    """How the same command resumes: "again", or with the --model-dir flag when the
    model dir was the default one (new for every run)."""
    return ("again" if model_dir_given else
            f"with --model-dir {os.path.dirname(checkpoint_dir)}")


class StopHook:
    """Installs the signal handlers while a run trains (a context manager) and, called
    after every train call, ends the run once a stop signal has come.

    Args:
      checkpointer: saves the checkpoint of the step reached.
      step: the step reached (updates applied).
      again: how the same command resumes (:func:`run_again`).
      cluster_resolver: a multi-worker job's (None: one process).
      job_chief: the coordinator of parameter-server training, whose stop is the job's.
    """

    def __init__(self, checkpointer, step: Callable[[], int], again: str, *,
                 cluster_resolver=None, job_chief: bool = False):
        self.checkpointer, self.step, self.again = checkpointer, step, again
        self.cluster_resolver, self.job_chief = cluster_resolver, job_chief
        self.signal = StopSignal() if cluster_resolver is None else StopSignal(
            "every worker of the job stops after the same step, agreed on now")
        self.together: StopTogether | None = None

    def __enter__(self):
        self.signal.__enter__()
        if self.cluster_resolver is not None:
            self.together = StopTogether(
                self.cluster_resolver, self.signal,
                save=lambda: self.checkpointer.save(self.step()), error=self.preempted,
                checkpoint_dir=self.checkpointer.directory)
        return self

    def close(self) -> None:
        """Training ended without a stop (a multi-worker job's handler ends its threads)."""
        if self.together is not None:
            self.together.close()

    def __exit__(self, *exc):
        return self.signal.__exit__(*exc)

    def __call__(self) -> None:
        """After every train call: a stop signal checkpoints this step and raises."""
        if self.together is not None:
            self.together.check()
            return
        if self.signal.received:
            self.checkpointer.save(self.step())
            raise self.stopped()

    def stopped(self) -> Exception:
        """The error a stop signal ends this process's run with, its checkpoint saved."""
        received, step, where = self.signal.received, self.step(), self.checkpointer.directory
        if self.job_chief:
            return Preempted(
                f"preempted: {received} reached the chief; the coordinator stopped after "
                f"step {step} (every scheduled step done) and the checkpoint of that step "
                f"is saved in {where}; start the job again (the same command on every "
                f"task, {self.again} on the chief) to resume (exit status "
                f"{Preempted.exit_code})")
        return Interrupted(
            f"stopped by {received} after step {step}; checkpoint saved in {where}; run "
            f"the same command {self.again} to resume")

    def preempted(self) -> Preempted:
        """The error every worker of a multi-worker job raises at the agreed step."""
        received = self.signal.received
        who = f"{received} reached this worker" if received else \
            "a stop signal reached another worker"
        return Preempted(
            f"preempted: {who}; every worker stopped after step {self.step()} and the "
            f"checkpoint of that step is saved in {self.checkpointer.directory}; run the "
            f"same command {self.again} on every worker to resume (exit status "
            f"{Preempted.exit_code})")
