"""The commands' argument parser: every error one line, a mistyped flag answered with the
closest one.

argparse prints the whole usage (45 lines for ``tfpar-train``) before the line that
matters, and says nothing of what was meant. Here an error is::

    tfpar-train: error: unrecognized argument --epoch; did you mean --epochs? (see --help)

the suggestion computed from the command's own flags, and the exit status argparse's (2).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import NoReturn, Sequence

from tfpar import compat
from tfpar.errors import ConfigError


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line (see the module docstring).
    Abbreviations are off: ``--epoch`` is a mistake to point out, not ``--epochs``.

    ``raising``: an error raises :class:`~tfpar.errors.ConfigError` with its one line
    instead of exiting with status 2 (the Python API, ``tfpar.api``)."""

    def __init__(self, *args, raising: bool = False, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.raising = raising

    def parse_args(self, args: Sequence[str] | None = None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        # An unknown flag first: argparse would report a missing required flag before
        # it, though the unknown one is often the required one mistyped.
        known = self._option_strings()
        unknown = [a for a in args[:args.index("--") if "--" in args else len(args)]
                   if a.startswith("--") and len(a) > 2 and not any(c.isspace() for c in a)
                   and a.split("=", 1)[0] not in known]  # "--x 1" is a value (argparse too)
        if unknown:
            self.error(self.unrecognized(unknown))
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            self.error(self.unrecognized(extra))
        return parsed

    def _option_strings(self) -> set[str]:
        """Every flag of this parser and of its sub-commands' parsers."""
        known = set()
        for action in compat.parser_actions(self):
            known.update(action.option_strings)
            if compat.is_subcommands(action):
                for sub in action.choices.values():
                    known.update(sub._option_strings() if isinstance(sub, Parser) else
                                 {o for a in compat.parser_actions(sub) for o in a.option_strings})
        return known

    def unrecognized(self, extra: Sequence[str]) -> str:
        """The message for arguments no flag took: the first one, and the flag closest
        to it when there is one."""
        flags = [a for a in extra if a.startswith("-")]
        first = (flags or list(extra))[0]
        name = first.split("=", 1)[0]
        if not name.startswith("-"):
            return f"unrecognized argument {first!r}"
        message = f"unrecognized argument {name}"
        options = sorted(o for o in self._option_strings() if o.startswith("--"))
        close = difflib.get_close_matches(name, options, n=1, cutoff=0.75)
        return message + (f"; did you mean {close[0]}?" if close else "")

    def error(self, message: str) -> NoReturn:
        if self.raising:  # e.g. "argument --max-steps: invalid int value: 'x'"
            raise ConfigError(message)
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            sys.stderr.write(message)
        raise SystemExit(status)
