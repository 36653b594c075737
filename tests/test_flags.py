"""Every flag of the scripts on some test's command line, and every user-facing error of
the library modules raised.

1. Training flags no other test passed, each given to ``train_main`` with its effect
   asserted (the learning rates a run used and logged, the SavedModel's folder, the
   tokens and steps of an epoch, the bucket boundaries, where the variables live, TF's
   placement setting, the dropout rates of each site, the TFDS folder read).
2. A test that every option string of every script's parser appears in a test file.
3. Each ``raise`` of a user-facing error in config, checkpoints, devices, distribution,
   cluster strategies, pipeline stages and export that no other test triggered, with
   its exact message (library functions called directly with bad input: cheap).
"""

import argparse
import glob
import importlib.util
import json
import logging
import os
import re
import socket
import sys

import numpy as np
import pytest
import tensorflow as tf

from conftest import PINNED, REPO, model_config, small_config, train_config
from tfpar import config as cfg
from tfpar.errors import CheckpointError, ClusterError, ConfigError, DeviceError
from tfpar.tools.cli import train_main


def load_script(name):
    spec = importlib.util.spec_from_file_location(
        f"{name}_flags_script", os.path.join(REPO, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exactly(message: str) -> str:
    """A ``pytest.raises(match=...)`` pattern that matches only ``message``, whole."""
    return "^" + re.escape(message) + "$"


# ------------------------------------------------------------------------ a small corpus
# Train: 8 sentences of 11 words (12 predicted tokens with the sentence end) and 8 of 3
# words (4 tokens), interleaved: 16 sentences, 128 predicted tokens. With --batch-size 8
# an epoch is 2 steps.
LONG, SHORT, ROWS = 11, 3, 8
TRAIN_TOKENS = ROWS * (LONG + 1) + ROWS * (SHORT + 1)  # 128


def write_corpus(folder):
    train = []
    for i in range(ROWS):
        train.append(" ".join(f"w{(i + k) % 10}" for k in range(LONG)))
        train.append(" ".join(f"w{(i * 3 + k) % 10}" for k in range(SHORT)))
    short = [" ".join(f"w{(i + k) % 10}" for k in range(SHORT)) for i in range(4)]
    folder.mkdir(parents=True, exist_ok=True)
    for split, lines in (("train", train), ("valid", short), ("test", short)):
        (folder / f"{split}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def run_args(tmp, *extra):
    """A seconds-long run on the small corpus into ``tmp`` (flags given later win)."""
    data = tmp / "corpus"
    if not data.exists():
        write_corpus(data)
    return ["--data", str(data), *PINNED, "--embed-dim", "8", "--hidden-dim", "8",
            "--batch-size", "8", "--no-progress", "--model-dir", str(tmp / "run"),
            "--export-dir", str(tmp / "export"), "--metrics-json", str(tmp / "metrics.json"),
            *extra]


def metrics(tmp) -> dict:
    return json.loads((tmp / "metrics.json").read_text())


def read_scalars(run_dir, tag) -> dict[int, float]:
    """step -> value of one scalar in a TensorBoard run folder."""
    out = {}
    for path in sorted(glob.glob(os.path.join(str(run_dir), "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == tag:
                    out[event.step] = float(tf.make_ndarray(value.tensor))
    return out


def checkpoint_tensors(path) -> dict[str, np.ndarray]:
    """The model's weights in a checkpoint (``layers/...``; the optimizer's variables and
    the counters left out)."""
    reader = tf.train.load_checkpoint(path)
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
            if k.startswith("layers/")}


# ---------------------------------------------------------------------- learning rates
LR, DECAY, WARMUP = 0.1, 0.5, 4


SGD = ("--optimizer", "sgd", "--batch-size", "4", "--checkpoint-every", "1",
       "--keep-checkpoints", "20", "--log-every", "1", "--epochs", "3", "--no-export")


def weights_after(tmp, step):
    return checkpoint_tensors(str(tmp / "run" / "checkpoints" / f"ckpt-{step}"))


def test_lr_decay_decay_after_and_warmup_steps(tmp_path):
    """Two SGD runs from the same start on the same batches (4 sentences a batch: 4 steps
    an epoch), a checkpoint after every step.

    --lr 0.1 --lr-decay 0.5 --decay-after 2, 10 steps: the 8 steps of epochs 1 and 2
    train at --lr, the 2 of epoch 3 at half of it (every step's learning_rate summary;
    metrics.jsonl has the two finished epochs at --lr).

    --lr 0.4 --warmup-steps 4, 2 steps: step 1 uses 0.4 x 1/4 = 0.1, so its weights are
    those of the first run's step 1; step 2 uses 0.4 x 2/4 = 0.2 from those same weights
    on the same batch, so it moves every weight twice as far as the first run's step 2
    (plain SGD: the update is -lr x the gradient)."""
    decay, warm = tmp_path / "decay", tmp_path / "warmup"
    assert train_main(run_args(decay, *SGD, "--lr", str(LR), "--lr-decay", str(DECAY),
                               "--decay-after", "2", "--max-steps", "10")) == 0
    assert train_main(run_args(warm, *SGD, "--lr", str(LR * WARMUP), "--warmup-steps",
                               str(WARMUP), "--max-steps", "2")) == 0

    per_step = read_scalars(decay / "run" / "train", "update/learning_rate")
    assert sorted(per_step) == list(range(1, 11))
    assert [per_step[s] for s in range(1, 11)] == pytest.approx([LR] * 8 + [LR * DECAY] * 2)
    lines = [json.loads(x) for x in (decay / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(x["epoch"], x["step"]) for x in lines] == [(1, 4), (2, 8)]
    assert [x["learning_rate"] for x in lines] == pytest.approx([LR, LR])

    first, first_plain = weights_after(warm, 1), weights_after(decay, 1)
    assert first and sorted(first) == sorted(first_plain)
    for name in first:
        np.testing.assert_allclose(first[name], first_plain[name], rtol=1e-6, atol=1e-7,
                                   err_msg=name)
    second, second_plain = weights_after(warm, 2), weights_after(decay, 2)
    moved = max(float(np.max(np.abs(second_plain[k] - first[k]))) for k in first)
    assert moved > 1e-4  # the step is well above the tolerance below
    for name in first:
        # atol: a few float32 ulps of the weights (an LSTM's forget bias is 1).
        np.testing.assert_allclose(second[name] - first[name],
                                   2 * (second_plain[name] - first[name]),
                                   rtol=1e-3, atol=1e-6, err_msg=name)
    # The summary of step s holds the rate step s used (not the optimizer's rate after
    # it, step s + 1's: 0.2 and 0.3 here).
    logged = read_scalars(warm / "run" / "train", "update/learning_rate")
    assert sorted(logged) == [1, 2]
    assert [logged[1], logged[2]] == pytest.approx([LR, 2 * LR])  # 0.4 x 1/4, 0.4 x 2/4


# ------------------------------------- export name, bucket boundaries, dropout per site
def test_export_name_max_pad_fraction_and_dropout_per_site(tmp_path, monkeypatch):
    """One 2-step run of a 2-layer model with three kinds of flag:

    --export-name my_lm: the SavedModel is <export-dir>/my_lm/1.

    --max-pad-fraction 0.5 on sentences of 4 and 12 predicted tokens: a bucket grows while
    padding its sentences to its upper end wastes at most the fraction. At the default
    0.02 the buckets end at 4 and 12 (boundaries 5, 13: one more would waste 1/5, 1/13);
    at 0.5 at 8 and 24 (4 of 8, 12 of 24 tokens padding; 9 and 25 would waste more than
    half): boundaries 9, 25.

    --dropout 0.1 --dropout-input 0.2 --dropout-hidden 0.3 --dropout-output 0.4: the
    training step drops at 0.2 on the embedding output (site 0), 0.3 between the layers
    (site 1) and 0.4 before the softmax (site 2)."""
    from tfpar.data import pipeline
    from tfpar.model import noise
    from tfpar.training import run

    made, rates = [], {}

    class InputDataSpy(pipeline.InputData):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    per_row = noise.Noise.per_row

    def per_row_spy(self, x, rate, site, rows, **kwargs):
        rates.setdefault(site, set()).add(rate)
        return per_row(self, x, rate, site, rows, **kwargs)

    monkeypatch.setattr(run, "InputData", InputDataSpy)
    monkeypatch.setattr(noise.Noise, "per_row", per_row_spy)
    assert train_main(run_args(
        tmp_path, "--max-steps", "2", "--export-name", "my_lm", "--max-pad-fraction", "0.5",
        "--layers", "2", "--dropout", "0.1", "--dropout-input", "0.2",
        "--dropout-hidden", "0.3", "--dropout-output", "0.4")) == 0

    version = tmp_path / "export" / "my_lm" / "1"
    assert (version / "saved_model.pb").is_file()
    assert metrics(tmp_path)["export_path"] == str(version)
    assert os.listdir(tmp_path / "export") == ["my_lm"]  # nothing under tfpar_lm

    lengths = np.zeros(13, np.int64)
    lengths[SHORT + 1] = lengths[LONG + 1] = ROWS
    assert pipeline.bucket_boundaries(lengths, 80, 0.02) == [5, 13]  # the default's
    (data,) = made
    assert data.boundaries == [9, 25]

    assert rates == {0: {0.2}, 1: {0.3}, 2: {0.4}}


# --------------------------------------------------------------------- sentence lengths
@pytest.fixture
def records(monkeypatch):
    """Every Record (finished steps) the training loop hands to its hooks."""
    from tfpar.training import hooks, loop

    seen = []

    class Recording(hooks.SummaryHook):
        def __call__(self, r):
            seen.append(r)
            super().__call__(r)

    monkeypatch.setattr(loop, "SummaryHook", Recording)
    return seen


@pytest.mark.parametrize("policy, tokens, steps, verb", [
    # A 12-token sentence keeps 5 tokens: 8 x 5 + 8 x 4.
    ("truncate", ROWS * 5 + ROWS * (SHORT + 1), 2, "truncated"),
    # ... or becomes 3 examples (5 + 5 + 2 tokens): 32 examples, 4 batches of 8.
    ("split", TRAIN_TOKENS, 4, "split into pieces"),
])
def test_max_length_and_long_sentences(policy, tokens, steps, verb, tmp_path, records, capsys):
    """--max-length 5 with --long-sentences truncate drops the tokens past the 5th of
    every long sentence; with split it trains on all of them, in more examples (without
    either flag: 128 tokens in 2 steps). --max-steps stops the run at the expected end of
    the epoch (an epoch of fewer batches ends there: fewer steps) and spares it the
    end-of-epoch evaluation."""
    assert train_main(run_args(tmp_path, "--max-length", "5", "--long-sentences", policy,
                               "--max-steps", str(steps), "--no-export")) == 0
    assert sum(r.count for r in records) == tokens
    assert metrics(tmp_path)["steps"] == steps
    assert (f"{ROWS} train sentences (in the vocabulary pass) are longer than max-length 5 "
            f"tokens and are {verb}") in capsys.readouterr().err


# ------------------------------------------------------------------------- placement
@pytest.fixture
def soft_placement_restored():
    before = tf.config.get_soft_device_placement()
    yield
    tf.config.set_soft_device_placement(before)


@pytest.fixture
def built_states(monkeypatch):
    """The TrainState of every ``build_train_state`` call (training and evaluation)."""
    from tfpar.training import run, state

    built = []
    real = state.build_train_state

    def spy(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(run, "build_train_state", spy)
    monkeypatch.setattr(state, "build_train_state", spy)
    return built


def assert_all_on(variables, device):
    assert variables
    for v in variables:
        assert v.value.device.endswith(device), (v.path, v.value.device)


def test_variable_device_and_soft_placement_in_train_and_evaluate(
        tmp_path, built_states, soft_placement_restored, capsys):
    """train.py --strategy tower with towers on /cpu:1,/cpu:2 would keep its variables on
    /cpu:1; --variable-device /cpu:3 puts the weights and the optimizer's variables
    there, and --soft-placement turns TensorFlow's soft placement on for the run
    (without either flag TensorFlow's setting stays). evaluate.py --model-dir takes both
    flags too: the rebuilt model's variables on /cpu:2, soft placement on, and the valid
    perplexity training reported (on one device) for the same checkpoint."""
    tf.config.set_soft_device_placement(False)
    assert train_main(run_args(tmp_path, "--strategy", "tower", "--devices", "/cpu:1,/cpu:2",
                               "--variable-device", "/cpu:3", "--soft-placement",
                               "--max-steps", "2", "--no-export")) == 0
    assert tf.config.get_soft_device_placement() is True
    (state,) = built_states
    assert_all_on(state.model.weights, "CPU:3")
    assert_all_on(state.optimizer.variables, "CPU:3")
    assert "variables on /device:CPU:3" in capsys.readouterr().err
    assert metrics(tmp_path)["devices"] == ["/device:CPU:1", "/device:CPU:2"]

    tf.config.set_soft_device_placement(False)
    assert load_script("evaluate").main([
        "--model-dir", str(tmp_path / "run"), "--split", "valid", "--json", "--strategy",
        "tower", "--devices", "/cpu:0,/cpu:1", "--variable-device", "/cpu:2",
        "--soft-placement"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert tf.config.get_soft_device_placement() is True
    assert result["strategy"] == "tower" and result["replicas"] == 2
    assert len(built_states) == 2
    assert_all_on(built_states[1].model.weights, "CPU:2")
    assert result["perplexity"] == pytest.approx(metrics(tmp_path)["valid_ppl"], rel=1e-5)


# ----------------------------------------------------------------------------- --verbose
QUICK_FAILURES = {  # a usage error found after the script has set up its logging
    "train": ["--lr", "0"],
    "generate": ["--model", "nowhere", "--max-tokens", "-1"],
    "evaluate": ["--model", "nowhere", "--batch-size", "-1"],
    "verify_parallel": ["--lr", "0"],
}


@pytest.fixture
def tf_loggers_restored():
    names = ("absl", "tensorflow", "h5py")
    before = {n: logging.getLogger(n).level for n in names}
    yield
    for n, level in before.items():
        logging.getLogger(n).setLevel(level)


@pytest.mark.parametrize("script", sorted(QUICK_FAILURES))
def test_verbose_lets_tensorflows_logs_through(script, tf_loggers_restored, capsys):
    """Without -v/--verbose a script silences TensorFlow's Python loggers below ERROR;
    with --verbose it leaves them as they are."""
    main = train_main if script == "train" else load_script(script).main
    for verbose in (False, True):
        logging.getLogger("tensorflow").setLevel(logging.NOTSET)
        argv = QUICK_FAILURES[script] + (["--verbose"] if verbose else [])
        assert main(argv) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: ")
        want = logging.NOTSET if verbose else logging.ERROR
        assert logging.getLogger("tensorflow").level == want, (script, verbose)


# ---------------------------------------------------------------------------------- TFDS
def test_tfds_data_dir_is_where_tfds_data_is_read(tmp_path, capsys):
    """--tfds-data-dir DIR: tfds:NAME is looked for in DIR (empty here: the run ends with
    the one-line error naming DIR, and nothing is downloaded)."""
    pytest.importorskip("tensorflow_datasets")
    folder = tmp_path / "tfds"
    folder.mkdir()
    args = run_args(tmp_path, "--data", "tfds:tiny_shakespeare", "--tfds-data-dir",
                    str(folder), "--max-steps", "1", "--no-export")
    assert train_main(args) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: TFDS dataset 'tiny_shakespeare' is not prepared in {folder} and tfpar does "
        "not download during training; prepare it online first with: python -c \"import "
        f"tensorflow_datasets as tfds; tfds.load('tiny_shakespeare', data_dir='{folder}')\"")
    assert not any(p.is_file() for p in folder.rglob("*"))


# ------------------------------------------------------------------------- faults --cpu-hog
@pytest.mark.parametrize("hog", [False, True])
def test_faults_cpu_hog_runs_a_hog_for_the_kill_test(hog, tmp_path, monkeypatch, capsys):
    """faults.py kills --cpu-hog starts the hog process (seeded by --seed) before the
    runs and stops it at the end, even when a run fails; without it, no hog. (The runs
    are replaced by a failing stub: the kill test itself takes minutes.)"""
    import subprocess

    import faults

    started = []

    def fake_hog(seed):
        started.append((seed, subprocess.Popen([sys.executable, "-c",
                                                "import time; time.sleep(300)"])))
        return started[-1][1]

    def no_reference(*args, **kwargs):
        raise RuntimeError("stub: no reference run")

    monkeypatch.setattr(faults, "start_cpu_hog", fake_hog)
    monkeypatch.setattr(faults, "run_reference", no_reference)
    argv = ["kills", "--kills", "1", "--modes", "sentence", "--seed", "7", "--workdir",
            str(tmp_path / "work")] + (["--cpu-hog"] if hog else [])
    try:
        assert faults.main(argv) == 1
        out = capsys.readouterr()
        assert "error: stub: no reference run" in out.err
        assert ("cpu hog on" in out.out) == hog
        assert [seed for seed, _ in started] == ([7] if hog else [])
        for _, proc in started:
            assert proc.poll() is not None  # stopped on the way out
    finally:
        for _, proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# ------------------------------------------------------------- every flag in some test
def script_parsers() -> dict[str, argparse.ArgumentParser]:
    """The parser of every command but tfpar-benchmark, and of scripts/faults.py."""
    import importlib

    import faults
    from tfpar.tools.commands import COMMANDS

    parsers = {name: importlib.import_module(module).parser()
               for name, module in COMMANDS.items() if name != "tfpar-benchmark"}
    parsers["faults.py"] = faults.parser()
    return parsers


def test_no_command_accepts_an_abbreviated_flag():
    """argparse's abbreviations (``--epoch`` for ``--epochs``) are off in every command and
    subcommand: an abbreviation would escape the preset merge, and a flag added later
    could silently change what an abbreviation means."""
    for name, parser in script_parsers().items():
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        for p in [parser] + [s for a in subs for s in a.choices.values()]:
            assert p.allow_abbrev is False, (name, p.prog)


def flags_of(parser, prefix=""):
    """(where, option strings) of every option, subcommands' included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from flags_of(sub, f"{prefix}{name} ")
        elif action.option_strings:
            yield prefix, tuple(action.option_strings)


# Options no test passes, as {"--flag": "why a test would cost too much"}; keep it short.
# Empty: every option of the scripts above is on some test's command line.
NOT_ON_A_TEST_COMMAND_LINE: dict[str, str] = {}


def test_every_flag_of_every_script_is_in_a_test():
    """Each option (any of its spellings: -v or --verbose) of tfpar-train, -generate,
    -evaluate, -verify, -launch, -download, -plot and faults.py (kills, matrix) appears, as a whole word, in some test file's text. A textual check:
    a new flag fails it until a test passes it (whether that test checks its effect is
    up to the test; scripts sharing a flag's name share its entry)."""
    text = "\n".join(open(path, encoding="utf-8").read()
                     for path in glob.glob(os.path.join(REPO, "tests", "*.py")))
    missing = []
    parsers = script_parsers()
    assert set(parsers) == {"tfpar-train", "tfpar-generate", "tfpar-evaluate", "tfpar-verify",
                            "tfpar-launch", "tfpar-download", "tfpar-plot", "faults.py"}
    for script, parser in parsers.items():
        flags = list(flags_of(parser))
        assert len(flags) > 3, script
        for where, options in flags:
            if any(o in NOT_ON_A_TEST_COMMAND_LINE for o in options):
                continue
            if not any(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", text) for o in options):
                missing.append(f"{script} {where}{'/'.join(options)}")
    assert not missing, "flags no test passes: " + ", ".join(missing)


# ================================================================ user-facing errors
# ----------------------------------------------------------------------------- config.py
@pytest.mark.parametrize("make, message", [
    (lambda: cfg.DataConfig(long_sentences="wrap"),
     "unknown long-sentences policy 'wrap'; expected one of: split, truncate"),
    (lambda: cfg.DataConfig(bptt=0), "bptt must be > 0, got 0"),
    (lambda: cfg.DataConfig(vocab_size=-1), "vocab-size must be >= 0, got -1"),
    (lambda: cfg.DataConfig(min_count=0), "min-count must be > 0, got 0"),
    (lambda: cfg.DataConfig(max_length=1), "max-length must be >= 2, got 1"),
    (lambda: cfg.DataConfig(max_pad_fraction=0.0), "max-pad-fraction must be in (0, 1), got 0.0"),
    (lambda: cfg.DataConfig(max_pad_fraction=1.0), "max-pad-fraction must be in (0, 1), got 1.0"),
    (lambda: cfg.DataConfig(synthetic_train=0), "synthetic-train must be > 0, got 0"),
    (lambda: cfg.DataConfig(synthetic_valid=0), "synthetic-valid must be > 0, got 0"),
    (lambda: cfg.DataConfig(synthetic_test=-5), "synthetic-test must be > 0, got -5"),
    (lambda: model_config(precision="fp16"),
     "unknown precision 'fp16'; expected one of: fp32, bf16, mixed_bfloat16, mixed_float16"),
    (lambda: model_config(layers=0), "layers must be > 0, got 0"),
    (lambda: model_config(embed_dim=0), "embed-dim must be > 0, got 0"),
    (lambda: model_config(dropout=1.0), "dropout must be in [0, 1), got 1.0"),
    (lambda: model_config(dropout_input=-0.1), "dropout-input must be in [0, 1), got -0.1"),
    (lambda: model_config(dropout_hidden=1.5), "dropout-hidden must be in [0, 1), got 1.5"),
    (lambda: model_config(dropout_output=1.0), "dropout-output must be in [0, 1), got 1.0"),
    (lambda: model_config(embed_dropout=1.0), "embed-dropout must be in [0, 1), got 1.0"),
    (lambda: model_config(weight_drop=-0.5), "weight-drop must be in [0, 1), got -0.5"),
    (lambda: model_config(init_scale=-0.1), "init-scale must be >= 0, got -0.1"),
    (lambda: model_config(softmax_blocks="1024"),
     "softmax-blocks '1024' must be ROWSxCOLUMNS, two positive integers (tokens x vocabulary "
     "entries of logits at a time), e.g. 1024x16384"),
    (lambda: model_config(softmax_blocks="0x512"),
     "softmax-blocks '0x512' must be ROWSxCOLUMNS, two positive integers (tokens x "
     "vocabulary entries of logits at a time), e.g. 1024x16384"),
    (lambda: train_config(scale_lr="sqrt"), "unknown scale-lr 'sqrt'; expected one of: "
                                               "none, linear"),
    (lambda: train_config(on_nan="ignore"), "unknown on-nan 'ignore'; expected one of: "
                                               "stop, skip"),
    (lambda: train_config(nan_patience=-1), "nan-patience must be >= 0, got -1"),
    (lambda: train_config(lr_decay=0.0), "lr-decay must be > 0, got 0.0"),
    (lambda: train_config(decay_after=-1), "decay-after must be >= 0, got -1"),
    (lambda: train_config(warmup_steps=-1), "warmup-steps must be >= 0, got -1"),
    (lambda: train_config(clip_norm=-1.0), "clip-norm must be >= 0, got -1.0"),
    (lambda: train_config(max_steps=-1), "max-steps must be >= 0, got -1"),
    (lambda: train_config(ema_momentum=1.0), "--ema-momentum must be in [0, 1) (0: off; 0.99 "
     "averages about the last 100 steps), got 1.0"),
    (lambda: train_config(eval_batch_size=-1), "eval-batch-size must be >= 0, got -1"),
    (lambda: cfg.DistConfig(tower_reduce="tree"),
     "unknown tower-reduce 'tree'; expected one of: controller, ring"),
    (lambda: cfg.DistConfig(communication="mpi"),
     "unknown communication 'mpi'; expected one of: auto, ring, nccl"),
    (lambda: cfg.DistConfig(cpu_devices=-1), "cpu-devices must be >= 0, got -1"),
    (lambda: cfg.DistConfig(micro_batches=0), "micro-batches must be > 0, got 0"),
    (lambda: cfg.RunConfig(checkpoint_every=-1), "checkpoint-every must be >= 0, got -1"),
    (lambda: cfg.RunConfig(keep_checkpoints=0), "keep-checkpoints must be > 0, got 0"),
    (lambda: cfg.RunConfig(evaluator_timeout=0), "--evaluator-timeout must be > 0 seconds, got 0"),
    (lambda: cfg.RunConfig(log_every=0), "log-every must be > 0, got 0"),
    (lambda: cfg.RunConfig(init_weights="first"),
     "unknown init-weights 'first'; expected one of: latest, best"),
    (lambda: cfg.Config.from_dict({"train": {"learning_rate": 1, "lr": 1, "steps": 2}}),
     "unknown train config field(s): learning_rate, steps"),
])
def test_config_errors(make, message):
    with pytest.raises(ConfigError, match=exactly(message)):
        make()


# ------------------------------------------------------------------------ checkpoints.py
def test_model_dir_that_cannot_be_created(tmp_path):
    from tfpar.training import checkpoints

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    model_dir = blocker / "run"
    config = small_config(run=cfg.RunConfig(model_dir=str(model_dir)))
    with pytest.raises(ConfigError, match=exactly(
            f"cannot create --model-dir '{model_dir}': {blocker} is not a directory")):
        with checkpoints.open_model_dir(config, True):
            pass


def test_lock_that_other_runs_keep_taking(tmp_path, monkeypatch):
    """A stale lock is removed, and another run creates it again at once, three times:
    the run gives up instead of looping."""
    from tfpar.training import checkpoints

    lock_path = tmp_path / checkpoints.LOCK_FILE
    lock_path.write_text("")  # empty: its writer died while writing it (stale)
    real_remove = os.remove
    removed = []

    def remove_then_another_run_takes_it(path):
        real_remove(path)
        if os.path.abspath(path) == str(lock_path):
            removed.append(path)
            lock_path.write_text("")

    monkeypatch.setattr(os, "remove", remove_then_another_run_takes_it)
    lock = checkpoints.WriterLock(str(tmp_path))
    with pytest.raises(ConfigError, match=exactly(
            f"cannot take the lock {lock_path}: other runs keep taking it; use another "
            "--model-dir")):
        lock.acquire()
    assert len(removed) == 3 and not lock.held


def test_no_readable_checkpoint(tmp_path):
    from tfpar.training import checkpoints

    saver = checkpoints.Checkpointer(str(tmp_path), True, 3, v=tf.Variable(1.0))
    saver.save(1)
    saver.save(2)
    folder = tmp_path / "checkpoints"
    for path in folder.iterdir():
        if path.name != "checkpoint":  # every checkpoint's index and data, not the list
            path.write_bytes(b"not a checkpoint")
    again = checkpoints.Checkpointer(str(tmp_path), True, 3, v=tf.Variable(0.0))
    with pytest.raises(CheckpointError, match=exactly(
            f"no readable checkpoint in {folder} (tried 2); remove the folder to start "
            "afresh")):
        again.restore_latest()


@pytest.mark.parametrize("position", [3, 0])
def test_batch_size_change_in_the_middle_of_an_epoch(position, tmp_path):
    """A checkpoint 3 batches into epoch 1 cannot go on with another --batch-size (its
    position counts batches of the old size); at an epoch end (position 0) it can."""
    from tfpar.training import checkpoints

    stored = small_config(train=train_config(batch_size=16))
    (tmp_path / checkpoints.CONFIG_FILE).write_text(stored.to_json())
    state = tf.train.Checkpoint(epoch=tf.Variable(0, dtype=tf.int64),
                                batch_in_epoch=tf.Variable(position, dtype=tf.int64))
    tf.train.CheckpointManager(state, str(tmp_path / "checkpoints"), 1).save(checkpoint_number=3)
    asked = stored.replace(train={"batch_size": 32})
    if position == 0:
        checkpoints.check_config_file(str(tmp_path), asked, True)
        return
    with pytest.raises(CheckpointError, match=exactly(
            f"cannot resume {tmp_path}: train.batch_size (--batch-size): checkpoint has 16, "
            "this run asks for 32 in the middle of epoch 1 (after batch 3); the global batch "
            "can change only at an epoch end; use a new --model-dir or the original settings")):
        checkpoints.check_config_file(str(tmp_path), asked, True)


# ---------------------------------------------------------------------------- devices.py
def test_more_cpu_devices_after_tensorflow_started():
    from tfpar.parallel import devices

    existing = len(tf.config.list_logical_devices("CPU"))  # TensorFlow is initialised
    with pytest.raises(DeviceError, match=exactly(
            f"{existing + 1} logical CPU devices were asked for, but TensorFlow was already "
            f"initialised with {existing}; set --cpu-devices before anything runs on "
            "TensorFlow")):
        devices.configure_cpu_devices(existing + 1)
    assert len(tf.config.list_logical_devices("CPU")) == existing


def test_device_listed_twice():
    from tfpar.parallel import devices

    with pytest.raises(DeviceError, match=exactly(
            "--devices lists a device twice: /cpu:0,/device:CPU:0")):
        devices.resolve_devices(("/cpu:0", "/device:CPU:0"))


def test_more_default_devices_than_the_host_has():
    from tfpar.parallel import devices

    gpus = devices.num_gpus()
    cpus = len(tf.config.list_logical_devices("CPU"))
    count = gpus + cpus + 1
    with pytest.raises(DeviceError, match=exactly(
            f"{count} devices were asked for but this host has {gpus} GPUs and {cpus} "
            f"logical CPU devices; pass --cpu-devices {count}")):
        devices.default_devices(count)


def test_devices_flag_naming_no_device():
    with pytest.raises(ConfigError, match=exactly(
            "--devices ' , ' names no device; use a form like /cpu:0,/cpu:1")):
        cfg.parse_devices(" , ")


# ------------------------------------------------------------------------- distribute.py
def test_one_device_with_two_devices():
    from tfpar.parallel import distribute

    with pytest.raises(ConfigError, match=exactly(
            "one_device takes one device, got --devices /cpu:0,/cpu:1")):
        distribute.build_one_device(cfg.DistConfig(strategy="one_device",
                                                   devices=("/cpu:0", "/cpu:1")))


# ----------------------------------------------------------- multi_worker, parameter_server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_multi_worker_with_devices(monkeypatch):
    from tfpar.parallel import multi_worker

    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
        "task": {"type": "worker", "index": 0}}))
    with pytest.raises(ConfigError, match=exactly(
            "--devices /cpu:0: multi_worker uses every GPU of each worker (or its CPU); "
            "choose GPUs with CUDA_VISIBLE_DEVICES")):
        multi_worker.build_multi_worker(cfg.DistConfig(strategy="multi_worker",
                                                       devices=("/cpu:0",)))


def test_multi_worker_after_tensorflow_started(monkeypatch):
    """This process has run TensorFlow already: MultiWorkerMirroredStrategy cannot
    configure its collectives any more (and starts no server)."""
    from tfpar.parallel import multi_worker

    port = free_port()
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}"]},
        "task": {"type": "worker", "index": 0}}))
    tf.constant(1.0) + 1.0  # TensorFlow has run something
    with pytest.raises(ClusterError, match=exactly(
            "multi_worker must start before TensorFlow runs anything in this process (its "
            "collectives are configured at start-up); build the strategy first")):
        multi_worker.build_multi_worker(cfg.DistConfig(strategy="multi_worker"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nothing listens on this task's port


def test_parameter_server_coordinator_on_a_worker(monkeypatch):
    from tfpar.parallel import parameter_server

    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]},
        "task": {"type": "worker", "index": 0}}))
    with pytest.raises(ClusterError, match=exactly(
            "worker 0 of a parameter_server cluster only serves; the coordinator runs on the "
            "chief task")):
        parameter_server.build_coordinator(cfg.DistConfig(strategy="parameter_server"))


