"""--cell MODULE:NAME: a user's Keras RNN cell trained, resumed, exported, served and
checked against one device under every synchronous strategy; each mistake one line.

The cells are tests/cells.py's (``cells:three_state``: three state tensors of widths 5, 7
and 3, none the hidden size) and the worked example
(``tfpar.examples.layer_norm_lstm:LayerNormLSTMCell``).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from conftest import NO_INSPECTION, REPO, assert_resumed_from, write_tiny_corpus
from tfpar.tools import evaluate, generate
from tfpar.tools.cli import train_main

THREE = "cells:three_state"
EXAMPLE = "tfpar.examples.layer_norm_lstm:LayerNormLSTMCell"
TESTS = os.path.join(REPO, "tests")


def cell_args(corpus, out, cell=THREE, *extra):
    """A seconds-long stream-mode run of ``cell`` into folder ``out``."""
    return ["--data", str(corpus), "--cell", cell, "--layers", "2", "--embed-dim", "8",
            "--hidden-dim", "8", "--batch-size", "8", "--mode", "stream", "--bptt", "5",
            "--optimizer", "adam", "--lr", "3e-3", "--no-progress", *NO_INSPECTION,
            "--model-dir", str(out / "run"), "--export-dir", str(out / "export"),
            "--metrics-json", str(out / "metrics.json"), *extra]


def last_line(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def checkpoint_tensors(model_dir) -> dict:
    """Every model weight and carried state tensor of the run's latest checkpoint."""
    reader = tf.train.load_checkpoint(os.path.join(model_dir, "checkpoints"))
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
            if k.startswith(("layers/", "carry/"))}


@pytest.fixture(scope="module")
def cell_run(tmp_path_factory):
    """Six steps of the three-state cell with a checkpoint every 3, exported."""
    out = tmp_path_factory.mktemp("cell-run")
    corpus = write_tiny_corpus(tmp_path_factory.mktemp("cell-corpus"))
    assert train_main(cell_args(corpus, out, THREE, "--max-steps", "6",
                                "--checkpoint-every", "3")) == 0
    return {"out": out, "corpus": corpus, "model_dir": str(out / "run"),
            "metrics": json.loads((out / "metrics.json").read_text())}


# ----------------------------------------------------------------------------- the model
def test_the_state_carry_takes_the_cells_widths(cell_run):
    """Stream mode checkpoints each of the three state tensors at its own width."""
    tensors = checkpoint_tensors(cell_run["model_dir"])
    carried = {k.split("/.ATTRIBUTES")[0]: v.shape for k, v in tensors.items()
               if k.startswith("carry/")}
    assert carried == {f"carry/rnn_{i}:{k}": (8, w) for i in range(2)
                       for k, w in enumerate((5, 7, 3))}
    assert not all(np.all(v == 0) for k, v in tensors.items() if k.startswith("carry/"))


def test_initial_weights_are_role_keyed_and_a_cells_own_seed_is_kept():
    """An unseeded random initializer draws from its role's stream (the same values in
    every build, each layer its own); one the cell seeded itself is kept."""
    import keras

    from tfpar.config import ModelConfig
    from tfpar.model.init import role_seed
    from tfpar.model.lm import build_model

    config = ModelConfig(cell=THREE, layers=2, embed_dim=8, hidden_dim=8)
    first, again = build_model(config, 20, seed=3), build_model(config, 20, seed=3)
    kernels = [v for v in first.weights if v.path.endswith("cell/kernel")]
    assert [v.path for v in kernels] == ["rnn_lm/rnn_0/cell/kernel", "rnn_lm/rnn_1/cell/kernel"]
    for i, v in enumerate(kernels):
        want = keras.initializers.GlorotUniform(seed=role_seed(3, f"rnn_{i}/cell/kernel"))(
            v.shape)
        np.testing.assert_array_equal(v.numpy(), want)
    assert not np.array_equal(kernels[0].numpy()[:8], kernels[1].numpy()[:8])
    for a, b in zip(first.weights, again.weights):
        assert a.path == b.path
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    seeded = build_model(ModelConfig(cell="cells:SeededCell", layers=1, embed_dim=8,
                                     hidden_dim=8), 20, seed=3)
    kernel = next(v for v in seeded.weights if v.path.endswith("cell/kernel"))
    np.testing.assert_array_equal(kernel.numpy(), keras.initializers.RandomNormal(
        stddev=0.3, seed=1234)(kernel.shape))


def test_the_example_cell_is_named_by_place_whatever_keras_counted_before():
    import keras

    from tfpar.config import ModelConfig
    from tfpar.model.lm import build_model

    keras.layers.LayerNormalization()  # moves Keras' automatic name counter
    model = build_model(ModelConfig(cell=EXAMPLE, layers=1, embed_dim=8, hidden_dim=8), 20)
    assert sorted(v.path for v in model.weights if "/cell/" in v.path) == [
        f"rnn_lm/rnn_0/cell/{name}" for name in
        ("bias", "kernel", "norm_c/beta", "norm_c/gamma", "norm_x/beta", "norm_x/gamma",
         "recurrent_kernel")]


