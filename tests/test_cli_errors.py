"""Every installed command answers a mistyped flag in one line, naming the flag meant
(tfpar.tools.parsing), and no usage dump."""

import importlib

import pytest

from tfpar.tools.commands import COMMANDS, run


def long_flags(module: str) -> list[str]:
    parser = importlib.import_module(module).parser()
    return [o for a in parser._actions for o in a.option_strings
            if o.startswith("--") and len(o) > 6 and o != "--help"]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_mistyped_flag_is_one_line_naming_the_flag_meant(command, capsys):
    module = COMMANDS[command]
    flag = long_flags(module)[-1]
    typo = flag[:-1]  # "--epochs" -> "--epoch"
    if typo in long_flags(module):
        typo = flag + "x"
    with pytest.raises(SystemExit) as exit_:
        run(module, [typo, "3"], prog=command)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == (f"{command}: error: unrecognized argument {typo}; did you mean {flag}? "
                   "(see --help)\n")


def test_train_names_epochs_for_epoch_and_reports_it_before_a_missing_flag(capsys):
    with pytest.raises(SystemExit):
        run(COMMANDS["tfpar-train"], ["--preset", "ptb-small", "--epoch", "3"],
            prog="tfpar-train")
    assert capsys.readouterr().err == ("tfpar-train: error: unrecognized argument --epoch; "
                                       "did you mean --epochs? (see --help)\n")
    with pytest.raises(SystemExit):  # --model or --model-dir is required: the typo first
        run(COMMANDS["tfpar-generate"], ["--model-dri", "runs/x"], prog="tfpar-generate")
    assert capsys.readouterr().err == ("tfpar-generate: error: unrecognized argument "
                                       "--model-dri; did you mean --model-dir? (see --help)\n")


def test_other_usage_errors_are_one_line_too(capsys):
    with pytest.raises(SystemExit) as exit_:
        run(COMMANDS["tfpar-train"], ["--max-steps", "x"], prog="tfpar-train")
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("tfpar-train: error: argument --max-steps: invalid "
                                       "int value: 'x' (see --help)\n")
    with pytest.raises(SystemExit):
        run(COMMANDS["tfpar-evaluate"], ["stray"], prog="tfpar-evaluate")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage:" not in err, err


def test_a_value_that_starts_with_dashes_and_holds_a_space_is_a_value():
    """argparse takes "--forget-bias 1" (one argument) as a value, not as a flag."""
    from tfpar.tools.parsing import Parser

    p = Parser(prog="x")
    p.add_argument("--extra", default="")
    assert p.parse_args(["--extra", "--forget-bias 1"]).extra == "--forget-bias 1"
