"""Shells and interpreters: where their program comes from, and judging it.

A program given on the command line (`sh -c`, `python3 -c`, `perl -e`, ...), in a heredoc or here-string, or
echoed into the interpreter is judged (shells by this policy, Python by its syntax tree, the others by the calls
they make: code.py). A script file is not read, unless this command line wrote it (then what it wrote is judged)
or downloaded it (refused). Refused: a program computed at run time, code piped in from another command or a
process substitution (`curl ... | sh`, `bash <(curl ...)`, `source /dev/stdin` fed by a pipe), an interpreter
with no program at all (it reads a terminal or a socket: an interactive or reverse shell), code from a URL.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from glm5.parsing.shell import code as foreign
from glm5.parsing.shell import network, python_code
from glm5.parsing.shell.context import Context, Refused, Stdin
from glm5.parsing.shell.names import LANGUAGES, language, program
from glm5.parsing.shell.options import parse
from glm5.parsing.shell.words import GLOBS, is_computed, literal, shown

STDIN_PATHS = ("-", "/dev/stdin", "/dev/fd/0", "/proc/self/fd/0")
DIGIT_VALUED = "l0"
VERSION_FLAGS = {"V", "v", "h", "?", "--version", "--help", "-version", "-help", "-Version", "--usage"}


@dataclass(slots=True)
class Program:
    """What an interpreter's command line says it runs."""

    codes: list[str] = field(default_factory=list)  # given as arguments
    script: str | None = None  # a file
    argv: list[str] = field(default_factory=list)  # the program's own arguments
    in_place: bool = False  # perl -i, ruby -i, awk -i inplace: the argument files are rewritten
    interactive: bool = False
    module: str | None = None  # python -m
    serves: bool = False  # a web server on the working directory (php -S)
    flags: set[str] = field(default_factory=set)

    @property
    def asks_version(self) -> bool:
        return bool(self.flags & VERSION_FLAGS) and not (self.codes or self.script or self.module)


def judge(name: str, lang: str, args: list[str], ctx: Context, stdin: Stdin) -> None:
    reader = _READERS.get(lang, _other)
    prog = reader(name, args)
    if prog.asks_version and not stdin.feeds:
        return
    if prog.interactive and not (prog.codes or prog.script or prog.module):
        raise Refused(f"{name} started interactively (it reads commands from a terminal or a socket)")
    if prog.serves:
        ctx.facts.network.append(f"{name} -S")
        network.mentions(name, [], ctx)
    for text in prog.codes:
        if is_computed(text):
            raise Refused(f"{name} runs code computed when the command runs")
        code(lang, text, ctx, prog.argv)
    if prog.in_place:
        from glm5.parsing.shell.files import check_writes

        check_writes([a for a in prog.argv if "=" not in a], ctx, f"{name} rewrites")
    if prog.module is not None:
        python_code.module(prog.module, prog.argv, ctx)
    if prog.codes or prog.module is not None:
        return
    if prog.script is not None:
        script_file(name, lang, prog.script, ctx, stdin)
        return
    stdin_program(name, lang, ctx, stdin, prog.argv)


def code(lang: str, text: str, ctx: Context, argv: list[str]) -> None:
    """Judges a program in a language."""
    if lang == "shell":
        ctx.judge.script(text, ctx.nested())
    elif lang == "python":
        python_code.judge(text, ctx.nested(), argv)
    elif lang == "awk":
        foreign.awk(text, ctx)
    else:
        foreign.judge(lang, text, ctx, argv)


def script_file(name: str, lang: str, path: str, ctx: Context, stdin: Stdin) -> None:
    from glm5.parsing.shell.files import check_run_written

    if is_computed(path) or any(m in path for m in GLOBS):
        raise Refused(f"{name} runs a script chosen when the command runs")
    known = literal(path) or ""
    if known in STDIN_PATHS:
        stdin_program(name, lang, ctx, stdin, [])
    elif known.startswith(("/dev/fd/", "/proc/self/fd/", "/proc/thread-self/fd/")):
        raise Refused(f"{name} would run code produced by another command (a process substitution)")
    elif known.startswith(("http://", "https://", "ftp://", "npm:", "jsr:")):
        raise Refused(f"{name} runs code fetched from the network ({shown(path)})")
    else:
        check_run_written(known, lang, ctx)