# ---------------------------------------------------------------------- pipeline/stages.py
@pytest.mark.parametrize("count", [4, 0])
def test_more_pipeline_stages_than_model_parts(count):
    from tfpar.parallel.pipeline import stages

    with pytest.raises(ConfigError, match=exactly(
            f"cannot cut the 3 parts of a 1-layer model into {count} stages; use 1 to 3 "
            "devices")):
        stages.even_stages(1, [f"/cpu:{i}" for i in range(count)])


# ----------------------------------------------------------------------------- export.py
def test_saved_model_that_cannot_be_loaded(tmp_path):
    from tfpar.serving import export

    version = tmp_path / "lm" / "1"
    version.mkdir(parents=True)
    (version / "saved_model.pb").write_bytes(b"\x00garbage, not a SavedModel")
    with pytest.raises(CheckpointError, match=r"^" + re.escape(
            f"cannot load SavedModel '{version}': ") + r"\S[^\n]*$"):
        export.load_saved_model(str(tmp_path / "lm"))


def test_saved_model_without_tfpars_signatures(tmp_path):
    from tfpar.serving import export

    module = tf.Module()
    module.f = tf.function(lambda x: {"y": x + 1},
                           input_signature=[tf.TensorSpec([None], tf.float32)])
    version = tmp_path / "other" / "3"
    tf.saved_model.save(module, str(version), signatures={"serving_default": module.f})
    with pytest.raises(CheckpointError, match=exactly(
            f"SavedModel '{version}' lacks the signature(s) score, generate; re-export it "
            "with this tfpar")):
        export.load_saved_model(str(tmp_path / "other"))


