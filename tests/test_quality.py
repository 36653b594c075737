"""Quality on a real corpus: one short epoch of PTB in each mode, valid perplexity bounded.

Every other test checks tfpar against itself or against tiny corpora; a change that alters
what the model learns from (the input pipeline, the loss, the step, the optimizer) passes
them all. These runs train the defaults (`scripts/train.py --strategy mirrored`) for one
epoch on the first ``TRAIN_LINES`` lines of PTB train and evaluate on all of PTB valid.
Training is deterministic, so a run gives the same digits every time on this code; the
bounds sit a little above the figures of the fixed pipeline (see ``BOUNDS``) and well
below what the stream-mode regression of the streamed pipeline gave (rows of unequal
length: the epoch's last windows trained on a few long rows alone).

Skipped, with the reason, where the shared corpora folder (``../shared/data``) is absent.
"""

import json
import os

import pytest

from conftest import shared_data_dir
from tfpar.tools.cli import train_main

TRAIN_LINES = 10_000
# mode -> (valid perplexities this code gave, the bound). The first figure is
# `scripts/train.py` with these flags (2 logical CPU devices), the second this test
# in the suite (the suite's 4 logical devices and thread settings): the same math, but
# a 300-step run of SGD at lr 20 is still leaving the unigram plateau, where last-bit
# differences grow. The bounds leave room for that, and fail the code before 2026-12-07
# (every weight from the same random numbers, forget bias 1: OLD_INIT); the regressed
# stream pipeline gave STREAM_REGRESSED.
BOUNDS = {"stream": ((426.21, 406.43), 480.0), "sentence": ((373.27, 370.11), 410.0)}
OLD_INIT = {"stream": (445.37, 510.89), "sentence": (437.45, 438.03)}
# Sentence mode without joining the buckets' partial batches (fill_partial_batches) gave
# SENTENCE_UNFILLED.
SENTENCE_UNFILLED = 495.92
STREAM_REGRESSED = 5214.38


def _ptb_lines(tmp_path_factory, name, keep: dict):
    """A corpus folder of PTB's splits, each cut to its first ``keep[split]`` lines
    (None: all)."""
    folder = os.path.join(shared_data_dir(), "ptb")
    if not os.path.isdir(folder):
        pytest.skip(f"the shared corpora folder {folder} is absent (set TFPAR_SHARED_DATA "
                    "to a folder with ptb/)")
    out = tmp_path_factory.mktemp(name)
    for split, n in keep.items():
        with open(os.path.join(folder, f"ptb.{split}.txt"), encoding="utf-8") as f:
            lines = f.readlines()
        (out / f"{split}.txt").write_text("".join(lines[:n]), encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def ptb_subset(tmp_path_factory):
    """A corpus folder: PTB train's first TRAIN_LINES lines, PTB valid, PTB test's first
    500 lines (the final test evaluation is not what is checked here)."""
    return _ptb_lines(tmp_path_factory, "ptb-subset",
                      {"train": TRAIN_LINES, "valid": None, "test": 500})


def quality_args(corpus, mode, model_dir):
    return ["--strategy", "mirrored", "--data", str(corpus), "--mode", mode, "--epochs", "1",
            "--no-export", "--no-progress", "--model-dir", str(model_dir / "run"),
            "--metrics-json", str(model_dir / "metrics.json")]


@pytest.mark.parametrize("mode", ["stream", "sentence"])
def test_one_short_ptb_epoch_reaches_the_known_perplexity(mode, ptb_subset, tmp_path):
    assert train_main(quality_args(ptb_subset, mode, tmp_path)) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    measured, bound = BOUNDS[mode]
    print(f"{mode}: valid ppl {metrics['valid_ppl']:.2f}, {metrics['steps']} steps")
    assert metrics["valid_ppl"] <= bound, (
        f"{mode} mode: valid perplexity {metrics['valid_ppl']:.2f} after one epoch of "
        f"{TRAIN_LINES} PTB lines, above the bound {bound} (this code gave {measured}): "
        "something changed what the model learns")


# Characters: PTB's first CHAR_TRAIN_LINES train lines as characters (--tokenizer char:
# every character a token, a space too, <eos> per line), one epoch of stream mode with
# PyTorch's word_language_model configuration (untied; otherwise tfpar's defaults):
# CHAR_STEPS steps of 20 x 35 characters. A character model first learns the unigram
# (valid perplexity ~CHAR_UNIGRAM), then leaves it. With every weight drawn from one
# seeded initializer and a forget-gate bias of 1 (tfpar before 2026-12-07) this run was
# still on the plateau at its end (CHAR_OLD); the bound sits between the two.
CHAR_TRAIN_LINES = 2_000
CHAR_STEPS = 343
CHAR_MEASURED = (6.62, 6.87)  # (scripts/train.py on 2 devices, this test in the suite)
CHAR_OLD = 21.23
CHAR_UNIGRAM = 20.18
CHAR_BOUND = 9.0


@pytest.fixture(scope="module")
def ptb_char_subset(tmp_path_factory):
    """PTB train's first CHAR_TRAIN_LINES lines, valid's first 400, test's first 50."""
    return _ptb_lines(tmp_path_factory, "ptb-chars", {"train": CHAR_TRAIN_LINES,
                                                     "valid": 400, "test": 50})


def test_a_short_ptb_character_run_leaves_the_unigram_plateau(ptb_char_subset, tmp_path):
    argv = quality_args(ptb_char_subset, "stream", tmp_path) + [
        "--tokenizer", "char", "--no-tie-embeddings"]
    assert train_main(argv) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    print(f"characters: valid ppl {metrics['valid_ppl']:.3f} (unigram "
          f"{metrics.get('unigram_valid_ppl')}), {metrics['steps']} steps")
    assert metrics["steps"] == CHAR_STEPS
    assert metrics["valid_ppl"] <= CHAR_BOUND, (
        f"characters: valid perplexity {metrics['valid_ppl']:.3f} after {CHAR_STEPS} steps "
        f"of PTB characters, above the bound {CHAR_BOUND} (this code gave {CHAR_MEASURED}; "
        f"the unigram is {CHAR_UNIGRAM}, identical initial weights with a forget bias of 1 "
        f"gave {CHAR_OLD}): something slows what the model learns")