def stdin_program(name: str, lang: str, ctx: Context, stdin: Stdin, argv: list[str]) -> None:
    """An interpreter reading its program from standard input."""
    if stdin.piped:
        printed = stdin.printed
        if printed is None or any(is_computed(p) or any(m in p for m in GLOBS) for p in printed):
            raise Refused(f"{name} would run code piped into it from another command")
        code(lang, "\n".join(printed), ctx, argv)
        return
    if stdin.descriptor:
        raise Refused(f"{name} reads its program from a descriptor (a socket, typically): a reverse shell")
    if stdin.code:
        for text in stdin.code:
            if text is None:
                raise Refused(f"{name} would run code computed when the command runs")
            code(lang, text, ctx, argv)
        return
    if stdin.file is not None:
        script_file(name, lang, stdin.file, ctx, Stdin())
        return
    raise Refused(f"{name} without a program reads commands from a terminal: an interactive shell")


def source(name: str, args: list[str], ctx: Context, stdin: Stdin) -> None:
    if not args:
        return
    script_file(name, "shell", args[0], ctx, stdin)


# -- command lines --------------------------------------------------------------------------------------------


def _cluster(args: list[str], with_value: str, rest_value: str = "", flag_words: frozenset[str] = frozenset(),
             takes: frozenset[str] = frozenset()) -> tuple[dict[str, list[str]], set[str], list[str]]:  # fmt: skip
    """Reads interpreter options up to the program: letters in `with_value` take the next word (or the rest of
    their cluster), letters in `rest_value` take only the rest of their cluster (perl -i.bak, -Mmod)."""
    values: dict[str, list[str]] = {}
    flags: set[str] = set()
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            i += 1
            break
        if not a.startswith("-") or a == "-" or is_computed(a[:1]):
            break
        i += 1
        if a.startswith("--"):
            key, eq, val = a.partition("=")
            flags.add(key)
            if key in takes:
                if eq:
                    values.setdefault(key, []).append(val)
                elif i < len(args):
                    values.setdefault(key, []).append(args[i])
                    i += 1
            continue
        if a in flag_words or a in takes:
            flags.add(a)
            if a in takes and i < len(args):
                values.setdefault(a, []).append(args[i])
                i += 1
            continue
        k = 1
        while k < len(a):
            letter = a[k]
            flags.add(letter)
            if letter in with_value:
                rest = a[k + 1 :]
                if not rest and i < len(args):
                    rest, i = args[i], i + 1
                values.setdefault(letter, []).append(rest)
                break
            if letter in DIGIT_VALUED:  # perl -l0, -0777: digits only, then more letters (`-lne`)
                end = k + 1
                while end < len(a) and a[end] in "0123456789abcdefABCDEFx":
                    end += 1
                values.setdefault(letter, []).append(a[k + 1 : end])
                k = end
                continue
            if letter in rest_value:
                values.setdefault(letter, []).append(a[k + 1 :])
                break
            k += 1
    return values, flags, args[i:]


def _shell(name: str, args: list[str]) -> Program:
    prog = Program()
    i = 0
    command = False
    reads_stdin = False
    while i < len(args):
        a = args[i]
        if a in ("-o", "+o", "-O", "+O", "--rcfile", "--init-file", "-C", "--init-command"):
            i += 2
            continue
        if a == "--":
            i += 1
            break
        if a.startswith("--"):
            key, eq, val = a.partition("=")
            if key in ("--command", "--commands"):
                command = True
                if eq:
                    prog.codes.append(val)
            prog.interactive |= key == "--interactive"
            prog.flags.add(key)
            i += 1
            continue
        if a[:1] in "-+" and len(a) > 1 and not is_computed(a):
            letters = a[1:]
            command |= a[0] == "-" and "c" in letters
            prog.interactive |= a[0] == "-" and "i" in letters
            reads_stdin |= a[0] == "-" and "s" in letters
            i += 1
            continue
        break
    rest = args[i:]
    if command:
        if not prog.codes and rest:
            prog.codes.append(rest[0])
            rest = rest[1:]
        prog.argv = rest
        if not prog.codes:
            prog.codes.append("")
    elif rest and not reads_stdin:
        prog.script, prog.argv = rest[0], rest[1:]
    else:
        prog.argv = rest
    return prog