def test_fused_softmax_flags_reach_the_model_config():
    from tfpar.tools.cli import config_from_args, train_parser

    model = config_from_args(train_parser().parse_args(
        ["--no-fused-softmax", "--softmax-blocks", "64X512"])).model
    assert (model.fused_softmax, model.softmax_block_sizes()) == (False, (64, 512))
    model = config_from_args(train_parser().parse_args([])).model
    assert (model.fused_softmax, model.softmax_block_sizes()) == (
        True, cfg.DEFAULT_SOFTMAX_BLOCKS)  # the default
    assert config_from_args(train_parser().parse_args(["--fused-softmax"])).model.fused_softmax


@pytest.mark.parametrize("flag,want", [([], None), (["--soft-placement"], True),
                                       (["--no-soft-placement"], False)])
def test_soft_placement_is_tensorflows_default_unless_a_flag_says(flag, want,
                                                                  soft_placement_restored):
    """No flag leaves TensorFlow's setting (on by default: the sampled softmax's
    CPU-only op can leave a GPU); either flag sets it."""
    from tfpar.parallel import devices
    from tfpar.tools.cli import dist_config_from_args, train_parser

    dist = dist_config_from_args(train_parser().parse_args(flag))
    assert dist.soft_placement is want
    tf.config.set_soft_device_placement(True)
    devices.set_placement_options(log_placement=False, soft_placement=dist.soft_placement)
    assert tf.config.get_soft_device_placement() is (True if want is None else want)


