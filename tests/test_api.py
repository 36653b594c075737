"""The Python API (tfpar.make_config, tfpar.train): the command's defaults, its errors, and a
run in a fresh interpreter, as in a notebook."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

import tfpar
from conftest import REPO
from tfpar.errors import ConfigError
from tfpar.tools.cli import config_from_args, train_parser


def cli_config(argv):
    return config_from_args(train_parser().parse_args(argv))


def test_the_api_defaults_are_the_commands():
    assert tfpar.make_config() == cli_config([])


def test_settings_are_the_flags_as_keywords():
    assert tfpar.make_config(
        max_steps=5, tie_embeddings=False, no_export=True, synthetic_sentences=(200, 20, 20),
        dropout_input=None, verbose=False, lr=0.5, strategy="mirrored",
    ) == cli_config(["--max-steps", "5", "--no-tie-embeddings", "--no-export",
                     "--synthetic-sentences", "200,20,20", "--lr", "0.5", "--strategy",
                     "mirrored"])
    # A preset as --preset: the settings given override it.
    preset = tfpar.make_config(preset="ptb-small", epochs=2)
    assert (preset.train.epochs, preset.data.bptt, preset.train.lr) == (2, 20, 20.0)


@pytest.mark.parametrize("settings, message", [
    (dict(max_step=5), "unknown setting 'max_step' (did you mean 'max_steps'?); settings are "
                       "tfpar-train's flags as keywords (--max-steps 100: max_steps=100; "
                       "tfpar-train --help lists them)"),
    (dict(max_steps="x"), "argument --max-steps: invalid int value: 'x'"),
    (dict(no_export=1), "no_export=1 must be True or False"),
    (dict(tie_embeddings="no"), "tie_embeddings='no' must be True or False"),
    (dict(batch_size=0), "batch-size must be > 0, got 0"),
])
def test_bad_settings_are_one_line_errors(settings, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message) + "$"):
        tfpar.make_config(**settings)


def test_a_config_and_settings_together_are_refused():
    with pytest.raises(ConfigError, match=r"^give train\(\) a Config or settings, not both "
                                          r"\(got a Config and max_steps\)$"):
        tfpar.train(tfpar.make_config(), max_steps=3)


def test_import_tfpar_imports_no_tensorflow():
    code = "import sys, tfpar; tfpar.Config; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.strip() == "False"


def test_train_in_a_fresh_interpreter_returns_the_metrics(tmp_path):
    """As in a notebook: no flags, no console filter; mirrored over 2 logical CPU devices
    made by train(); then a run that needs 4 once TensorFlow runs with 2 is refused."""
    # PINNED's model and optimizer (conftest), as keywords.
    settings = dict(layers=1, optimizer="adam", lr=3e-3, clip_norm=5, dropout=0,
                    tie_embeddings=False, init_scale=0,
                    strategy="mirrored", cpu_devices=2, synthetic_sentences="300,30,30",
                    embed_dim=8, hidden_dim=8, batch_size=8, max_steps=3, no_progress=True,
                    no_export=True, model_dir=str(tmp_path / "run"),
                    metrics_json=str(tmp_path / "m.json"))
    code = textwrap.dedent(f"""
        import json, tfpar
        settings = {settings!r}
        metrics = tfpar.train(tfpar.make_config(**settings))
        print("METRICS " + json.dumps(metrics))
        try:
            tfpar.train(**dict(settings, cpu_devices=4, model_dir=settings["model_dir"] + "2"))
        except tfpar.errors.DeviceError as e:
            print("REFUSED " + str(e))
    """)
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "I tfpar.training.run: strategy mirrored" in proc.stderr  # the log shows
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines()
                 if line.startswith(("METRICS ", "REFUSED ")))
    metrics = json.loads(lines["METRICS"])
    assert metrics == json.loads((tmp_path / "m.json").read_text())
    assert (metrics["strategy"], metrics["replicas"], metrics["steps"]) == ("mirrored", 2, 3)
    assert 1 < metrics["valid_ppl"] < 1e4 and 1 < metrics["test_ppl"] < 1e4
    assert lines["REFUSED"] == (
        "4 logical CPU devices were asked for, but TensorFlow was already initialised with 2; "
        "restart the Python process (a notebook's kernel) and call tfpar.train before anything "
        "else runs on TensorFlow")
