"""--preset: named configurations, overridden by the flags given, saved resolved."""

import json

import pytest

from tfpar.tools import presets
from tfpar.tools.cli import config_from_args, train_main, train_parser


def resolved(argv):
    parser = train_parser()
    args = parser.parse_args(argv)
    presets.apply_preset(args, parser, argv)
    return config_from_args(args)


def test_ptb_small_is_ptb_word_lm_small_in_tfpars_loss_units():
    c = resolved(["--preset", "ptb-small"])
    assert (c.data.source, c.data.mode, c.data.bptt, c.train.batch_size) == ("ptb", "stream",
                                                                            20, 20)
    assert (c.model.cell, c.model.layers, c.model.embed_dim, c.model.hidden_dim,
            c.model.dropout, c.model.init_scale) == ("lstm", 2, 200, 200, 0.0, 0.1)
    # BasicLSTMCell(size, forget_bias=0.0), whatever tfpar's default.
    assert c.model.forget_bias == 0.0
    # ptb_word_lm.py sums the loss over the window's 20 steps: its lr 1.0 and clip 5 are
    # lr 20 and clip 0.25 on tfpar's per-token mean.
    assert (c.train.optimizer, c.train.lr, c.train.clip_norm) == ("sgd", 20.0, 0.25)
    assert (c.train.lr_decay, c.train.decay_after, c.train.epochs) == (0.5, 4, 13)


@pytest.mark.parametrize("name,hidden,bptt,dropout,epochs", [
    ("ptb-medium", 650, 35, 0.5, 39), ("ptb-large", 1500, 35, 0.65, 55)])
def test_medium_and_large(name, hidden, bptt, dropout, epochs):
    c = resolved(["--preset", name])
    assert (c.model.hidden_dim, c.data.bptt, c.model.dropout, c.train.epochs) == \
        (hidden, bptt, dropout, epochs)
    assert c.train.lr == float(bptt)


def test_awd_hour_regularises_like_awd_lstm():
    c = resolved(["--preset", "awd-hour"])
    m = c.model
    assert [m.dropout_at(s) for s in ("input", "hidden", "output")] == [0.4, 0.25, 0.4]
    assert (m.locked_dropout, m.embed_dropout, m.weight_drop, m.tie_embeddings) == \
        (True, 0.1, 0.3, True)
    assert (c.train.lr, c.train.clip_norm, c.train.weight_decay, c.train.time_limit) == \
        (30.0, 0.25, 1.2e-6, 58.0)


def test_flags_given_override_the_preset_in_either_spelling():
    c = resolved(["--epochs", "2", "--preset", "ptb-small", "--lr=3", "--data", "synthetic"])
    assert (c.train.epochs, c.train.lr, c.data.source) == (2, 3.0, "synthetic")
    assert c.model.hidden_dim == 200  # the rest from the preset


def test_without_a_preset_the_defaults_stay():
    assert resolved([]) == config_from_args(train_parser().parse_args([]))


def test_an_unknown_preset_is_one_line(capsys):
    assert train_main(["--preset", "ptb-huge"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: unknown --preset 'ptb-huge'; expected one of: ptb-small, "
                   "ptb-medium, ptb-large, awd-hour")


def test_the_resolved_configuration_is_logged_and_saved(tiny_corpus_dir, tmp_path, capsys):
    assert train_main(["--preset", "ptb-small", "--data", str(tiny_corpus_dir), "--bptt", "8",
                       "--embed-dim", "16", "--hidden-dim", "16", "--max-steps", "2",
                       "--no-progress", "--no-export", "--model-dir",
                       str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "preset ptb-small (ptb_word_lm.py small" in err and "--optimizer sgd" in err
    # A boolean is the flag alone (ptb-small unties the embeddings).
    assert " --no-tie-embeddings " in err and "--no-tie-embeddings False" not in err
    assert "--bptt" not in err.split("preset ptb-small")[1].split("\n")[0]  # given: not taken
    stored = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (stored["train"]["optimizer"], stored["train"]["lr"], stored["data"]["bptt"],
            stored["model"]["hidden_dim"], stored["model"]["layers"]) == ("sgd", 20.0, 8, 16, 2)


def test_abbreviated_flags_are_refused_so_a_preset_cannot_override_them(capsys):
    """``--epoch 3`` once passed as ``--epochs 3`` for argparse, but the preset merge looks
    for the flags by their full names, so the preset's 13 epochs won: refused instead."""
    from tfpar.tools.cli import train_main

    with pytest.raises(SystemExit) as exit_:
        train_main(["--preset", "ptb-small", "--epoch", "3", "--hidden", "300"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("tfpar-train: error: unrecognized argument --epoch; "
                                       "did you mean --epochs? (see --help)\n")