def test_config_and_the_command_with_no_flags_are_the_same_run():
    """One source of defaults: ``Config()`` (the Python API's start) and ``tfpar-train``
    with no flags agree on every field of every section."""
    from tfpar.tools.cli import config_from_args, train_parser

    assert config_from_args(train_parser().parse_args([])) == cfg.Config()
    model = cfg.Config().model  # what the user gets: the tuned 2x200 tied LSTM
    assert (model.layers, model.hidden_dim, model.tie_embeddings) == (2, 200, True)


# Flag values that the generic rule (a bool flipped, a number moved, a tuple of two)
# would make invalid or that need a companion flag: field -> (argv, expected fields).
SPECIAL_VALUES = {
    "source": (["--data", "ptb"], {"source": "ptb"}),
    "split_fractions": (["--split-fractions", "0.8,0.1,0.1"],
                        {"split_fractions": (0.8, 0.1, 0.1)}),
    "tokenizer": (["--tokenizer", "char"], {"tokenizer": "char"}),
    "mode": (["--mode", "stream"], {"mode": "stream"}),
    "vocab_size": (["--vocab-size", "500"], {"vocab_size": 500}),
    "long_sentences": (["--long-sentences", "truncate"], {"long_sentences": "truncate"}),
    "max_pad_fraction": (["--max-pad-fraction", "0.5"], {"max_pad_fraction": 0.5}),
    "cell": (["--cell", "gru"], {"cell": "gru"}),
    "precision": (["--precision", "bf16"], {"precision": "bf16"}),
    "softmax": (["--softmax", "sampled"], {"softmax": "sampled"}),
    "num_sampled": (["--softmax", "sampled", "--num-sampled", "7"],
                    {"softmax": "sampled", "num_sampled": 7}),
    "softmax_blocks": (["--softmax-blocks", "64x128"], {"softmax_blocks": "64x128"}),
    "optimizer": (["--optimizer", "adam"], {"optimizer": "adam"}),
    "scale_lr": (["--scale-lr", "linear"], {"scale_lr": "linear"}),
    "on_nan": (["--on-nan", "skip"], {"on_nan": "skip"}),
    "lr_decay_on_plateau": (["--lr-decay-on-plateau", "0.25"], {"lr_decay_on_plateau": 0.25}),
    "ema_momentum": (["--ema-momentum", "0.9"], {"ema_momentum": 0.9}),
    "devices": (["--devices", "/cpu:0,/cpu:1"], {"devices": ("/cpu:0", "/cpu:1")}),
    "all_reduce": (["--all-reduce", "nccl"], {"all_reduce": "nccl"}),
    "tower_reduce": (["--tower-reduce", "ring"], {"tower_reduce": "ring"}),
    "communication": (["--communication", "ring"], {"communication": "ring"}),
    "cluster": (["--cluster", "slurm"], {"cluster": "slurm"}),
    "soft_placement": (["--no-soft-placement"], {"soft_placement": False}),
    "final_weights": (["--final-weights", "last"], {"final_weights": "last"}),
    "init_weights": (["--init-weights", "best"], {"init_weights": "best"}),
    "profile_steps": (["--profile-steps", "3,5"], {"profile_steps": (3, 5)}),
}


