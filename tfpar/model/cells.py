"""Cells of one's own: ``--cell MODULE:NAME``.

``NAME`` in the importable ``MODULE`` is a Keras RNN cell class or a factory; tfpar calls
it with the hidden size (``NAME(hidden_dim)``) once per layer and wraps each cell in
``keras.layers.RNN``, Keras' own loop over time (the built-in ``lstm`` and ``gru`` take
the faster recurrences of :mod:`tfpar.model.layers` instead). A cell is::

    call(inputs [B, D], states: list of [B, w_k]) -> (output [B, H], new states [B, w_k])
    state_size: w_0, or [w_0, w_1, ...]   (positive integers, any widths)
    output_size: H, the hidden size (when absent Keras takes w_0)

The rest of the model is unchanged (embedding, dropout sites, the fused softmax, tied
embeddings), and so are the strategies: a layer is a layer, its state a list of
[B, w_k] tensors carried between stream windows, cut into replica shares and joined back
like an LSTM's (h, c).

Names and initial weights follow the built-in layers' rules:

* the cell is renamed ``cell`` and each sub-layer it holds as an attribute takes the
  attribute's name, so its weights' paths (and checkpoint keys) are
  ``rnn_<i>/cell/<sub-layer>/<weight>`` in every process, whatever Keras' automatic
  names (``layer_normalization_7``) would have been;
* a weight whose initializer is random and unseeded (``"glorot_uniform"``, Keras'
  default for ``add_weight``) draws from its role's stream, the role being that path
  (:mod:`tfpar.model.init`): the same values under every strategy and in every process.
  An initializer the cell seeded itself, and every constant one, is kept as it is;
  ``--init-scale`` does not apply to a cell of one's own.

Importing user code is this module's job alone: the config only holds the text
``MODULE:NAME``. Commands that read a model dir import it only when their own command
line names the cell (``tfpar.training.stored.check_cell_named``).
"""

from __future__ import annotations

import contextlib
import importlib
import re
import threading

import keras
import tensorflow as tf

from tfpar.errors import ConfigError
from tfpar.model.init import role_seed

# The layer's name for the user's cell inside each keras.layers.RNN (Keras' own LSTM
# names its cell lstm_cell).
CELL_NAME = "cell"
SHAPE = ("a Keras RNN cell: a keras.layers.Layer with call(inputs, states) -> (output, "
         "new_states) and a state_size, or a factory taking the hidden size that returns one")


def load(spec: str):
    """``"MODULE:NAME"`` → the object ``NAME`` of module ``MODULE`` (imported).

    Raises:
      ConfigError: the module cannot be imported, or has no ``NAME``.
    """
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ConfigError(f"--cell {spec}: there is no module {module_name!r} to import; "
                              "give MODULE:NAME with MODULE importable from here (a package "
                              "module, or a file's folder on PYTHONPATH)") from None
        raise ConfigError(f"--cell {spec}: importing {module_name!r} failed: "
                          f"{_one_line(e)}") from None
    except Exception as e:  # the user's module raised while it was imported
        raise ConfigError(f"--cell {spec}: importing {module_name!r} failed: "
                          f"{_one_line(e)}") from None
    if not hasattr(module, name):
        raise ConfigError(f"--cell {spec}: module {module_name!r} has no {name!r}; give "
                          f"MODULE:NAME where NAME is {SHAPE}")
    return getattr(module, name)


def make_cell(spec: str, units: int) -> keras.layers.Layer:
    """A new cell of ``spec`` with hidden size ``units``, checked (:func:`check_cell`) and
    renamed (see the module docstring); not built yet.

    Raises:
      ConfigError: see :func:`load` and :func:`check_cell`.
    """
    factory = load(spec)
    if not callable(factory):
        raise ConfigError(f"--cell {spec} names the {type(factory).__name__} "
                          f"{str(factory)[:40]}, not {SHAPE}")
    try:
        cell = factory(units)
    except Exception as e:
        raise ConfigError(f"--cell {spec}: calling it with the hidden size {units} failed "
                          f"({_one_line(e)}); NAME must be {SHAPE}") from None
    check_cell(spec, cell, units)
    _rename(cell, CELL_NAME)
    return cell


def state_widths(spec: str, cell) -> list[int]:
    """The widths of the cell's state tensors, ``[w_0, w_1, ...]``: each state is
    [B, w_k], which stream mode carries between windows, checkpoints and cuts by rows.

    Raises:
      ConfigError: ``state_size`` is not one positive integer or a flat list of them.
    """
    size = cell.state_size
    widths = [size] if isinstance(size, int) else list(size) \
        if isinstance(size, (list, tuple)) else None
    if not widths or not all(isinstance(w, int) and not isinstance(w, bool) and w > 0
                             for w in widths):
        raise ConfigError(f"--cell {spec}: state_size {size!r} is not a state the stream "
                          "carry can hold; give one positive width or a flat list of them "
                          "(e.g. [H, H] for h and c), each state a [batch, width] tensor")
    return widths


def check_cell(spec: str, cell, units: int) -> list[int]:
    """Checks what ``make_cell`` made; returns its state widths.

    Raises:
      ConfigError: not a cell, a state_size the carry cannot hold, or an output that is
        not ``units`` wide.
    """
    if not isinstance(cell, keras.layers.Layer) or not hasattr(cell, "state_size"):
        what = f"a {type(cell).__name__}" if not isinstance(cell, keras.layers.Layer) else \
            f"a {type(cell).__name__} layer without state_size"
        raise ConfigError(f"--cell {spec} made {what}, not {SHAPE}")
    widths = state_widths(spec, cell)
    output = getattr(cell, "output_size", None)
    output = widths[0] if output is None else output  # keras.layers.RNN's rule
    if output != units:
        raise output_width_error(spec, output, units)
    return widths


