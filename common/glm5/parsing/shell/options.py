"""Command-line options the way getopt reads them: `-rf` is -r and -f, `-ofile` and `-o file` give -o a value,
`--out=x` and `--out x` too, `--` ends the options."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from glm5.parsing.shell.words import COMPUTED


@dataclass(slots=True)
class Options:
    flags: set[str] = field(default_factory=set)  # every option seen, short ones one letter each
    values: dict[str, list[str]] = field(default_factory=dict)  # option -> the values it was given
    operands: list[str] = field(default_factory=list)
    computed: bool = False  # a word computed at run time stands where options are read: any option may be there

    def value(self, *names: str) -> list[str]:
        return [v for n in names for v in self.values.get(n, [])]

    def has(self, *names: str) -> bool:
        return any(n in self.flags for n in names)


def parse(args: Iterable[str], takes: Iterable[str] = (), first_operand_ends: bool = False) -> Options:
    """`takes`: the options that take a value (`-o`, `--output`). Unknown long options may carry `=value`."""
    takes = set(takes)
    out = Options()
    words = list(args)
    i = 0
    ended = False
    while i < len(words):
        a = words[i]
        i += 1
        if ended or not a.startswith("-") or a == "-":
            if a[:1] in COMPUTED:
                out.computed = True
            out.operands.append(a)
            if first_operand_ends:
                ended = True
            continue
        if a == "--":
            ended = True
            continue
        if a.startswith("--"):
            name, eq, val = a.partition("=")
            out.flags.add(name)
            if eq:
                out.values.setdefault(name, []).append(val)
            elif name in takes and i < len(words):
                out.values.setdefault(name, []).append(words[i])
                i += 1
            continue
        for k in range(1, len(a)):
            name = "-" + a[k]
            out.flags.add(name)
            if name in takes:
                rest = a[k + 1 :]
                if rest:
                    out.values.setdefault(name, []).append(rest)
                elif i < len(words):
                    out.values.setdefault(name, []).append(words[i])
                    i += 1
                break
    return out


def command_start(args: list[str], takes: Iterable[str] = (), leading: int = 0) -> int:
    """Where the command a wrapper runs begins: after its options (and their values) and `leading` positional
    values (timeout's duration, taskset's mask)."""
    takes = set(takes)
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            return i + 1 if not leading else _positional(args, i + 1, leading)
        if a.startswith("-") and a != "-" and a[:1] not in COMPUTED:
            i += 1
            if a.startswith("--") or a in takes:
                i += int("=" not in a and a.split("=", 1)[0] in takes)
                continue
            for k in range(1, len(a)):  # a cluster: the first letter that takes a value takes the rest or the next
                if "-" + a[k] in takes:
                    i += int(k == len(a) - 1)
                    break
            continue
        if leading:
            leading -= 1
            i += 1
            continue
        return i
    return i


def _positional(args: list[str], i: int, leading: int) -> int:
    return min(i + leading, len(args))