def flag_and_value(flag) -> tuple[list[str], dict]:
    """A command line that gives ``flag`` a valid non-default value, and the fields of
    its section that line should change."""
    if flag.field in SPECIAL_VALUES:
        return SPECIAL_VALUES[flag.field]
    if flag.kind is bool:
        return ([flag.option] if not flag.default else [f"--no-{flag.option[2:]}"],
                {flag.field: not flag.default})
    if flag.kind in (int, float):
        value = flag.kind((flag.default or 0) + 3)
        if flag.field.startswith(("dropout", "embed_dropout", "weight_drop")):
            value = 0.5
        return [flag.option, str(value)], {flag.field: value}
    assert flag.kind is str, flag
    return [flag.option, "x"], {flag.field: "x"}


def test_every_config_field_is_a_flag_that_sets_that_field_alone():
    """The flags are made from the Config's fields: every field has one (the three
    synthetic-corpus sizes share --synthetic-sentences), with the field's help, and
    giving it a value changes that field and nothing else in the whole Config."""
    import dataclasses

    from tfpar.tools import cli

    parser = cli.train_parser()
    helps = {a.dest: a.help for a in parser._actions}
    default = cli.config_from_args(parser.parse_args([]))
    for section, cls in cli.SECTIONS.items():
        flags = {f.field: f for f in cli.config_flags(section)}
        shared = set(cli.SYNTHETIC) if section == "data" else set()
        assert set(flags) | shared == {f.name for f in dataclasses.fields(cls)}, section
        for field, flag in flags.items():
            assert helps[flag.dest].startswith(flag.metadata["help"]), field
            argv, changed = flag_and_value(flag)
            config = cli.config_from_args(parser.parse_args(argv))
            want = default.replace(**{section: changed})
            assert config == want, (argv, getattr(config, section), getattr(want, section))
    config = cli.config_from_args(parser.parse_args(["--synthetic-sentences", "7,8,9"]))
    assert config == default.replace(data=dict(synthetic_train=7, synthetic_valid=8,
                                               synthetic_test=9))
