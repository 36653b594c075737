"""scripts/quality_matrix.py: both tools get the same token streams, and its table."""

import pytest

from conftest import load_script

matrix = load_script("quality_matrix")


@pytest.fixture
def data_dir(tmp_path):
    for folder, pattern in (("ptb", "ptb.{}.txt"), ("wikitext-2", "wiki.{}.tokens")):
        (tmp_path / folder).mkdir()
        for split in ("train", "valid", "test"):
            (tmp_path / folder / pattern.format(split)).write_text(
                " the cat sat \n\n = Heading = \n a  b\n", encoding="utf-8")
    return tmp_path


def test_corpora_are_stripped_lines_without_blanks_and_characters_are_tokens(data_dir,
                                                                               tmp_path):
    words = matrix.write_corpus(data_dir, "wt2-words", tmp_path / "out")
    assert (words / "valid.txt").read_text() == "the cat sat\n= Heading =\na  b\n"
    chars = matrix.write_corpus(data_dir, "ptb-chars", tmp_path / "out")
    assert (chars / "train.txt").read_text().splitlines() == [
        "t h e _ c a t _ s a t", "= _ H e a d i n g _ =", "a _ _ b"]


def test_the_table_averages_seeds_and_gives_bits_per_character():
    results = [dict(row="ptb-chars", tool="tfpar", seed=s, valid_ppl=v, test_ppl=v,
                    seconds=10.0) for s, v in ((0, 4.0), (1, 2.0))]
    line = matrix.table(results).splitlines()[-1]
    assert line == "| ptb-chars | tfpar | 0,1 | 3.00 | 2.00 | 3.00 | 1.585 | 10 |"


@pytest.mark.parametrize("extra, message", [
    (["--rows", "ptb-nope"], "unknown row 'ptb-nope'; rows: ptb-words, "),
    (["--torch-example", "/nonexistent"], "--torch-example /nonexistent holds no main.py"),
])
def test_bad_arguments_are_one_line(extra, message, data_dir, capsys):
    with pytest.raises(SystemExit) as exit_:
        matrix.main(["--data", str(data_dir), "--torch-python", "python",
                     "--torch-example", str(data_dir)] + extra)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_the_peers_perplexities_are_read_from_its_own_lines():
    out = ("| end of epoch   1 | time: 271.86s | valid loss  5.38 | valid ppl   216.50\n"
           "| End of training | test loss  5.37 | test ppl   214.10\n")
    assert matrix.TORCH_VALID.search(out).group(1) == "216.50"
    assert matrix.TORCH_TEST.search(out).group(1) == "214.10"


def test_a_tfpar_run_trains_anew_in_a_work_dir_an_earlier_run_left(tmp_path, monkeypatch):
    """A model dir left there would be resumed at its end and only evaluated: a re-measured
    row would repeat the old code's figures."""
    import json

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "metrics.json").write_text('{"valid_ppl": 1, "test_ppl": 1}')
    seen = {}

    def fake_run(argv, **kw):
        seen["stale"] = (tmp_path / "run").exists() or (tmp_path / "metrics.json").exists()
        seen["ema"] = argv[argv.index("--ema-momentum") + 1]
        (tmp_path / "metrics.json").write_text(json.dumps({"valid_ppl": 7, "test_ppl": 8}))

    monkeypatch.setattr(matrix.subprocess, "run", fake_run)
    got = matrix.run_tfpar(tmp_path / "corpus", matrix.ROWS["ptb-words"], 0, tmp_path, [])
    assert (got["valid_ppl"], got["test_ppl"]) == (7, 8)
    assert seen == {"stale": False, "ema": "0"}  # (the last weights, as the peer reports)