def _python(name: str, args: list[str]) -> Program:
    values, flags, rest = _cluster(args, with_value="cmWXQ", takes=frozenset({"--check-hash-based-pycs"}))
    prog = Program(codes=values.get("c", [])[:1], interactive="i" in flags, flags=flags)
    if prog.codes:
        prog.argv = rest
    elif values.get("m"):
        prog.module, prog.argv = values["m"][0], rest
    elif rest:
        prog.script, prog.argv = rest[0], rest[1:]
    return prog


def _perl(name: str, args: list[str]) -> Program:
    ruby = language_of(name) == "ruby"
    values, flags, rest = _cluster(args, with_value="eIrCEF" if ruby else "eEI",
                                   rest_value="ixWK" if ruby else "iMmFdDCx")  # fmt: skip
    prog = Program(codes=values.get("e", []) + ([] if ruby else values.get("E", [])), flags=flags)
    prog.in_place = "i" in flags
    if name == "irb":
        prog.interactive = not rest
    if prog.codes:
        prog.argv = rest
    elif rest:
        prog.script, prog.argv = rest[0], rest[1:]
    return prog


def _node(name: str, args: list[str]) -> Program:
    if name == "deno" and args:
        sub, rest = args[0], args[1:]
        if sub == "eval":
            opts = parse(rest, {"--ext"})
            return Program(codes=opts.operands[:1], argv=opts.operands[1:])
        if sub == "repl":
            return Program(interactive=True)
        if sub != "run":
            return Program(script=sub, argv=rest)  # `deno test`, `deno fmt`, or `deno FILE`
        opts = parse(rest, {"--config", "-c", "--import-map", "--location", "--seed", "--v8-flags"},
                     first_operand_ends=True)  # fmt: skip
        return Program(script=opts.operands[0] if opts.operands else None, argv=opts.operands[1:])
    takes = frozenset({"--eval", "--print", "--require", "--import", "--loader", "--input-type",
                       "--experimental-loader", "--conditions", "--env-file"})  # fmt: skip
    values, flags, rest = _cluster(args, with_value="eprC", takes=takes)
    codes = values.get("e", []) + values.get("p", []) + values.get("--eval", []) + values.get("--print", [])
    prog = Program(codes=codes, interactive="i" in flags or "--interactive" in flags, flags=flags)
    if name == "bun" and rest[:1] in (["run"], ["x"]):
        rest = rest[1:]
    if codes:
        prog.argv = rest
    elif rest:
        prog.script, prog.argv = rest[0], rest[1:]
    return prog


def _php(name: str, args: list[str]) -> Program:
    values, flags, rest = _cluster(args, with_value="rBREFfdctSz")
    prog = Program(codes=values.get("r", []) + values.get("B", []) + values.get("R", []) + values.get("E", []))
    prog.interactive = "a" in flags
    prog.serves = "S" in values
    prog.flags = flags
    if values.get("f"):
        prog.script = values["f"][0]
    if prog.codes or prog.script:
        prog.argv = rest
    elif rest:
        prog.script, prog.argv = rest[0], rest[1:]
    return prog


def language_of(name: str) -> str | None:
    return LANGUAGES.get(name)


def _generic(with_value: str, code_letters: str, takes: frozenset[str] = frozenset(),
             code_options: tuple[str, ...] = ()) -> Callable[[str, list[str]], Program]:  # fmt: skip
    def reader(name: str, args: list[str]) -> Program:
        values, flags, rest = _cluster(args, with_value=with_value, takes=takes)
        codes = [c for letter in code_letters for c in values.get(letter, [])]
        codes += [c for opt in code_options for c in values.get(opt, [])]
        prog = Program(codes=codes, interactive="i" in flags or "--interactive" in flags, flags=flags)
        if codes:
            prog.argv = rest
        elif rest:
            prog.script, prog.argv = rest[0], rest[1:]
        return prog

    return reader


