"""Settings declared once: a service's config dataclass field carries its flag (name, help, parsing) as field
metadata, as vLLM's EngineArgs does, and the command line (`add_flags`) and the config object (`from_flags`) are
generated from it. `glm5 SERVICE --config FILE` reads the same flags (glm5_cli.main), so a field, its flag, its
help text, its default and its config-file key are written in one place.

A field is either a `setting` (a flag of its own) or `derived` (built from other flags, e.g. TLS from --tls-*, or
a tuning knob with no flag), and says why; tests/unit/test_settings.py fails on a field that is neither, or on a
flag without help."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

FLAG = "glm5.flag"
DERIVED = "glm5.derived"

T = TypeVar("T")
_MISSING: Any = dataclasses.MISSING
_UNSET: Any = object()  # Flag.given when the flag's default is the field's


@dataclasses.dataclass(frozen=True, slots=True)
class Flag:
    help: str
    name: str | None = None  # without "--"; default: the field's name with "-" for "_"
    aliases: tuple[str, ...] = ()  # e.g. "-tp"
    type: Callable[[str], Any] | None = None  # default: the field's type (int, float, str, Path)
    choices: Sequence[Any] | None = None  # default: a Literal field's values
    metavar: str | None = None
    group: str | None = None  # the --help section it is listed under
    given: Any = _UNSET  # the flag's default where it is not the field's (e.g. "auto" for a None field)
    convert: Callable[[Any], Any] | None = None  # the parsed flag -> the field's value
    repeat: bool = False  # repeatable; the field is a tuple of the values given


def setting(
    default: Any = _MISSING,
    *,
    help: str,
    default_factory: Callable[[], Any] | None = None,
    repr: bool = True,
    **flag: Any,
) -> Any:
    """A field with its own flag; `flag` takes Flag's other keys."""
    return _field(default, default_factory, {FLAG: Flag(help=help, **flag)}, repr)


def derived(
    default: Any = _MISSING,
    *,
    why: str,
    default_factory: Callable[[], Any] | None = None,
    repr: bool = True,
) -> Any:
    """A field without a flag of its own: `why` says where its value comes from (the flags it is built from,
    or why it is a fixed tuning knob)."""
    return _field(default, default_factory, {DERIVED: why}, repr)


def _field(default: Any, factory: Callable[[], Any] | None, meta: dict[str, Any], repr: bool) -> Any:
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta, repr=repr)
    return dataclasses.field(default=default, metadata=meta, repr=repr)


def flags(cls: type) -> list[tuple[dataclasses.Field[Any], Flag]]:
    """The fields of `cls` that are flags, in declaration order."""
    return [(f, f.metadata[FLAG]) for f in dataclasses.fields(cls) if FLAG in f.metadata]


def undeclared(cls: type) -> list[str]:
    """Fields of `cls` that are neither a `setting` with help nor `derived` with a reason (a test fails on any)."""
    out = []
    for f in dataclasses.fields(cls):
        flag, why = f.metadata.get(FLAG), f.metadata.get(DERIVED)
        if not ((flag is not None and flag.help.strip()) or (why is not None and why.strip())):
            out.append(f"{cls.__name__}.{f.name}")
    return out


def flag_name(f: dataclasses.Field[Any], flag: Flag, prefix: str = "") -> str:
    return "--" + prefix + (flag.name or f.name.replace("_", "-"))


def _dest(f: dataclasses.Field[Any], flag: Flag, prefix: str) -> str:
    return flag_name(f, flag, prefix).removeprefix("--").replace("-", "_")


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None  # a required field: checked where the config is built (it may come from --config)


def _base_type(hint: Any) -> tuple[Any, tuple[Any, ...] | None]:
    """The type a flag parses to, and the choices of a Literal; `X | None` is X, `tuple[X, ...]` is X."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        values = typing.get_args(hint)
        return type(values[0]), values
    if typing.get_origin(hint) is tuple:
        return _base_type(typing.get_args(hint)[0])
    return hint, None


def group(parser: argparse.ArgumentParser, title: str) -> Any:
    """The --help section `title` of `parser`, added the first time it is asked for."""
    found = [g for g in parser._action_groups if g.title == title]
    return found[0] if found else parser.add_argument_group(title)


def add_flags(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> None:
    """One argparse flag per `setting` field of `cls`, each under its group's section of --help."""
    hints = typing.get_type_hints(cls)
    for f, flag in flags(cls):
        where: Any = parser if flag.group is None else group(parser, flag.group)
        base, choices = _base_type(hints[f.name])
        default = flag.given if flag.given is not _UNSET else _field_default(f)
        text = flag.help.replace("%", "%%")  # argparse formats help with %
        kwargs: dict[str, Any] = {"dest": _dest(f, flag, prefix), "help": text, "default": default}
        if flag.metavar is not None:
            kwargs["metavar"] = flag.metavar
        if base is bool and flag.type is None:
            action = where.add_argument(flag_name(f, flag, prefix), *flag.aliases,
                                        action=argparse.BooleanOptionalAction, **kwargs)  # fmt: skip
            action.help = text  # BooleanOptionalAction appends "(default: False)"; HelpFormatter decides
            continue
        kwargs["type"] = flag.type or (base if base in (int, float, str, Path) else None)
        if flag.choices is not None or choices is not None:
            kwargs["choices"] = flag.choices if flag.choices is not None else choices
        if flag.repeat:
            kwargs.update(action="append", default=list(default or ()))
        where.add_argument(flag_name(f, flag, prefix), *flag.aliases, **kwargs)


def from_flags(cls: type[T], args: argparse.Namespace, prefix: str = "", **given: Any) -> T:
    """`cls` from the parsed flags; `given` sets the derived fields (and overrides any other)."""
    values: dict[str, Any] = {}
    for f, flag in flags(cls):
        if f.name in given:
            continue
        value = getattr(args, _dest(f, flag, prefix))
        if flag.convert is not None:
            value = flag.convert(value)
        elif flag.repeat:
            value = tuple(value)
        values[f.name] = value
    return cls(**values, **given)
