"""Throughput benchmark: tfpar against plain Keras and against this CPU's matmul limit,
input stalls, padding, distribution cost, bf16, steps per call, and a scaling model.

``scripts/benchmark.py`` (or ``python -m tfpar.tools.bench``) measures, in one process
and on one corpus (PTB when it is there, else the generated corpus):

* training tokens/s of tfpar's real training step (plug-in, model, optimizer,
  ``step.make_train_step(plugin, ...)`` on the input pipeline's batches) against a
  plain-Keras baseline: the same architecture as a ``keras.Sequential`` trained with
  ``model.fit`` on fixed windows;
* the input pipeline's share of the step time: the same step fed from tf.data and from
  batches already in memory;
* the share of pad tokens in sentence mode: tfpar's bucketing against a plain
  ``padded_batch`` of the same shuffled sentences;
* the cost of distribution: mirrored with one replica against no strategy, and mirrored,
  tower and pipeline on two logical devices;
* bf16 against fp32, and ``--steps-per-execution 10`` against 1 (with the host overhead
  per step, measured on a tiny-model probe of the same call path);
* the roofline: this host's matmul rate for each of the step's shapes, every contender's
  fraction of that limit, and the step split into its softmax and RNN parts;
* the scaling model's tables for GPUs and workers, checked (``--loopback-workers``)
  against multi_worker processes on loopback;
* with ``--sampled-softmax`` instead: the sampled softmax on a 793,471-word vocabulary
  against the full softmax on 10k words (``sampled``).

The host is shared and its load varies, so every contender is timed in short segments
and the segments are interleaved round-robin (the order rotates every round); each
figure is the median over rounds, and ratios compare segments that ran side by side.

A contender that crashes (while it is built, warmed up or timed) does not go unnoticed:
the run still measures the others and prints its report, then names the contender on
stderr (``error: contender <name> failed: <reason>``) and exits 1.

Modules, one job each (each imports only the ones above it)::

    spec         BenchSpec, quick_spec/tiny_spec, the targets and check_targets
    workload     the corpus, vocabulary and input data; the model configuration
    roofline     the step's matmuls and FLOPs, this host's rate for each, the limit
    scaling      the scaling model: step time on N GPUs or workers, ring all-reduce
    contenders   Segment, Contender, the tfpar and Keras contenders and their builders
    breakdown    the step's softmax and RNN parts timed alone, against their limit
    remote       the child process hosting the two-device contenders (--serve)
    workers      the loopback multi_worker job the scaling model is checked with
    sampled      --sampled-softmax: Zipf corpora, the 793k sampled and 10k full contenders
    measure      interleaved rounds, paired steps and segments, padding; run()
    report       the printed report, the JSON file, the PNG chart
    cli          the flags and main() (scripts/benchmark.py, python -m tfpar.tools.bench)
"""
