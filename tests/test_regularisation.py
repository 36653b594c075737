"""Weight decay and tied embeddings with a projection: every synchronous strategy gives
the one-device result (a run compared with default, every checkpointed weight)."""

import numpy as np
import pytest
import tensorflow as tf

from tfpar.tools.cli import train_main
from conftest import PINNED


def run(corpus, model_dir, *extra):
    args = ["--data", str(corpus), *PINNED, "--embed-dim", "16", "--hidden-dim", "32",
            "--tie-embeddings", "--weight-decay", "0.05", "--optimizer", "sgd", "--lr", "0.5",
            "--batch-size", "12", "--max-steps", "8", "--no-progress", "--no-export",
            "--deterministic", "--seed", "2", "--model-dir", str(model_dir), *extra]
    assert train_main(args) == 0
    reader = tf.train.load_checkpoint(str(model_dir / "checkpoints"))
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
            if k.startswith("layers/")}


@pytest.fixture(scope="module")
def reference(module_tiny_corpus, tmp_path_factory):
    return run(module_tiny_corpus, tmp_path_factory.mktemp("ref"))


def test_weight_decay_and_the_tied_projection_take_effect(module_tiny_corpus, reference,
                                                          tmp_path):
    assert reference["layers/softmax:projection/.ATTRIBUTES/VARIABLE_VALUE"].shape == (32, 16)
    assert not any(k.startswith("layers/softmax:kernel") for k in reference)
    plain = run(module_tiny_corpus, tmp_path / "plain", "--weight-decay", "0")
    key = "layers/embedding:embeddings/.ATTRIBUTES/VARIABLE_VALUE"
    # Decay pulls weights towards 0: the decayed table is smaller.
    assert np.linalg.norm(reference[key]) < np.linalg.norm(plain[key]) - 1e-3


@pytest.mark.parametrize("strategy", [
    ["--strategy", "mirrored", "--cpu-devices", "2"], ["--strategy", "tower", "--cpu-devices", "2"],
    ["--strategy", "pipeline", "--cpu-devices", "2"]], ids=lambda s: s[1])
def test_every_synchronous_strategy_matches_one_device(strategy, module_tiny_corpus, reference,
                                                       tmp_path):
    got = run(module_tiny_corpus, tmp_path / "run", *strategy)
    assert got.keys() == reference.keys()
    worst = max(float(np.abs(got[k] - reference[k]).max()) for k in reference)
    assert worst <= 1e-5, worst
