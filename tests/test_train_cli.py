"""End-to-end runs of scripts/train.py (in-process) and its one-line errors."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from conftest import REPO, without_gpus
from tfpar.tools.cli import train_main

EXPECTED_KEYS = {"strategy", "replicas", "devices", "steps", "tokens_per_sec", "train_ppl",
                 "valid_ppl", "test_ppl", "unigram_valid_ppl", "export_path"}


@pytest.mark.parametrize("strategy", ["default", "one_device", "mirrored"])
def test_each_strategy_trains_evaluates_and_exports(strategy, tiny_args, tmp_path):
    assert train_main(tiny_args + ["--strategy", strategy]) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert EXPECTED_KEYS <= set(metrics)
    assert metrics["strategy"] == strategy
    assert metrics["replicas"] == (2 if strategy == "mirrored" else 1)
    assert metrics["steps"] == 6
    assert np.isfinite(metrics["valid_ppl"]) and np.isfinite(metrics["test_ppl"])
    assert metrics["export_path"].endswith(os.path.join("tfpar_lm", "1"))
    assert os.path.exists(os.path.join(metrics["export_path"], "saved_model.pb"))
    events = os.listdir(tmp_path / "run" / "train")
    assert any(e.startswith("events.out.tfevents") for e in events)


def test_rerun_resumes_from_the_checkpoint(tiny_args, tmp_path):
    assert train_main(tiny_args + ["--no-export"]) == 0
    args = [a if a != "6" else "9" for a in tiny_args]  # --max-steps 9
    assert train_main(args + ["--no-export"]) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["steps"] == 9
    ckpts = tf.train.get_checkpoint_state(str(tmp_path / "run" / "checkpoints"))
    assert ckpts.model_checkpoint_path.endswith("-9")


def test_resume_with_another_model_size_is_refused(tiny_args, tmp_path, capsys):
    assert train_main(tiny_args + ["--no-export"]) == 0
    capsys.readouterr()
    code, err = cli_error(tiny_args + ["--no-export", "--hidden-dim", "32"], capsys)
    assert code == 2
    assert err.startswith("error: cannot resume")
    assert "model.hidden_dim: checkpoint has 16, this run asks for 32" in err


def test_export_reloads_with_the_same_log_probs(tiny_args, tmp_path):
    from tfpar.config import ModelConfig
    from tfpar.model.lm import build_model
    from tfpar.data.vocab import Vocab

    assert train_main(tiny_args) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    loaded = tf.saved_model.load(metrics["export_path"])
    vocab = Vocab.load(tmp_path / "run" / "vocab.txt")
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    model = build_model(ModelConfig(**saved), len(vocab))
    tf.train.Checkpoint(model=model).restore(
        tf.train.latest_checkpoint(str(tmp_path / "run" / "checkpoints"))).expect_partial()
    ids = tf.constant([[2, 5, 7, 0], [2, 3, 4, 6]], tf.int32)
    served = loaded.signatures["serving_default"](token_ids=ids)["log_probs"].numpy()
    logits, _ = model(ids)
    np.testing.assert_allclose(served, tf.nn.log_softmax(logits).numpy(), atol=1e-5)
    assert served.shape == (2, 4, len(vocab))


def cli_error(argv, capsys):
    """Runs train.py in-process; returns (exit code, the last line on stderr).

    Log lines come before it; the error is always the last line, and alone on it.
    """
    code = train_main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    return code, lines[-1] if lines else ""


@pytest.mark.parametrize("extra,message", [
    (["--strategy", "bogus"], "error: unknown strategy 'bogus'; expected one of: default, "),
    pytest.param(["--strategy", "mirrored", "--all-reduce", "nccl"],
                 "error: --all-reduce nccl needs 2 or more GPUs but this run's devices are ",
                 marks=without_gpus),
    (["--strategy", "mirrored", "--devices", "/gpu:63"],
     "error: device '/gpu:63' does not exist on this host; available: /cpu:0"),
    (["--strategy", "mirrored", "--batch-size", "1"],
     "error: --batch-size 1 is a global batch smaller than the 2 replicas of --strategy "
     "mirrored; use --batch-size >= 2"),
    (["--all-reduce", "magic"], "error: unknown all-reduce 'magic'; expected one of: auto, "),
    (["--cell", "rnn"], "error: unknown cell 'rnn'; expected one of: lstm, gru"),
    (["--optimizer", "lion"], "error: unknown optimizer 'lion'; expected one of: sgd, adam"),
    (["--mode", "bag"], "error: unknown mode 'bag'; expected one of: sentence, stream"),
    (["--lr", "0"], "error: lr must be > 0, got 0.0"),
    (["--epochs", "-1"], "error: epochs must be > 0, got -1"),
    (["--batch-size", "0"], "error: batch-size must be > 0, got 0"),
    (["--hidden-dim", "0"], "error: hidden-dim must be > 0, got 0"),
    (["--vocab-size", "3"], "error: vocab-size 3 is too small"),
    (["--intra-op-threads", "-1"], "error: intra-op-threads must be >= 0, got -1"),
    (["--weight-decay", "-1"], "error: weight-decay must be >= 0, got -1.0"),
    (["--tokenizer", "bpe"],
     "error: unknown tokenizer 'bpe'; expected one of: whitespace, punct, char"),
    (["--split-fractions", "0.9,0.1,0.1"],
     "error: split-fractions '0.9,0.1,0.1' sum to 1.1, not 1; give three fractions that sum "
     "to 1, e.g. 0.9,0.05,0.05"),
    (["--split-fractions", "0.9,0,0.1"],
     "error: split-fractions '0.9,0,0.1': the valid fraction must be > 0, got 0"),
    (["--split-fractions", "0.9,0.1"],
     "error: split-fractions '0.9,0.1' must be three numbers train,valid,test"),
    (["--split-fractions", "0.9,a,0.1"],
     "error: --split-fractions '0.9,a,0.1' must be three comma-separated numbers"),
])
def test_one_line_errors(extra, message, tiny_args, capsys, tmp_path):
    argv = tiny_args + extra
    code, err = cli_error(argv, capsys)
    assert code == 2
    assert err.startswith(message), err
    assert not (tmp_path / "export").exists()


def test_missing_data_dir(tiny_args, capsys, tmp_path):
    code, err = cli_error(tiny_args + ["--data", str(tmp_path / "nope")], capsys)
    assert code == 2 and "nope" in err and "\n" not in err


def test_empty_train_split(tiny_args, capsys, tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    (d / "train.txt").write_text("\n  \n\n")
    (d / "valid.txt").write_text("a b\n")
    (d / "test.txt").write_text("a b\n")
    code, err = cli_error(tiny_args + ["--data", str(d)], capsys)
    assert code == 2 and "train" in err and "\n" not in err


@pytest.mark.parametrize("content,message", [
    (b"one line\ntwo lines\n", "non-blank lines, too few to cut by --split-fractions "
                                "0.9,0.05,0.05 (train/valid/test would get 2/0/0 lines); it "
                                "needs at least 16 lines"),
    (b"text\n\0\1\2", "is binary, not text (NUL byte at offset 5)"),
    (b"caf\xe9\n", "is not UTF-8: byte 0xe9 at offset 3"),
])
def test_a_bad_corpus_file_is_one_line_and_writes_nothing(content, message, tiny_args, capsys,
                                                          tmp_path):
    file = tmp_path / "corpus.txt"
    file.write_bytes(content)
    code, err = cli_error(with_flag(tiny_args, "--data", str(file)), capsys)
    assert code == 2
    assert err.startswith(f"error: corpus file {file} ") and message in err, err
    assert not (tmp_path / "run").exists() and not (tmp_path / "export").exists()


def test_config_json_records_the_tokenizer_and_a_resume_cannot_change_it(tiny_args, tmp_path,
                                                                         capsys):
    assert train_main(tiny_args + ["--no-export", "--tokenizer", "punct"]) == 0
    stored = json.loads((tmp_path / "run" / "config.json").read_text())
    assert stored["data"]["tokenizer"] == "punct"
    assert stored["data"]["split_fractions"] == [0.9, 0.05, 0.05]
    capsys.readouterr()
    code, err = cli_error(tiny_args + ["--no-export"], capsys)
    assert code == 2
    assert "data.tokenizer: checkpoint has 'punct', this run asks for 'whitespace'" in err


def test_model_dir_that_is_a_file(tiny_args, capsys, tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    code, err = cli_error(tiny_args + ["--model-dir", str(f)], capsys)
    assert code == 2
    assert err == f"error: --model-dir {str(f)!r} is a file; give a folder (new or a previous run's to resume it)"


def test_script_prints_no_traceback_and_exits_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "train.py"), "--strategy", "bogus",
         "--model-dir", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: unknown strategy 'bogus'")


def test_help_documents_every_flag():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "train.py"), "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    for flag in ("--strategy", "--all-reduce", "--cpu-devices", "--data", "--mode", "--bptt",
                 "--tie-embeddings", "--clip-norm", "--model-dir", "--export-dir", "--no-export",
                 "--metrics-json", "--batch-size", "--intra-op-threads", "--tokenizer",
                 "--split-fractions"):
        assert flag in proc.stdout


def with_flag(args, flag, value):
    args = list(args)
    args[args.index(flag) + 1] = value
    return args


@pytest.mark.parametrize("mode,message", [
    ("sentence", "train.batch_size (--batch-size): checkpoint has 16, this run asks for 8 in "
                 "the middle of epoch 1 (after batch 6); the global batch can change only at "
                 "an epoch end"),
    ("stream", "train.batch_size (--batch-size): checkpoint has 16, this run asks for 8, and "
               "in stream mode the checkpoint carries 16 rows of recurrent state"),
])
def test_a_new_global_batch_the_checkpoint_cannot_honour_is_refused(mode, message, tiny_args,
                                                                    capsys):
    args = tiny_args + ["--no-export", "--mode", mode, "--bptt", "8"]
    assert train_main(args) == 0
    capsys.readouterr()
    code, err = cli_error(with_flag(with_flag(args, "--batch-size", "8"), "--max-steps", "9"),
                          capsys)
    assert code == 2
    assert err.startswith("error: cannot resume") and message in err


def test_the_global_batch_may_change_at_an_epoch_end(tiny_args, tmp_path, capsys):
    args = with_flag(tiny_args + ["--no-export"], "--max-steps", "0")
    assert train_main(args) == 0  # one whole epoch
    first = json.loads((tmp_path / "metrics.json").read_text())["steps"]
    assert train_main(with_flag(with_flag(args, "--batch-size", "8"), "--epochs", "2")) == 0
    second = json.loads((tmp_path / "metrics.json").read_text())["steps"]
    assert second > 2 * first  # the second epoch has twice as many (smaller) batches
    stored = json.loads((tmp_path / "run" / "config.json").read_text())
    assert stored["train"]["batch_size"] == 8  # config.json records the latest run


def test_moving_to_or_from_parameter_server_warns_that_updates_stop_being_exact(tmp_path,
                                                                                 caplog):
    from tfpar.config import Config, DistConfig
    from tfpar.training.checkpoints import check_config_file

    check_config_file(str(tmp_path), Config(dist=DistConfig(strategy="parameter_server")), True)
    with caplog.at_level("WARNING", logger="tfpar"):
        check_config_file(str(tmp_path), Config(dist=DistConfig(strategy="mirrored")), True)
    assert ("resuming a --strategy parameter_server checkpoint under --strategy mirrored: "
            "the updates before this point were asynchronous") in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="tfpar"):
        check_config_file(str(tmp_path), Config(dist=DistConfig(strategy="tower")), True)
    assert caplog.text == ""  # synchronous to synchronous: exact, nothing to say


def test_time_limit_stops_training_then_evaluates_and_checkpoints(tiny_args, tmp_path, capsys):
    args = with_flag(with_flag(tiny_args + ["--no-export", "--time-limit", "0.0005"],
                               "--max-steps", "0"), "--epochs", "50")
    assert train_main(args) == 0
    err = capsys.readouterr().err
    assert "--time-limit 0.0005 min reached after step" in err
    steps = json.loads((tmp_path / "metrics.json").read_text())["steps"]
    assert 1 <= steps < 50  # far fewer than 50 epochs of batches
    state = tf.train.get_checkpoint_state(str(tmp_path / "run" / "checkpoints"))
    assert state.model_checkpoint_path.endswith(f"ckpt-{steps}")
    code, err = cli_error(tiny_args + ["--time-limit", "-1"], capsys)
    assert code == 2 and err.startswith("error: time-limit must be >= 0, got -1.0")
