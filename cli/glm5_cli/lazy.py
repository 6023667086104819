"""The `glm5` parser's two helpers: sub-commands whose flags are declared only when that sub-command is used, and
help that shows every flag's default.

Declaring `glm5 worker`'s flags imports the worker (torch), the router's imports aiohttp and redis: 1.8 s before
`glm5 --help` printed a line, and as long again before `glm5 chat` said nothing answers. A `LazyParser` runs its
`declare` function the first time it parses or formats help, so `glm5 --help` imports no service at all and each
sub-command imports only its own (tests/unit/test_cli_help.py holds both)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

Declare = Callable[[argparse.ArgumentParser], None]


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """argparse's ArgumentDefaultsHelpFormatter (`(default: X)` after each flag's help) that keeps the line
    breaks of descriptions and says nothing where there is no default to show (None, False, empty) or the help
    already names it (BooleanOptionalAction adds its own)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "%(default)" in text or default is None or default is False or default is argparse.SUPPRESS:
            return text
        if isinstance(default, list | tuple | dict | set) and not default:
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text + " (default: %(default)s)"
        return text


class LazyParser(argparse.ArgumentParser):
    """A sub-command's parser whose flags are added by `declare` when it is first used: parsed, or asked for
    its help or usage."""

    def __init__(self, *args: Any, declare: Declare | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self._declare = declare

    def declare(self) -> LazyParser:
        """Add the flags now (once); returns the parser."""
        if self._declare is not None:
            declare, self._declare = self._declare, None
            declare(self)
        return self

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self.declare()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self.declare()
        return super().format_help()

    def format_usage(self) -> str:
        self.declare()
        return super().format_usage()
