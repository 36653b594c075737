"""End-to-end runs of scripts/train.py (in-process) and its one-line errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from conftest import REPO, assert_resumed_from, small_config, without_gpus
from tfpar.data.vocab import Vocab
from tfpar.tools.cli import train_main

EXPECTED_KEYS = {"strategy", "replicas", "devices", "steps", "tokens_per_sec", "train_ppl",
                 "valid_ppl", "test_ppl", "unigram_valid_ppl", "export_path"}


@pytest.mark.parametrize("strategy", ["default", "one_device", "mirrored"])
def test_each_strategy_trains_evaluates_and_exports(strategy, tiny_args, tmp_path, capsys):
    assert train_main(tiny_args + ["--strategy", strategy]) == 0
    # The start-up line names the strategy's devices and, for mirrored, its all-reduce.
    lines = [x for x in capsys.readouterr().err.splitlines() if " strategy " in x]
    assert len(lines) == 1 and lines[0].endswith(
        {"default": "strategy default: 1 replica(s) on /device:CPU:0",
         "one_device": "strategy one_device: 1 replica(s) on /device:CPU:0",
         "mirrored": "strategy mirrored: 2 replica(s) on /device:CPU:0, /device:CPU:1; "
                     "all-reduce ReductionToOneDevice"}[strategy]), lines
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


def test_rerun_resumes_from_the_checkpoint(tiny_args, tmp_path, capsys):
    assert train_main(tiny_args + ["--no-export"]) == 0
    args = [a if a != "6" else "9" for a in tiny_args]  # --max-steps 9
    capsys.readouterr()
    assert train_main(args + ["--no-export"]) == 0
    assert_resumed_from(capsys.readouterr().err, 6)
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
    (["--shuffle-buffer", "0"], "error: shuffle-buffer must be > 0, got 0"),
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
    (["--num-sampled", "100"], "error: num-sampled 100 only applies to the sampled softmax; "
                               "add --softmax sampled or drop --num-sampled"),
    (["--softmax", "sampled", "--num-sampled", "0"], "error: num-sampled must be >= 1, got 0"),
    (["--softmax", "sampled", "--num-sampled", "-3"], "error: num-sampled must be >= 1, got -3"),
    # The tiny corpus has 40 words: 43 entries with <pad> <unk> <eos>.
    (["--softmax", "sampled", "--num-sampled", "43"],
     "error: num-sampled 43 must be smaller than the vocabulary size 43; use --num-sampled 42 "
     "or less, or --softmax full"),
    (["--softmax", "sampled"], "error: num-sampled 8192 must be smaller than the vocabulary "
                               "size 43"),
    (["--softmax", "nce"], "error: unknown softmax 'nce'; expected one of: full, sampled"),
    (["--vocab-file", "v.txt", "--vocab-size", "100"],
     "error: vocab-size 100 does not apply to vocab-file 'v.txt', which is used whole; drop "
     "--vocab-size (or --vocab-file to count the train split)"),
    (["--vocab-file", "v.txt", "--min-count", "2"],
     "error: min-count 2 does not apply to vocab-file 'v.txt', which is used whole; drop "
     "--min-count (or --vocab-file to count the train split)"),
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
                 "--split-fractions", "--vocab-file", "--softmax", "--num-sampled"):
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
    capsys.readouterr()
    assert train_main(with_flag(with_flag(args, "--batch-size", "8"), "--epochs", "2")) == 0
    assert_resumed_from(capsys.readouterr().err, first)
    second = json.loads((tmp_path / "metrics.json").read_text())["steps"]
    assert second > 2 * first  # the second epoch has twice as many (smaller) batches
    stored = json.loads((tmp_path / "run" / "config.json").read_text())
    assert stored["train"]["batch_size"] == 8  # config.json records the latest run


def test_moving_to_or_from_parameter_server_warns_that_updates_stop_being_exact(tmp_path,
                                                                                 caplog):
    from tfpar.config import DistConfig
    from tfpar.training.checkpoints import check_config_file

    check_config_file(str(tmp_path), small_config(dist=DistConfig(strategy="parameter_server")), True)
    with caplog.at_level("WARNING", logger="tfpar"):
        check_config_file(str(tmp_path), small_config(dist=DistConfig(strategy="mirrored")), True)
    assert ("resuming a --strategy parameter_server checkpoint under --strategy mirrored: "
            "the updates before this point were asynchronous") in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="tfpar"):
        check_config_file(str(tmp_path), small_config(dist=DistConfig(strategy="tower")), True)
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


def elsewhere(args, tmp_path, name):
    """``args`` with the model dir, export dir and metrics file moved to ``tmp_path/name*``."""
    return with_flag(with_flag(with_flag(args, "--model-dir", str(tmp_path / name)),
                               "--export-dir", str(tmp_path / f"{name}-export")),
                     "--metrics-json", str(tmp_path / f"{name}.json"))


def test_a_previous_runs_vocab_file_gives_the_same_ids_and_metrics(tiny_args, tmp_path, capsys):
    args = tiny_args + ["--no-export", "--seed", "3"]
    assert train_main(args) == 0
    built = json.loads((tmp_path / "metrics.json").read_text())
    shared = tmp_path / "shared-vocab.txt"  # a copy: the first run's dir is not needed
    shared.write_bytes((tmp_path / "run" / "vocab.txt").read_bytes())
    capsys.readouterr()
    assert train_main(elsewhere(args, tmp_path, "again") + ["--vocab-file", str(shared)]) == 0
    assert "vocabulary: 43 entries read from " in capsys.readouterr().err
    assert (tmp_path / "again" / "vocab.txt").read_bytes() == shared.read_bytes()
    given = json.loads((tmp_path / "again.json").read_text())
    for key in ("steps", "train_ppl", "valid_ppl", "test_ppl"):
        assert given[key] == built[key], key
    assert np.isfinite(built["unigram_valid_ppl"]) and given["unigram_valid_ppl"] is None
    stored = json.loads((tmp_path / "again" / "config.json").read_text())
    assert stored["data"]["vocab_file"] == str(shared)


def test_a_vocab_file_with_words_not_in_the_corpus_trains_exports_and_resumes(tiny_args,
                                                                             tmp_path, capsys):
    # The corpus has w0 .. w39: w20 .. w39 become <unk>, extra1/extra2 are never seen.
    tokens = ["<pad>", "<unk>", "<eos>"] + [f"w{i}" for i in range(20)] + ["extra1", "extra2"]
    file = tmp_path / "mine.txt"
    file.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    args = with_flag(tiny_args + ["--vocab-file", str(file)], "--max-steps", "2")
    assert train_main(args) == 0
    vocab = Vocab.load(tmp_path / "run" / "vocab.txt")
    assert vocab.tokens == tuple(tokens)
    assert vocab.encode("w3 w25 extra2") == [6, 1, 24]
    latest = tf.train.latest_checkpoint(str(tmp_path / "run" / "checkpoints"))
    assert [len(tokens), 16] in [shape for _, shape in tf.train.list_variables(latest)]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert np.isfinite(metrics["test_ppl"]) and metrics["unigram_valid_ppl"] is None
    assert (Path(metrics["export_path"]) / "assets" / "vocab.txt").read_text(
        encoding="utf-8") == file.read_text(encoding="utf-8")
    moved = tmp_path / "moved.txt"  # the same contents elsewhere resume the run
    moved.write_bytes(file.read_bytes())
    capsys.readouterr()
    assert train_main(with_flag(with_flag(args, "--vocab-file", str(moved)), "--max-steps", "3")
                      + ["--no-export"]) == 0
    assert_resumed_from(capsys.readouterr().err, 2)
    assert json.loads((tmp_path / "metrics.json").read_text())["steps"] == 3


def test_resume_with_another_vocab_file_is_refused_and_rewrites_nothing(tiny_args, tmp_path,
                                                                        capsys):
    args = with_flag(tiny_args + ["--no-export"], "--max-steps", "1")
    assert train_main(args) == 0
    saved = (tmp_path / "run" / "vocab.txt").read_text(encoding="utf-8")
    other = tmp_path / "other.txt"
    other.write_text(saved.replace("\nw1\n", "\nw1x\n"), encoding="utf-8")
    line = saved.split("\n").index("w1") + 1
    before = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir() if p.is_file()}
    capsys.readouterr()
    code, err = cli_error(args + ["--vocab-file", str(other)], capsys)
    assert code == 2
    assert err == (f"error: cannot resume {tmp_path / 'run'}: vocabulary: the saved vocab.txt "
                   f"(43 entries) and --vocab-file {other} (43 entries) differ at line {line}: "
                   "'w1' against 'w1x'; use a new --model-dir or the original settings")
    after = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir() if p.is_file()}
    assert after == before  # config.json and vocab.txt untouched, no LOCK left


BAD_VOCABS = [
    (None, "does not exist; give the path of a UTF-8 text file with one token per line"),
    (b"<pad>\n<unk>\n<eos>\na\0\n", "is binary, not text (NUL byte at offset 19)"),
    (b"<pad>\n<unk>\n<eos>\ncaf\xe9\n", "is not UTF-8: byte 0xe9 at offset 21"),
    (b"<unk>\n<pad>\n<eos>\nw1\n", "is not a tfpar vocabulary: line 1 holds '<unk>', not "
                                   "'<pad>'; it must start with the lines <pad>, <unk>, <eos>"),
    (b"<pad>\n<unk>\n<eos>\nw1\nw2\nw1\n", "token 'w1' is on line 4 and again on line 6; "
                                          "every token must appear once"),
    (b"<pad>\n<unk>\n<eos>\nw1\n\nw2\n", "line 5 is empty; every line must hold one token"),
    (b"<pad>\n<unk>\n<eos>\n", "holds only <pad>, <unk>, <eos>; it needs at least one word"),
]


@pytest.mark.parametrize("content,message", BAD_VOCABS)
def test_a_bad_vocab_file_is_one_line_and_writes_nothing(content, message, tiny_args, tmp_path,
                                                         capsys):
    file = tmp_path / "vocab-in.txt"
    if content is not None:
        file.write_bytes(content)
    code, err = cli_error(tiny_args + ["--vocab-file", str(file)], capsys)
    assert code == 2
    assert err.startswith(f"error: vocabulary file {file}") and message in err, err
    assert not (tmp_path / "run").exists() and not (tmp_path / "export").exists()


def test_an_unreadable_vocab_file_is_one_line(tiny_args, tmp_path, capsys, monkeypatch):
    file = tmp_path / "vocab-in.txt"
    file.write_bytes(b"<pad>\n<unk>\n<eos>\nw1\n")
    file.chmod(0)
    if os.access(file, os.R_OK):  # root reads anything, so fake the refusal
        real = Path.read_bytes
        monkeypatch.setattr(Path, "read_bytes", lambda self: _refuse(self) if self == file
                            else real(self))
    code, err = cli_error(tiny_args + ["--vocab-file", str(file)], capsys)
    assert code == 2
    assert err == (f"error: cannot read vocabulary file {file}: permission denied; make it "
                   f"readable (e.g. chmod a+r {file})")
    assert not (tmp_path / "run").exists()


def _refuse(path):
    raise PermissionError(13, "Permission denied", str(path))


def test_sampled_softmax_trains_evaluates_with_the_full_softmax_and_exports(tiny_args, tmp_path,
                                                                           capsys):
    """--softmax sampled on 2 replicas: config.json records it; valid perplexity is the
    full softmax's (the export's score signature, which uses every logit, gives the same
    over the valid split); a resume with the full softmax is refused."""
    from tfpar.data.vocab import Vocab

    args = tiny_args + ["--strategy", "mirrored", "--softmax", "sampled", "--num-sampled", "10",
                        "--optimizer", "sgd", "--lr", "1"]
    assert train_main(args) == 0
    stored = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (stored["model"]["softmax"], stored["model"]["num_sampled"]) == ("sampled", 10)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["steps"] == 6 and np.isfinite(metrics["train_ppl"])
    assert metrics["train_softmax"] == "sampled"  # train_ppl: the sampled estimate
    valid = (Path(tiny_args[tiny_args.index("--data") + 1]) / "valid.txt").read_text().split("\n")
    scored = tf.saved_model.load(metrics["export_path"]).signatures["score"](
        text=tf.constant([line for line in valid if line.strip()]))
    ppl = float(np.exp(scored["nll"].numpy().sum() / scored["tokens"].numpy().sum()))
    assert metrics["valid_ppl"] == pytest.approx(ppl, rel=1e-5)
    assert len(Vocab.load(tmp_path / "run" / "vocab.txt")) == 43
    capsys.readouterr()
    code, err = cli_error(tiny_args + ["--strategy", "mirrored", "--optimizer", "sgd", "--lr",
                                       "1"], capsys)
    assert code == 2 and "model.softmax: checkpoint has 'sampled', this run asks for 'full'" \
        in err, err