def _awk(name: str, args: list[str]) -> Program:
    takes = frozenset({"-f", "--file", "-v", "--assign", "-F", "--field-separator", "-i", "--include", "-l",
                       "--load", "-E", "--exec", "-e", "--source", "-W"})  # fmt: skip
    opts = parse(args, takes, first_operand_ends=False)
    safe = {"filefuncs", "readdir", "time", "ordchr", "rwarray", "fnmatch", "intdiv", "readfile", "revoutput",
            "revtwoway", "inplace"}  # fmt: skip
    for lib in opts.value("-l", "--load"):
        if lib not in safe:
            raise Refused(f"{name} loads the extension {shown(lib)}")
    prog = Program(codes=opts.value("-e", "--source"), flags={f.lstrip("-") if len(f) == 2 else f for f in opts.flags})
    prog.in_place = "inplace" in opts.value("-i", "--include")
    files = opts.value("-f", "--file", "-E", "--exec")
    operands = opts.operands
    if not prog.codes and not files and operands:
        prog.codes, operands = [operands[0]], operands[1:]
    if files:
        prog.script = files[0]
    prog.argv = operands
    return prog


def _powershell(name: str, args: list[str]) -> Program:
    lowered = [a.lower() for a in args]
    for flag in ("-encodedcommand", "-enc", "-ec", "-e", "-en", "-encoded"):
        if flag in lowered:
            raise Refused(f"{name} -EncodedCommand runs code that is not readable here")
    for flag in ("-command", "-c"):
        if flag in lowered:
            return Program(codes=[" ".join(args[lowered.index(flag) + 1 :])])
    for flag in ("-file", "-f"):
        if flag in lowered:
            at = lowered.index(flag)
            return Program(script=args[at + 1] if at + 1 < len(args) else None, argv=args[at + 2 :])
    operands = [a for a in args if not a.startswith("-")]
    return Program(script=operands[0] if operands else None, argv=operands[1:])


def _r(name: str, args: list[str]) -> Program:
    codes = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("-e", "--expr")]
    if name == "R" and args[:1] == ["CMD"]:
        return Program(script=args[2] if len(args) > 2 else "", argv=args[3:])
    files = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("-f", "--file")]
    files += [a.split("=", 1)[1] for a in args if a.startswith("--file=")]
    operands = [a for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or args[i - 1] not in ("-e", "-f"))]
    if codes:
        return Program(codes=codes, argv=operands)
    if files:
        return Program(script=files[0])
    if name == "Rscript" and operands:
        return Program(script=operands[0], argv=operands[1:])
    return Program()


_READERS = {
    "shell": _shell,
    "python": _python,
    "perl": _perl,
    "ruby": _perl,
    "node": _node,
    "php": _php,
    "lua": _generic("el", "e"),
    "tcl": _generic("cf", "c"),
    "r": _r,
    "julia": _generic(
        "eELJCt", "eE", frozenset({"--eval", "--print", "--project", "-t", "--threads"}), ("--eval", "--print")
    ),
    "applescript": _generic("el", "e"),
    "powershell": _powershell,
    "awk": _awk,
    "dc": _generic("ef", "e", frozenset({"--expression", "--file"}), ("--expression",)),
}


def _other(name: str, args: list[str]) -> Program:
    takes = frozenset({"-e", "--eval", "-eval", "-c", "--command", "-x", "--expr", "-E"})
    opts = parse(args, takes)
    codes = opts.value("-e", "--eval", "-eval", "-c", "--command", "-x", "--expr", "-E")
    codes += [args[i + 1] for i, a in enumerate(args[:-1]) if a == "-eval"]
    if codes:
        return Program(codes=codes, argv=opts.operands)
    flags = {f.lstrip("-") if len(f) == 2 else f for f in opts.flags}
    return Program(script=opts.operands[0] if opts.operands else None, argv=opts.operands[1:], flags=flags)


def shebang(text: str) -> str | None:
    """The language a file's `#!` line names."""
    first = text.split("\n", 1)[0]
    if not first.startswith("#!"):
        return None
    words = first[2:].split()
    if not words:
        return None
    name = program(words[0])
    if name == "env":
        rest = [w for w in words[1:] if not w.startswith("-")]
        name = program(rest[0]) if rest else "env"
    return language(name)
