"""Sentence ends learned as the data has them, in both modes.

The generated corpus draws each sentence's length from a known distribution
(``SyntheticSource.length_probs``, mean ~22.8 words), so two figures of a trained model can
be checked against the truth:

* the expected number of ``<eos>`` over a true sentence, the sum of the model's
  P(``<eos>``) at every position of it (its last included): 1 for a calibrated model, as
  for the source (its hazard summed over a sentence has expectation 1);
* the mean length of sentences it generates from a sentence start, against the source's
  mean length.

The quick start's model (sentence mode, valid 77.15) gave 0.11 and 72 words: the buckets'
leftovers ended each epoch shortest bucket first, so its last updates were ever longer
sentences, and the last weights of lr-20 SGD follow its last batches (the expected count
swung 0.4-0.95 between checkpoints 10 steps apart). The epoch's leftovers are now mixed
(``tfpar.data.pipeline.fill_partial_batches``) and the run keeps the moving average of its
weights (``--ema-momentum``); tfpar/docs/quality.md, Sentence ends, has the measurements.

The test trains the quick start on one device (RUN_SENTENCES: its 20,000 train sentences,
1,001 steps; smaller valid and test splits). A shorter run does not show it: after 300
steps (6,000 sentences) the model is still near the unigram (valid 266, expected 0.67 in
either mode), and no fix of the sentence ends can be seen on it. With the code before
these fixes the test gave OLD.
"""

import numpy as np
import pytest
import tensorflow as tf

from tfpar.data.synthetic import SyntheticSource, SyntheticSpec, generate_corpus
from tfpar.data.vocab import EOS_ID
from tfpar.tools.cli import train_main
from tfpar.tools.model_dir import restored_model

RUN_SENTENCES = "20000,500,500"
GENERATED = 600  # sentences generated per run
# mode -> (expected <eos> per sentence, generated length / source mean) this code gave,
# and the code before 2026-12-07's fixes (sentence: leftovers longest last, last weights).
MEASURED = {"sentence": (0.889, 1.110), "stream": (0.977, 0.986)}
OLD = {"sentence": (0.102, 3.172), "stream": (0.854, 1.193)}
EOS_RANGE = (0.75, 1.25)
LENGTH_RANGE = (0.85, 1.15)  # the "within 15% of the corpus's mean length"


def source_mean_length() -> float:
    probs = SyntheticSource(SyntheticSpec()).length_probs
    return float((np.arange(len(probs)) * probs).sum())


def sentence_end_figures(run_dir) -> tuple[float, float]:
    """(expected <eos> over the valid split's true sentences, mean generated length)."""
    from tfpar.serving import sample

    model, vocab, _ = restored_model(str(run_dir), "latest")
    valid = generate_corpus(SyntheticSpec()).valid[:500]
    ids = sample.word_ids(tf.constant(valid), vocab.lookup_table(), tokenizer="whitespace")
    eos = tf.RaggedTensor.from_tensor(tf.fill([ids.nrows(), 1], EOS_ID))
    full = tf.concat([eos, ids, eos], axis=1)
    inputs, targets = full[:, :-1].to_tensor(), full[:, 1:].to_tensor()
    logits, _ = model(inputs)
    p_eos = tf.nn.softmax(logits)[:, :, EOS_ID] * tf.cast(targets != 0, tf.float32)
    expected = float(tf.reduce_sum(p_eos)) / len(valid)
    out = sample.generate_ids(model, tf.fill([GENERATED, 1], EOS_ID),
                              tf.ones([GENERATED], tf.int32), max_tokens=tf.constant(300),
                              temperature=tf.constant(1.0), top_k=tf.constant(0),
                              seed=tf.constant(1)).numpy()
    lengths = [np.argmax(row == EOS_ID) if (row == EOS_ID).any() else len(row) for row in out]
    return expected, float(np.mean(lengths))


@pytest.mark.parametrize("mode", ["sentence", "stream"])
def test_the_model_ends_sentences_as_the_corpus_does(mode, tmp_path):
    assert train_main(["--synthetic-sentences", RUN_SENTENCES, "--mode", mode,
                       "--no-export", "--no-progress", "--no-epoch-inspection",
                       "--model-dir", str(tmp_path / "run")]) == 0
    expected, length = sentence_end_figures(tmp_path / "run")
    ratio = length / source_mean_length()
    print(f"{mode}: expected <eos> per sentence {expected:.3f}, generated length "
          f"{length:.2f} ({ratio:.3f} of the source's {source_mean_length():.2f})")
    assert EOS_RANGE[0] <= expected <= EOS_RANGE[1], (
        f"{mode}: the model expects {expected:.3f} <eos> per true sentence, not ~1")
    assert LENGTH_RANGE[0] <= ratio <= LENGTH_RANGE[1], (
        f"{mode}: generated sentences average {length:.1f} words, the corpus "
        f"{source_mean_length():.1f}")
