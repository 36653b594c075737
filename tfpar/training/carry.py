"""Stream mode's carried recurrent state, as one object.

Row ``b`` of window ``k + 1`` continues row ``b`` of window ``k``, so each window starts
from the state the one before ended in (truncated BPTT). The loop keeps it here:

* ``current``: the state the next window starts from, in the plug-in's form (one tensor
  structure, or ``tf.distribute`` per-replica values); never None in stream mode: an
  epoch's first window starts from explicit zeros of the same form, so one graph of the
  training call serves the first window and the rest;
* ``last_in``: the state the last window started from (a non-finite run rewinds there);
* :meth:`store`: before every checkpoint, ``current`` in the global form (one [B, H]
  tensor per layer and part) into the train state, so a run resumed in the middle of an
  epoch (under any strategy or device count) goes on from it (:meth:`resume`);
* :meth:`restart`: zeros for the next window, after a non-finite one and at an epoch's
  end.

In sentence mode every window starts from zeros: nothing is carried or stored (None).
"""

from __future__ import annotations

import tensorflow as tf


class StreamCarry:
    """The carried state of one run (see the module docstring)."""

    def __init__(self, plugin, state, *, stream: bool):
        self.plugin, self.state, self.stream = plugin, state, stream
        if stream and state.carried() is None:  # (its zeros take the variables' shapes)
            raise ValueError("stream mode carries the state in the train state's carry "
                             "variables: build_train_state(..., carry_rows=batch_size)")
        self._zeros = None
        self.current = self.zeros()
        self.last_in = self.current

    def zeros(self):
        """The zero state in the plug-in's form (made once), None in sentence mode."""
        if self.stream and self._zeros is None:
            self._zeros = self.plugin.local_state(
                tf.nest.map_structure(tf.zeros_like, self.state.carried()))
        return self._zeros

    def resume(self, skip: int):
        """The state an epoch's first window starts from: a resumed epoch's (``skip``
        batches done) from its checkpoint, in the plug-in's form; else zeros."""
        self.current = self.plugin.local_state(self.state.carried()) \
            if self.stream and skip else self.zeros()
        return self.current

    def after_call(self, last_in, final) -> None:
        """A training call ran: its last window started from ``last_in``, ended in
        ``final``."""
        self.last_in, self.current = last_in, final

    def restart(self) -> None:
        """The next window starts from zeros."""
        self.current = self.zeros()

    def rewind(self, to) -> None:
        """The next window starts from ``to`` (a state this object handed out before)."""
        self.current = to

    def store(self) -> None:
        """Before a checkpoint: ``current`` in the global form into the train state."""
        if self.state.carry:
            self.state.store_carry(self.plugin.global_state(self.current))