def output_width_error(spec: str, width, units: int) -> ConfigError:
    """The error for a cell whose output is ``width`` wide where ``units`` was due."""
    return ConfigError(f"--cell {spec}: its output is {width!r} wide, not the hidden size "
                       f"{units} (--hidden-dim) every layer passes on; make the cell's "
                       f"output_size (or its first state's width) {units}")


def probe(spec: str, units: int, input_width: int) -> None:
    """Runs a new cell of ``spec`` (in ``keras.layers.RNN``, its own weights) over a
    [2, 3, input_width] batch and differentiates its outputs and final states: what the
    first step of training would find wrong with it, found before anything is written.

    Raises:
      ConfigError: :func:`make_cell`'s errors; the run fails (the cell's own error, one
        line); an output not ``units`` wide; a trainable weight with no gradient (it takes
        no part in the output or the state, and the step could not update it).
    """
    layer = CellRNN(make_cell(spec, units), return_sequences=True, return_state=True,
                    name="probe")
    x = tf.ones([2, 3, input_width])
    try:
        with tf.GradientTape() as tape:
            out = layer(x)
            total = tf.add_n([tf.reduce_sum(t) for t in out])
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"--cell {spec}: running it over a [2, 3, {input_width}] batch "
                          f"failed: {_one_line(e)}") from None
    if out[0].shape[-1] != units:
        raise output_width_error(spec, out[0].shape[-1], units)
    weights = layer.trainable_weights
    for v, g in zip(weights, tape.gradient(total, weights)):
        if g is None:
            name = v.path.removeprefix("probe/")
            raise ConfigError(f"--cell {spec}: its weight {name} takes no part in its output "
                              "or state, so training could not update it; use every "
                              "trainable weight, or add it with trainable=False")


def _rename(layer: keras.layers.Layer, name: str) -> None:
    """``layer`` and the layers it holds as attributes named for their place, not by
    Keras' session-wide counters: paths (checkpoint keys, initializer roles) that do not
    depend on how many layers the process has made before."""
    layer.name = name
    for attr, value in vars(layer).items():
        if isinstance(value, keras.layers.Layer) and not attr.startswith("_"):
            _rename(value, attr)


class CellRNN(keras.layers.RNN):
    """``keras.layers.RNN`` around a user's cell, whose random unseeded weights draw from
    their roles' streams (module docstring).

    Args:
      cell: the cell (:func:`make_cell`).
      seed: the run's ``--seed``.
      Everything else: as ``keras.layers.RNN``.
    """

    def __init__(self, cell, *, seed: int = 0, **kwargs):
        super().__init__(cell, **kwargs)
        self.seed = seed

    def build(self, sequences_shape, initial_state_shape=None):
        with role_seeded(self.seed, self.name):
            super().build(sequences_shape, initial_state_shape)


# keras.layers.Layer.add_weight is replaced while a CellRNN builds (one at a time): the
# only way to reach the initializers of a cell written by someone else, sub-layers
# included. tests/test_cells.py fails when the replacement stops seeing them.
_BUILDING = threading.RLock()  # re-entrant: a cell may hold a CellRNN of its own


@contextlib.contextmanager
def role_seeded(seed: int, root: str):
    """While the block runs, every ``add_weight`` with a random, unseeded initializer
    draws from the stream of its role: the weight's path from ``root`` on
    (``rnn_0/cell/kernel``)."""
    def add_weight(layer, *args, initializer=None, name=None, **kwargs):
        path = layer.path
        if initializer is None and not args[1:] and "float" in str(
                kwargs.get("dtype") or layer.variable_dtype):
            initializer = "glorot_uniform"  # add_weight's default for a float weight
        if path is not None and name is not None and initializer is not None \
                and not args[1:]:
            role = f"{path}/{name}"
            role = role[role.find(root + "/"):] if root + "/" in role else role
            initializer = seeded(initializer, role_seed(seed, role))
        return original(layer, *args, initializer=initializer, name=name, **kwargs)

    with _BUILDING:
        original = keras.layers.Layer.add_weight
        keras.layers.Layer.add_weight = add_weight
        try:
            yield
        finally:
            keras.layers.Layer.add_weight = original


def seeded(initializer, seed: int):
    """``initializer`` drawing from ``seed`` when it is random and unseeded; else itself."""
    if not isinstance(initializer, (str, keras.initializers.Initializer)):
        return initializer
    init = keras.initializers.get(initializer)
    config = init.get_config()
    if "seed" not in config or config["seed"] is not None:
        return init  # constant, or seeded by the cell itself: the user's own
    return type(init).from_config({**config, "seed": seed})


def _one_line(e: Exception) -> str:
    """``Type: first line`` of an exception; for Keras' wrapper ("Exception encountered
    when calling X.call()."), the wrapped message's first line, unstyled."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(e).splitlines()]
    lines = [line for line in lines if line]
    if len(lines) > 1 and lines[0].startswith("Exception encountered when calling"):
        lines = [f"{lines[0].removeprefix('Exception encountered when calling ').rstrip('.')}:"
                 f" {lines[1]}"]
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*|\s*name:\s*$", "", lines[0])[:300] \
        if lines else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
