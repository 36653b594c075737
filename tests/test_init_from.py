"""--init-from DIR: a new run starts from a trained run's model weights (not its
optimizer, step or position), with its model shape, tokenizer and vocabulary."""

import dataclasses
import json

import numpy as np
import pytest

from conftest import PINNED, assert_resumed_from, model_config, small_config
from tfpar.tools.cli import train_main

VALUE = "/.ATTRIBUTES/VARIABLE_VALUE"


def run_args(data, model_dir, *more):
    return ["--data", str(data), *PINNED, "--embed-dim", "12", "--hidden-dim", "16",
            "--batch-size", "16", "--epochs", "1", "--no-progress", "--no-export",
            "--model-dir", str(model_dir), *more]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, module_tiny_corpus):
    """Model dir A after 3 steps (no epoch end, so no best/)."""
    a = tmp_path_factory.mktemp("a") / "run"
    assert train_main(run_args(module_tiny_corpus, a, "--max-steps", "3", "--cell", "gru")) == 0
    return a


def checkpoint_weights(path):
    """{name: array} of the model weights a checkpoint holds (``layers/<name>``)."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(str(path))
    return {k[len("layers/"):-len(VALUE)]: reader.get_tensor(k)
            for k in reader.get_variable_to_shape_map()
            if k.startswith("layers/") and k.endswith(VALUE)}


def test_a_new_run_on_another_corpus_starts_from_the_weights_and_vocabulary_of_dir(
        trained, tmp_path, monkeypatch, capsys):
    from tfpar.training import run
    from tfpar.training.state import named_weights

    other = tmp_path / "other"
    other.mkdir()
    for split in ("train", "valid", "test"):  # words A never saw (<unk> to it) and some it did
        lines = [f"x{i % 7} w{i % 40} y{i % 5} w{(3 * i) % 40}" for i in range(60)]
        (other / f"{split}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    seen = {}
    original = run.Loop.run

    def spy(loop):  # the state the first loop starts from (every replica's copy), then it
        if seen:
            return original(loop)
        seen["weights"] = {k: [c.numpy() for c in v.value.values]  # a MirroredVariable
                           for k, v in named_weights(loop.state.model).items()}
        seen["step"] = loop.step
        seen["iterations"] = int(loop.state.optimizer.iterations.numpy())
        return original(loop)

    monkeypatch.setattr(run.Loop, "run", spy)
    b = tmp_path / "b"
    # The flags' shape (lstm, 2 layers, 8 wide, --tokenizer char) is not used: A's is. A
    # mirrored strategy: each replica's copy of the weights is A's.
    assert train_main(run_args(other, b, "--max-steps", "1", "--init-from", str(trained),
                               "--layers", "2", "--embed-dim", "8", "--tokenizer", "char",
                               "--strategy", "mirrored")) == 0
    err = capsys.readouterr().err
    a_ckpt = trained / "checkpoints" / "ckpt-3"
    assert f"I tfpar.training.run: initialised from {a_ckpt} (step 3)" in err
    assert "not this run's cell 'lstm', layers 2, embed_dim 8, tokenizer 'char'" in err
    assert_resumed_from(err, None)
    expected = checkpoint_weights(a_ckpt)
    assert sorted(seen["weights"]) == sorted(expected) and len(expected) >= 4
    for name, value in expected.items():
        assert len(seen["weights"][name]) >= 2  # one copy per replica
        for copy in seen["weights"][name]:
            np.testing.assert_array_equal(copy, value, err_msg=name)
    assert seen["step"] == 0 and seen["iterations"] == 0
    assert (b / "vocab.txt").read_text() == (trained / "vocab.txt").read_text()
    a_config = json.loads((trained / "config.json").read_text())
    b_config = json.loads((b / "config.json").read_text())
    assert b_config["model"] == a_config["model"]
    assert b_config["data"]["source"] == str(other)
    assert b_config["run"]["init_from"] == str(trained)
    assert (b / "checkpoints" / "ckpt-1.index").exists()  # B's own step 1, not A's 4

    # B again: its checkpoint is resumed; --init-from no longer applies.
    assert train_main(run_args(other, b, "--max-steps", "2", "--init-from", str(trained))) == 0
    err = capsys.readouterr().err
    assert_resumed_from(err, 1)
    assert "initialised from" not in err


@pytest.mark.parametrize("what,message", [
    ("missing", "--init-from {dir!r} does not exist; give a training run's model dir"),
    ("empty", "--init-from {dir!r} has no config.json; give the model dir of a tfpar "
              "training run"),
])
def test_init_from_a_folder_that_is_no_run_is_refused(what, message, tiny_corpus_dir,
                                                      tmp_path, capsys):
    folder = tmp_path / what
    if what == "empty":
        folder.mkdir()
    b = tmp_path / "b"
    assert train_main(run_args(tiny_corpus_dir, b, "--init-from", str(folder))) == 2
    assert capsys.readouterr().err == f"error: {message.format(dir=str(folder))}\n"
    assert not b.exists()


def test_init_weights_best_of_a_run_without_an_epoch_end_is_refused(trained, tiny_corpus_dir,
                                                                   tmp_path, capsys):
    b = tmp_path / "b"
    assert train_main(run_args(tiny_corpus_dir, b, "--init-from", str(trained),
                               "--init-weights", "best")) == 2
    assert capsys.readouterr().err == (
        f"error: --init-from {str(trained)!r} has no checkpoint in best/ (kept at the first "
        "epoch end); use --init-weights latest, or train a whole epoch\n")
    assert not b.exists()


def test_a_vocabulary_flag_with_init_from_is_refused(trained, tiny_corpus_dir, tmp_path,
                                                     capsys):
    b = tmp_path / "b"
    assert train_main(run_args(tiny_corpus_dir, b, "--init-from", str(trained),
                               "--vocab-file", str(trained / "vocab.txt"))) == 2
    assert capsys.readouterr().err == (
        f"error: --vocab-file does not apply with --init-from {trained}, whose vocabulary "
        "the run takes; drop one of them\n")
    assert not b.exists()


def test_init_weights_best_reads_dir_best_and_the_config_takes_dirs_model(tmp_path):
    """No training: a model dir with config.json, vocab.txt and checkpoints in both
    checkpoints/ (step 9) and best/ (step 7)."""
    import tensorflow as tf

    from tfpar.config import DataConfig, RunConfig
    from tfpar.training.run import init_source

    a = tmp_path / "a"
    stored = small_config(model=model_config(cell="gru", layers=3, embed_dim=6, hidden_dim=6,
                                      tie_embeddings=True, dropout=0.1),
                    data=DataConfig(tokenizer="punct"))
    a.mkdir()
    (a / "config.json").write_text(stored.to_json())
    (a / "vocab.txt").write_text("<pad>\n<unk>\n<eos>\nw\n")
    checkpoint = tf.train.Checkpoint(v=tf.Variable(1.0))
    for folder, step in (("checkpoints", 9), ("best", 7)):
        tf.train.CheckpointManager(checkpoint, str(a / folder), 1).save(checkpoint_number=step)
    asked = small_config(model=model_config(dropout=0.3), run=RunConfig(
        model_dir=str(tmp_path / "b"), init_from=str(a), init_weights="best"))
    config, path = init_source(asked)
    assert path == str(a / "best" / "ckpt-7")
    latest = asked.replace(run={"init_weights": "latest"})
    assert init_source(latest)[1] == str(a / "checkpoints" / "ckpt-9")
    # DIR's shape, tokenizer and vocabulary; this run's dropout.
    assert config.model == dataclasses.replace(stored.model, dropout=0.3)
    assert config.data.tokenizer == "punct"
    assert config.data.vocab_file == str(a / "vocab.txt")

