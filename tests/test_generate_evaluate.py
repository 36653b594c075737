"""scripts/generate.py and scripts/evaluate.py, run in-process through main(argv)."""

import json
import os
import shutil

import numpy as np
import pytest
from conftest import PINNED, load_script



generate = load_script("generate")
evaluate = load_script("evaluate")
train = load_script("train")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A short training run with an export: {"corpus", "model_dir", "export", "metrics"}."""
    tmp = tmp_path_factory.mktemp("run")
    corpus = tmp / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(1)
    words = [f"w{i}" for i in range(30)]
    for split, n in (("train", 200), ("valid", 30), ("test", 30)):
        lines = [" ".join(rng.choice(words, size=int(rng.integers(1, 15)))) for _ in range(n)]
        (corpus / f"{split}.txt").write_text("\n".join(lines) + "\n")
    argv = ["--data", str(corpus), *PINNED, "--embed-dim", "16", "--hidden-dim", "16",
            "--batch-size", "16", "--epochs", "1", "--max-steps", "5", "--no-progress",
            "--model-dir", str(tmp / "run"), "--export-dir", str(tmp / "export"),
            "--metrics-json", str(tmp / "metrics.json")]
    assert train.main(argv) == 0
    return {"corpus": str(corpus), "model_dir": str(tmp / "run"),
            "export": json.loads((tmp / "metrics.json").read_text())["export_path"],
            "metrics": json.loads((tmp / "metrics.json").read_text())}


def out_and_code(main, argv, capsys):
    """(exit code, stdout, stderr's last line); log lines may come before an error."""
    code = main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    lines = captured.err.strip().splitlines()
    return code, captured.out, lines[-1] if lines else ""


def ok_out(main, argv, capsys):
    """stdout of a call that must succeed: exit 0 and some output, so that comparing the
    outputs of several calls cannot pass on calls that all failed alike (exit 2, no output)."""
    code, out, err = out_and_code(main, argv, capsys)
    assert code == 0, (code, err)
    assert out.strip(), f"exit 0 but no output; stderr ends {err!r}"
    return out


# ----------------------------------------------------------------------------- generate
def test_generate_prints_one_seeded_continuation_per_prompt(run, capsys):
    argv = ["--model", run["export"], "--prompt", "w1 w2", "--prompt", "", "--max-tokens",
            "7", "--top-k", "5", "--seed", "11", "--stop-at-eos"]
    code, out, _ = out_and_code(generate.main, argv, capsys)
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("[w1 w2] ") and lines[1].startswith("[] ")
    assert all(len(line.split("] ", 1)[1].split()) <= 7 for line in lines)
    assert ok_out(generate.main, argv, capsys) == out
    # The name dir resolves to its highest version: a copy as version 2 says the same.
    name_dir = os.path.dirname(run["export"])
    shutil.copytree(run["export"], os.path.join(name_dir, "2"), dirs_exist_ok=True)
    assert ok_out(generate.main, ["--model", name_dir] + argv[2:], capsys) == out


def test_generate_goes_on_across_sentence_ends_unless_told_to_stop(run, capsys):
    argv = ["--model", run["export"], "--prompt", "w1 w2", "--max-tokens", "60",
            "--seed", "4"]
    code, out, _ = out_and_code(generate.main, argv, capsys)
    assert code == 0
    lines = out.rstrip("\n").split("\n")
    assert lines[0].startswith("[w1 w2] ") and len(lines) >= 2  # more than one sentence
    # Words after the prompt ("[w1", "w2]"), plus one <eos> per line break.
    tokens = sum(len(line.split()) for line in lines) - 2 + len(lines) - 1
    assert tokens <= 60  # --max-tokens counts tokens, sentence ends included
    code, stopped, _ = out_and_code(generate.main, argv + ["--stop-at-eos"], capsys)
    assert code == 0 and len(stopped.splitlines()) == 1
    assert lines[0] == stopped.rstrip("\n")  # the same first sentence, then it stops


def test_generate_greedy_ignores_the_seed(run, capsys):
    base = ["--model", run["export"], "--prompt", "w3", "--temperature", "0"]
    outs = {ok_out(generate.main, base + ["--seed", s], capsys) for s in "123"}
    assert len(outs) == 1
    assert next(iter(outs)).startswith("[w3] ")
    # The seed is live when sampling, so the sameness above is greedy's doing. (This
    # 5-step model's greedy continuation is all sentence ends, printed "[w3] ".)
    sampled = {ok_out(generate.main, base[:-1] + ["1", "--seed", s], capsys) for s in "12"}
    assert len(sampled) == 2, sampled


@pytest.mark.parametrize("extra,message", [
    (["--model", "/nonexistent/lm"], "error: --model '/nonexistent/lm' does not exist; give "),
    (["--max-tokens", "-1"], "error: --max-tokens must be >= 0, got -1"),
    (["--temperature", "-1"], "error: --temperature must be >= 0, got -1.0"),
    (["--top-k", "-3"], "error: --top-k must be >= 0, got -3"),
    (["--seed", str(2**40)], f"error: --seed must fit in 32 bits, got {2**40}"),
])
def test_generate_errors_are_one_line_with_exit_2(run, capsys, extra, message):
    argv = ["--model", run["export"]] + extra
    code, _, err = out_and_code(generate.main, argv, capsys)
    assert code == 2 and err.startswith(message), err


def test_generate_on_a_folder_without_a_saved_model(tmp_path, capsys):
    code, _, err = out_and_code(generate.main, ["--model", str(tmp_path)], capsys)
    assert code == 2 and err.startswith("error: --model ") and "holds no SavedModel" in err


# ----------------------------------------------------------------------------- evaluate
def test_saved_model_and_model_dir_give_the_training_runs_perplexity(run, capsys):
    metrics = run["metrics"]
    code, out, _ = out_and_code(
        evaluate.main, ["--model", run["export"], "--data", run["corpus"], "--json"], capsys)
    assert code == 0
    served = json.loads(out)
    code, out, _ = out_and_code(evaluate.main, ["--model-dir", run["model_dir"], "--json"],
                                capsys)
    assert code == 0
    rebuilt = json.loads(out)
    assert served["tokens"] == rebuilt["tokens"]
    assert served["perplexity"] == pytest.approx(metrics["valid_ppl"], rel=1e-5)
    assert rebuilt["perplexity"] == pytest.approx(metrics["valid_ppl"], rel=1e-6)
    code, out, _ = out_and_code(
        evaluate.main, ["--model-dir", run["model_dir"], "--split", "test"], capsys)
    assert code == 0
    assert out.startswith("test perplexity ")
    assert float(out.split()[2]) == pytest.approx(metrics["test_ppl"], rel=1e-3)


def test_model_dir_evaluates_distributed_when_asked(run, capsys):
    code, out, _ = out_and_code(
        evaluate.main, ["--model-dir", run["model_dir"], "--strategy", "mirrored",
                        "--cpu-devices", "2", "--batch-size", "5", "--json"], capsys)
    assert code == 0
    result = json.loads(out)
    assert (result["strategy"], result["replicas"]) == ("mirrored", 2)
    assert result["perplexity"] == pytest.approx(run["metrics"]["valid_ppl"], rel=1e-5)


@pytest.mark.parametrize("argv,message", [
    (["--model", "/nonexistent/lm"], "error: --model '/nonexistent/lm' does not exist; give "),
    (["--model-dir", "/nonexistent/run"],
     "error: --model-dir '/nonexistent/run' does not exist; give a training run's model dir"),
    (["--model", "EXPORT", "--strategy", "mirrored"],
     "error: --strategy, --devices and --cpu-devices apply to --model-dir only"),
    (["--model-dir", "RUN", "--strategy", "mirrored", "--cpu-devices", "2", "--batch-size", "1"],
     "error: --batch-size 1 is smaller than the 2 replicas of --strategy mirrored; use >= 2"),
    (["--model-dir", "RUN", "--batch-size", "-4"], "error: --batch-size must be >= 0, got -4"),
    (["--model-dir", "RUN", "--strategy", "bogus"], "error: unknown strategy 'bogus'"),
])
def test_evaluate_errors_are_one_line_with_exit_2(run, capsys, argv, message):
    argv = [{"EXPORT": run["export"], "RUN": run["model_dir"]}.get(a, a) for a in argv]
    code, _, err = out_and_code(evaluate.main, argv, capsys)
    assert code == 2 and err.startswith(message), err


def test_evaluate_needs_a_run_with_config_vocab_and_checkpoint(run, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    code, _, err = out_and_code(evaluate.main, ["--model-dir", str(bare)], capsys)
    assert code == 2 and err.endswith("has no config.json; give the model dir of a tfpar "
                                      "training run")
    shutil.copy(os.path.join(run["model_dir"], "config.json"), bare)
    shutil.copy(os.path.join(run["model_dir"], "vocab.txt"), bare)
    code, _, err = out_and_code(evaluate.main, ["--model-dir", str(bare)], capsys)
    assert code == 2 and err.endswith("has no checkpoint in checkpoints/; train it first")


def test_evaluate_requires_exactly_one_model_source(run, capsys):
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main(["--model", run["export"], "--model-dir", run["model_dir"]])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_evaluate_refuses_a_checkpoint_that_does_not_fit_the_config(run, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(run["model_dir"], bad)
    config = json.loads((bad / "config.json").read_text())
    config["model"]["hidden_dim"] = 24
    (bad / "config.json").write_text(json.dumps(config))
    code, _, err = out_and_code(evaluate.main, ["--model-dir", str(bad)], capsys)
    assert code == 2
    assert err.startswith(f"error: checkpoint '{bad}/checkpoints/ckpt-5' does not fit the "
                          "model its config.json describes: ")


# ----------------------------------------------------------------------------- one file, tokenizers
def write_play(path, lines=300, seed=2):
    """A text file of short lines with punctuation, like a play: "Name: word word, word!"."""
    rng = np.random.default_rng(seed)
    names = ["First Citizen", "Menenius", "Marcius", "All"]
    words = ["you", "sir", "we", "are", "the", "good", "poor", "corn", "speak", "no", "more"]
    out = []
    for _ in range(lines):
        said = " ".join(rng.choice(words, size=int(rng.integers(2, 7))))
        out.append(f"{rng.choice(names)}: {said}{rng.choice([',', '!', '.', '?'])}")
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return path


def one_file_run(tmp, tokenizer, *extra):
    """Trains on one file with ``tokenizer``; returns the paths and the metrics."""
    corpus = write_play(tmp / "play.txt")
    argv = ["--data", str(corpus), "--tokenizer", tokenizer, *extra, *PINNED,
            "--embed-dim", "16", "--hidden-dim", "16", "--batch-size", "16", "--epochs", "1",
            "--no-progress", "--model-dir", str(tmp / "run"), "--export-dir",
            str(tmp / "export"), "--metrics-json", str(tmp / "metrics.json")]
    assert train.main(argv) == 0
    metrics = json.loads((tmp / "metrics.json").read_text())
    return {"corpus": str(corpus), "model_dir": str(tmp / "run"),
            "export": metrics["export_path"], "metrics": metrics}


@pytest.fixture(scope="module")
def char_run(tmp_path_factory):
    return one_file_run(tmp_path_factory.mktemp("char"), "char")


@pytest.fixture(scope="module")
def punct_run(tmp_path_factory):
    return one_file_run(tmp_path_factory.mktemp("punct"), "punct",
                        "--split-fractions", "0.8,0.1,0.1")


def test_a_char_model_from_one_file_generates_several_lines(char_run, capsys):
    code, out, _ = out_and_code(generate.main, ["--model", char_run["export"], "--max-tokens",
                                                "300", "--seed", "1"], capsys)
    assert code == 0
    assert out.startswith("[] ")
    assert out.strip().count("\n") >= 2, out


def test_a_reloaded_char_model_reads_and_writes_characters_untold(char_run):
    import tensorflow as tf

    from tfpar.serving import export

    loaded, _ = export.load_saved_model(char_run["export"])
    assert loaded.tokenizer.numpy() == b"char"
    # "ab c": four characters, the space one of them, and the <eos>.
    assert loaded.signatures["score"](text=tf.constant(["ab c"]))["tokens"].numpy() == [5]
    text, = export.generate_text(loaded, ["Me"], max_tokens=120, temperature=1.0, top_k=0,
                                 seed=3)
    assert len(text) == 120  # one character per token, <eos> written as "\n"
    vocab = open(os.path.join(char_run["model_dir"], "vocab.txt"), encoding="utf-8").read()
    assert set(text) - {"\n"} <= set(vocab.split("\n")[3:])
    assert {" ", ":"} <= set(vocab.split("\n")[3:])


def test_a_punct_model_has_punctuation_tokens_and_serves_its_training_perplexity(punct_run,
                                                                                 capsys):
    vocab = open(os.path.join(punct_run["model_dir"], "vocab.txt"), encoding="utf-8")
    tokens = vocab.read().split("\n")
    assert {":", ",", "!", "Citizen", "sir"} <= set(tokens)
    assert not any(t.endswith((":", ",")) and len(t) > 1 for t in tokens)
    config = json.loads(open(os.path.join(punct_run["model_dir"], "config.json")).read())
    assert config["data"]["tokenizer"] == "punct"
    assert config["data"]["split_fractions"] == [0.8, 0.1, 0.1]
    valid_ppl = punct_run["metrics"]["valid_ppl"]
    code, out, _ = out_and_code(
        evaluate.main, ["--model", punct_run["export"], "--data", punct_run["corpus"],
                        "--split-fractions", "0.8,0.1,0.1", "--json"], capsys)
    assert code == 0
    served = json.loads(out)
    # The valid split is lines 240-269 of 300; each line "Name: w … w!" has the name's
    # words, ":", its words, one mark and <eos>.
    lines = open(punct_run["corpus"], encoding="utf-8").read().split("\n")[240:270]
    assert served["tokens"] == sum(len(l.replace(":", " :").split()) + 2 for l in lines)
    assert served["perplexity"] == pytest.approx(valid_ppl, rel=1e-5)
    code, out, _ = out_and_code(evaluate.main, ["--model-dir", punct_run["model_dir"],
                                                "--json"], capsys)
    assert code == 0 and json.loads(out)["perplexity"] == pytest.approx(valid_ppl, rel=1e-6)


# --------------------------------------------------------- generate/evaluate --model-dir
@pytest.fixture(scope="module")
def two_exports(run, tmp_path_factory):
    """One run exported twice: after its first epoch (the best epoch so far: best/ and
    checkpoints/ hold the same step K, export version 1), then resumed for 3 more steps
    and exported with its last weights (checkpoints/ at step K + 3, export version 2)."""
    tmp = tmp_path_factory.mktemp("two-exports")
    base = ["--data", run["corpus"], *PINNED, "--embed-dim", "16", "--hidden-dim", "16",
            "--batch-size", "40", "--no-progress", "--model-dir", str(tmp / "run"),
            "--export-dir", str(tmp / "export"), "--lr", "0.03"]
    assert train.main(base + ["--epochs", "1", "--metrics-json", str(tmp / "1.json")]) == 0
    first = json.loads((tmp / "1.json").read_text())
    steps = first["steps"]
    assert train.main(base + ["--epochs", "2", "--max-steps", str(steps + 3),
                              "--final-weights", "last", "--metrics-json",
                              str(tmp / "2.json")]) == 0
    second = json.loads((tmp / "2.json").read_text())
    assert second["steps"] == steps + 3
    return {"model_dir": str(tmp / "run"), "best": first["export_path"],
            "latest": second["export_path"], "steps": steps, "valid_ppl": first["valid_ppl"]}


def test_generate_from_a_model_dir_is_what_the_export_of_its_weights_generates(
        two_exports, capsys):
    """--weights latest (the default) and best: each the text of the export of the same
    weights, with the same seed and prompts; the two exports' texts differ, so the
    equalities tell the two checkpoints apart."""
    tail = ["--prompt", "w1 w2", "--prompt", "", "--max-tokens", "40", "--seed", "7"]
    texts = {}
    for weights in ("latest", "best"):
        texts[weights] = ok_out(generate.main, ["--model", two_exports[weights]] + tail, capsys)
        extra = ["--weights", weights] if weights == "best" else []
        assert ok_out(generate.main, ["--model-dir", two_exports["model_dir"], *extra] + tail,
                      capsys) == texts[weights], weights
    assert texts["latest"] != texts["best"]


def test_generate_logs_the_checkpoint_it_restored(two_exports, capsys):
    argv = ["--model-dir", two_exports["model_dir"], "--weights", "best", "--max-tokens", "2"]
    assert generate.main(argv) == 0
    err = capsys.readouterr().err
    assert (f"weights: {two_exports['model_dir']}/best/ckpt-{two_exports['steps']} (best)"
            in err), err


def test_evaluate_best_weights_give_the_best_epochs_perplexity(two_exports, capsys):
    code, out, _ = out_and_code(evaluate.main, ["--model-dir", two_exports["model_dir"],
                                                "--weights", "best", "--json"], capsys)
    assert code == 0
    result = json.loads(out)
    assert result["model"] == f"{two_exports['model_dir']}/best/ckpt-{two_exports['steps']}"
    assert result["perplexity"] == pytest.approx(two_exports["valid_ppl"], rel=1e-5)


@pytest.mark.parametrize("main_name", ["generate", "evaluate"])
def test_weights_errors_are_one_line_with_exit_2(run, main_name, capsys):
    main = {"generate": generate.main, "evaluate": evaluate.main}[main_name]
    code, _, err = out_and_code(main, ["--model", run["export"], "--weights", "best"], capsys)
    assert code == 2 and err == ("error: --weights best applies to --model-dir only; a "
                                 "SavedModel (--model) holds the weights it was exported with")
    # The run of 5 steps never ended an epoch: nothing in best/.
    code, _, err = out_and_code(main, ["--model-dir", run["model_dir"], "--weights", "best"],
                                capsys)
    assert code == 2 and err == (f"error: --model-dir {run['model_dir']!r} has no checkpoint "
                                 "in best/ (kept at the first epoch end); use --weights "
                                 "latest, or train a whole epoch")
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", run["export"], "--model-dir", run["model_dir"]])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