# ----------------------------------------------------------------------------- resume
@pytest.mark.parametrize("cell", [THREE, EXAMPLE])
def test_a_stream_run_resumed_mid_epoch_ends_as_the_uninterrupted_one(cell, cell_run, tmp_path,
                                                                      capsys):
    """3 steps, then a rerun to 6 that resumes from step 3: the weights and the carried
    state of the uninterrupted 6 steps (which exported), and its valid perplexity."""
    if cell == THREE:
        straight_dir, straight_metrics = cell_run["model_dir"], cell_run["metrics"]
    else:
        straight = tmp_path / "straight"
        assert train_main(cell_args(cell_run["corpus"], straight, cell, "--max-steps", "6",
                                    "--checkpoint-every", "3")) == 0
        straight_dir = straight / "run"
        straight_metrics = json.loads((straight / "metrics.json").read_text())
    assert os.path.isfile(os.path.join(straight_metrics["export_path"], "saved_model.pb"))
    out = tmp_path / "resumed"
    args = cell_args(cell_run["corpus"], out, cell, "--checkpoint-every", "3", "--no-export")
    assert train_main(args + ["--max-steps", "3"]) == 0
    capsys.readouterr()
    assert train_main(args + ["--max-steps", "6"]) == 0
    assert_resumed_from(capsys.readouterr().err, 3)
    resumed, straight = checkpoint_tensors(out / "run"), checkpoint_tensors(straight_dir)
    assert resumed.keys() == straight.keys()
    for key in straight:
        np.testing.assert_allclose(resumed[key], straight[key], rtol=0, atol=1e-6,
                                   err_msg=key)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["valid_ppl"] == pytest.approx(straight_metrics["valid_ppl"], rel=1e-6)


