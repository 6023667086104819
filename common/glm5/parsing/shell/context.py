"""The state a judged command line carries from one command to the next, and the refusal."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tree_sitter import Node

from glm5.parsing.shell.words import HOME, UNKNOWN

MAX_DEPTH = 4  # `sh -c "sh -c ..."`, code passed to interpreters, files run after being written: nesting judged
MAX_VALUES = 16  # values one variable may hold before it counts as computed


class Refused(Exception):
    """The command does something the policy forbids; the message says what."""


@dataclass(slots=True)
class Written:
    """A file the command line writes before it may run it."""

    content: str | None  # known text (echo, printf, a heredoc), None when another program makes it
    downloaded: bool = False


@dataclass(slots=True)
class Facts:
    """What the whole command line does, across its parts; some refusals need two of them (credentials read and
    a network tool; a fifo and a network tool), judged once every part has been seen."""

    written: dict[str, list[Written]] = field(default_factory=dict)  # by file name
    credentials: list[str] = field(default_factory=list)
    network: list[str] = field(default_factory=list)
    relays: list[str] = field(default_factory=list)  # raw socket tools: nc, telnet, openssl s_client, socat
    fifos: list[str] = field(default_factory=list)

    def write(self, name: str, content: str | None, downloaded: bool = False) -> None:
        self.written.setdefault(name, []).append(Written(content, downloaded))


@dataclass(slots=True)
class Stdin:
    """Where a command's standard input comes from."""

    piped: bool = False  # another command's output
    printed: list[str] | None = None  # what that command prints, when known (`find DIR` prints DIR/**)
    code: list[str | None] = field(default_factory=list)  # heredocs and here-strings (None: computed)
    file: str | None = None  # `< FILE`
    descriptor: bool = False  # stdin or stdout duplicated from a descriptor (`<&3`, `>&3`): a socket, perhaps

    @property
    def feeds(self) -> bool:
        return self.piped or bool(self.code) or self.file is not None or self.descriptor


class Judge(Protocol):
    """The checks other modules call back into (judge.py)."""

    def script(self, code: str, ctx: Context) -> None: ...

    def argv(self, words: list[str], ctx: Context, stdin: Stdin) -> None: ...

    def printed(self, node: Node, ctx: Context) -> list[str] | None: ...


@dataclass(slots=True)
class Context:
    judge: Judge
    facts: Facts = field(default_factory=Facts)
    depth: int = 0
    cwd: str | None = None  # None: the directory it starts in (the project); a word after a `cd`
    variables: dict[str, list[str]] = field(default_factory=dict)

    def nested(self) -> Context:
        """For code run by a command of this one: one level deeper, same facts, a copy of the variables."""
        if self.depth >= MAX_DEPTH:
            raise Refused("commands nested too deeply to judge")
        return Context(self.judge, self.facts, self.depth + 1, self.cwd, dict(self.variables))

    def variable(self, name: str) -> list[str] | None:
        if name in self.variables:
            return self.variables[name]
        if name == "HOME":
            return [HOME]
        if name == "PWD":
            return [self.cwd or "."]
        if name == "TMPDIR":
            return ["/tmp"]
        if name == "HISTFILE":
            return [HOME + "/.bash_history"]
        return None

    def substitution(self, node: Node) -> list[str] | None:
        return self.judge.printed(node, self)

    def assign(self, name: str, values: list[str]) -> None:
        """Every value a variable is given anywhere counts: the policy does not follow which branch runs."""
        held = self.variables.get(name, [])
        merged = list(dict.fromkeys([*held, *values]))
        self.variables[name] = merged if len(merged) <= MAX_VALUES else [UNKNOWN]