def test_the_best_checkpoint_of_a_custom_cell_is_evaluated_and_fine_tuned_from(
        cell_run, tmp_path, capsys):
    """Two sentence-mode epochs: best/ holds the better epoch's weights, which the run's
    final valid perplexity is of (--final-weights best); --weights best reproduces it."""
    args = cell_args(cell_run["corpus"], tmp_path, THREE, "--mode", "sentence",
                     "--batch-size", "64", "--epochs", "2", "--no-export")
    assert train_main(args) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert os.listdir(tmp_path / "run" / "best")
    capsys.readouterr()
    assert evaluate.main(["--model-dir", str(tmp_path / "run"), "--cell", THREE,
                          "--weights", "best", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)
    assert best["perplexity"] == pytest.approx(metrics["valid_ppl"], rel=1e-6)
    assert train_main(cell_args(cell_run["corpus"], tmp_path / "tuned", THREE,
                                "--init-from", str(tmp_path / "run"), "--init-weights",
                                "best", "--max-steps", "1", "--no-export")) == 0


# ----------------------------------------------------------------------------- serving
def test_the_export_scores_and_generates_in_a_process_that_cannot_import_the_cell(cell_run):
    """A fresh interpreter without tests/ on its path: the SavedModel alone serves it, and
    scores the valid sentences as the run's checkpoint does here, where the cell is
    imported (the export's score signature, traced around the model rebuilt from the
    model dir). The run trained in stream mode; the score signature reads one sentence at a
    time, so its perplexity is not the run's: --model-dir reproduces that (below)."""
    from tfpar.tools.generate import model_dir_module

    export = cell_run["metrics"]["export_path"]
    code = (
        "import importlib.util, json, sys\n"
        "assert importlib.util.find_spec('cells') is None\n"
        "from tfpar.tools import evaluate, generate\n"
        f"sys.exit(evaluate.main(['--model', {export!r}, '--data', "
        f"{str(cell_run['corpus'])!r}, '--json']) or generate.main(['--model', {export!r}, "
        "'--prompt', 'w1 w2', '--max-tokens', '4', '--seed', '1']))\n")
    env = {**os.environ, "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=str(cell_run["out"]), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    served = json.loads(done.stdout[:done.stdout.rindex("}") + 1])
    assert done.stdout.strip().splitlines()[-1].startswith("[w1 w2] ")

    module = model_dir_module(cell_run["model_dir"], "latest", THREE)
    lines = (cell_run["corpus"] / "valid.txt").read_text().splitlines()
    out = module.score(tf.constant(lines))
    nll, tokens = float(np.sum(out["nll"].numpy(), dtype=np.float64)), int(np.sum(out["tokens"]))
    assert served["tokens"] == tokens
    assert served["perplexity"] == pytest.approx(np.exp(nll / tokens), rel=1e-6)


def test_evaluate_and_generate_import_the_cell_only_when_their_command_line_names_it(
        cell_run, capsys):
    model_dir = cell_run["model_dir"]
    assert evaluate.main(["--model-dir", model_dir]) == 2
    assert last_line(capsys) == (
        f"error: --model-dir {model_dir!r} was trained with --cell {THREE}, code that is not "
        f"imported on a model dir's word: add --cell {THREE} to import it (its SavedModel, "
        "--model, needs no import)")
    assert generate.main(["--model-dir", model_dir, "--cell", EXAMPLE]) == 2
    assert last_line(capsys) == (
        f"error: --cell {EXAMPLE} is not the cell of --model-dir {model_dir!r}, which was "
        f"trained with --cell {THREE}; give --cell {THREE}")
    assert evaluate.main(["--model", cell_run["metrics"]["export_path"], "--cell", THREE]) == 2
    assert last_line(capsys).startswith(f"error: --cell {THREE} applies to --model-dir only")

    assert evaluate.main(["--model-dir", model_dir, "--cell", THREE, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["perplexity"] == pytest.approx(cell_run["metrics"]["valid_ppl"], rel=1e-6)
    assert generate.main(["--model-dir", model_dir, "--cell", THREE, "--prompt", "w3",
                          "--max-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("[w3] ")


def test_init_from_a_custom_cell_run_needs_its_cell_named(cell_run, tmp_path, capsys):
    args = cell_args(cell_run["corpus"], tmp_path, THREE, "--init-from",
                     cell_run["model_dir"], "--max-steps", "1", "--no-export")
    unnamed = [a for a in args if a not in ("--cell", THREE)]
    assert train_main(unnamed) == 2
    assert last_line(capsys).startswith(
        f"error: --init-from {cell_run['model_dir']!r} was trained with --cell {THREE}, code")
    assert not (tmp_path / "run").exists()
    assert train_main(args) == 0


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("cell,extra,message", [
    ("nosuchmodule_xyz:Cell", [], "error: --cell nosuchmodule_xyz:Cell: there is no module "
     "'nosuchmodule_xyz' to import; give MODULE:NAME with MODULE importable from here"),
    ("cells:Missing", [], "error: --cell cells:Missing: module 'cells' has no 'Missing'; "
     "give MODULE:NAME where NAME is a Keras RNN cell"),
    ("broken_cell_module:Cell", [], "error: --cell broken_cell_module:Cell: importing "
     "'broken_cell_module' failed: RuntimeError: this module is broken on purpose"),
    ("cells:NOT_A_CELL", [], "error: --cell cells:NOT_A_CELL names the int 42, not a Keras RNN cell"),
    ("cells:dense", [], "error: --cell cells:dense made a Dense layer without state_size, "
     "not a Keras RNN cell"),
    ("cells:NestedStateCell", [], "error: --cell cells:NestedStateCell: state_size "
     "[[5, 7], 3] is not a state the stream carry can hold; give one positive width or a "
     "flat list of them"),
    ("cells:WideCell", [], "error: --cell cells:WideCell: its output is 9 wide, not the "
     "hidden size 8 (--hidden-dim) every layer passes on; make the cell's output_size (or "
     "its first state's width) 8"),
    ("cells:LyingCell", [], "error: --cell cells:LyingCell: its output is 9 wide, not the "
     "hidden size 8 (--hidden-dim)"),
    ("cells:UnusedWeightCell", [], "error: --cell cells:UnusedWeightCell: its weight "
     "cell/spare takes no part in its output or state, so training could not update it; "
     "use every trainable weight, or add it with trainable=False"),
    ("cells:FailingCell", [], "error: --cell cells:FailingCell: running it over a [2, 3, 8] "
     "batch failed: InvalidArgumentError: FailingCell.call(): Matrix size-incompatible: "
     "In[0]: [2,8], In[1]: [23,23] [Op:MatMul]"),
    ("lstm2", [], "error: unknown cell 'lstm2'; expected one of: lstm, gru, or MODULE:NAME"),
    (THREE, ["--weight-drop", "0.1"], "error: weight-drop 0.1 drops the built-in cells' "
     f"recurrent matrix; --cell {THREE} is your own"),
    (THREE, ["--precision", "bf16"], f"error: precision 'bf16' needs a built-in cell; "
     f"--cell {THREE} runs in fp32"),
])
def test_a_bad_cell_is_one_line_and_leaves_nothing_on_disk(cell, extra, message, tmp_path,
                                                           module_tiny_corpus, capsys):
    assert train_main(cell_args(module_tiny_corpus, tmp_path, cell, *extra)) == 2
    line = last_line(capsys)
    assert line.startswith(message), line
    assert not (tmp_path / "run").exists()


def test_parameter_server_refuses_a_custom_cell_in_one_line():
    from tfpar.config import ModelConfig
    from tfpar.errors import ConfigError
    from tfpar.parallel.parameter_server import check_config
    from conftest import small_config

    config = small_config(model=ModelConfig(cell=THREE))
    with pytest.raises(ConfigError, match=r"^--cell cells:three_state: parameter_server's "
                                          r"partitioner may shard"):
        check_config(config)


def test_a_cell_that_calls_python_is_refused_at_export_and_nothing_is_written(
        tmp_path, module_tiny_corpus, capsys):
    """It trains (tf.py_function runs in this process), but no SavedModel can serve it."""
    assert train_main(cell_args(module_tiny_corpus, tmp_path, "cells:PythonCell",
                                "--max-steps", "1")) == 2
    assert last_line(capsys) == (
        "error: --cell cells:PythonCell cannot be exported: its step calls Python "
        "(PyFuncStateless, from tf.py_function or tf.numpy_function) in the 'serving_default' "
        "signature, which a SavedModel cannot serve without this process; write the cell "
        "in TensorFlow ops, or train with --no-export; nothing was written")
    assert list((tmp_path / "export").rglob("*")) in ([], [tmp_path / "export" / "tfpar_lm"])


# ----------------------------------------------------------------------------- strategies
@pytest.mark.parametrize("cell,mode", [(THREE, "stream"), (EXAMPLE, "sentence")])
def test_every_synchronous_strategy_trains_the_cell_as_one_device(cell, mode, tmp_path):
    """verify_parallel --cell: mirrored, tower, parallel_do and pipeline (each layer on
    its stage) against default, at the fp32 tolerances. The three-state cell in stream
    mode (its states carried and split by rows under each strategy), the example in
    sentence mode; the other two pairs added nothing a strategy does differently for a
    cell (each strategy's own tests and test_strategies_equivalence run it in both
    modes with the built-in cells)."""
    from tfpar.tools.verify import main as verify_main

    report = tmp_path / "verify.json"
    assert verify_main(["--cell", cell, "--mode", mode, "--layers", "2", "--hidden-dim", "8",
                        "--embed-dim", "8", "--steps", "4",
                        "--strategies", "default,mirrored:2,tower:3,parallel_do:2,pipeline:2",
                        "--json", str(report)]) == 0
    rows = {r["strategy"]: r for r in json.loads(report.read_text())}
    assert set(rows) == {"default", "mirrored", "tower", "parallel_do", "pipeline"}
    assert all(r["max_abs_param_diff"] <= 1e-5 and r["eval_ppl_rel_diff"] <= 1e-6
               for r in rows.values()), rows


@pytest.mark.cluster
@pytest.mark.parametrize("cell,mode", [(THREE, "stream")])
def test_two_worker_processes_train_the_cell_as_one_device(cell, mode, tmp_path, monkeypatch):
    """The three-state cell, imported by each worker process from a module outside the
    package, its states split by rows over the workers. (The example cell in sentence
    mode: the synchronous strategies' test above; two worker processes in sentence mode:
    test_multi_worker.)"""
    from tfpar.tools.verify import main as verify_main

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([REPO, TESTS]))  # the workers import it
    report = tmp_path / "verify.json"
    assert verify_main(["--cell", cell, "--mode", mode, "--hidden-dim", "8", "--embed-dim",
                        "8", "--steps", "4", "--strategies", "default,multi_worker:2",
                        "--json", str(report)]) == 0
    rows = {r["strategy"]: r for r in json.loads(report.read_text())}
    assert rows["multi_worker"]["replicas"] == 2
    assert rows["multi_worker"]["max_abs_param_diff"] <= 1e-5


def test_one_state_tensor_and_the_python_api():
    """A cell whose state_size is one integer (Keras' SimpleRNNCell) carries one [B, H]
    tensor per layer; the Python API takes the cell as the flag does."""
    import tfpar
    from tfpar.model.lm import build_model

    config = tfpar.make_config(cell="keras.layers:SimpleRNNCell", layers=2, embed_dim=8,
                               hidden_dim=8)
    assert config.model.cell == "keras.layers:SimpleRNNCell" and config.model.custom_cell
    model = build_model(config.model, 20, seed=1)
    assert model.state_widths == (8,)
    state = [[tf.fill([3, 8], 0.5)] for _ in range(2)]
    logits, final = model(tf.ones([3, 4], tf.int32), initial_state=state)
    assert logits.shape == (3, 4, 20)
    assert [[s.shape for s in layer] for layer in final] == [[(3, 8)], [(3, 8)]]
    _, from_zeros = model(tf.ones([3, 4], tf.int32))
    assert not np.allclose(final[0][0], from_zeros[0][0])  # the given state was used
