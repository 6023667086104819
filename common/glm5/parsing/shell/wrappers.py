"""Commands that run other commands: the command they run is judged like any other.

Wrappers that take a command as words (`nice`, `timeout`, `env`, `busybox rm`, `uv run`, `xargs`), as one shell
string (`watch`, `script -c`, `flock -c`, `parallel`, `tmux new`), or as the applet of a multi-call binary.
`env -S` splits its string the way env does. `xargs` and `parallel` run their input as arguments: what the
previous command prints when that is known (`find DIR` prints DIR and below it), otherwise words computed at
run time.
"""

from __future__ import annotations

import shlex

from glm5.parsing.shell.context import Context, Refused, Stdin
from glm5.parsing.shell.options import command_start, parse
from glm5.parsing.shell.words import SPLIT, literal

# wrapper -> (its options that take a value, positional values before the command)
_GENERIC = {
    "nice": ("--adjustment -n", 0),
    "nohup": ("", 0),
    "timeout": ("--kill-after --signal -k -s", 1),
    "stdbuf": ("--error --input --output -e -i -o", 0),
    "setsid": ("", 0),
    "time": ("--format --output -f -o", 0),
    "builtin": ("", 0),
    "exec": ("-a", 0),
    "ionice": ("--class --classdata -P -c -n -p -u", 0),
    "taskset": ("", 1),
    "chrt": ("", 1),
    "unbuffer": ("", 0),
    "strace": ("-E -I -O -P -S -X -a -b -e -o -p -s -u", 0),
    "ltrace": ("-A -D -F -a -e -l -n -o -p -s -u -x", 0),
    "valgrind": ("", 0),
    "firejail": ("", 0),
    "xvfb-run": ("--auth-file --error-file --server-args --server-num --wait --xauth-protocol -e -f -n -p -s -w", 0),
    "catchsegv": ("", 0),
    "faketime": ("-f -m", 1),
    "torsocks": ("-P -a -p -u", 0),
    "torify": ("", 0),
    "proxychains": ("-f", 0),
    "proxychains4": ("-f", 0),
    "nocache": ("", 0),
    "chronic": ("", 0),
    "ssh-agent": ("-E -P -a -t", 0),
    "dbus-run-session": ("--config-file", 0),
    "dbus-launch": ("--config-file", 0),
    "sshpass": ("-P -d -f -p", 0),
    "caffeinate": ("-t -w", 0),
    "coproc": ("", 0),
    "setarch": ("", 1),
    "linux32": ("", 0),
    "linux64": ("", 0),
    "numactl": ("--cpunodebind --interleave --membind --physcpubind --preferred -C -N -i -m -p", 0),
    "prlimit": ("--pid -p", 0),
    "cgexec": ("-g", 0),
    "mpirun": (
        "--bind-to --host --hostfile --map-by --npernode --output-filename --prefix --rank-by --wdir "
        "-H -N -c -hostfile -machinefile -n -np -ppn -wdir -x",
        0,
    ),
    "srun": ("-A -G -J -N -c -e -n -o -p -q -t -w", 0),
    "daemonize": ("-E -a -c -e -l -o -p -u", 0),
    "trickle": ("-d -l -n -t -u -w", 0),
    "entr": ("", 0),
    "npx": ("--call --package -c -p", 0),
    "pnpx": ("--package -p", 0),
    "bunx": ("--package -p", 0),
    "uvx": ("--from --index --index-url --python --with -p", 0),
    "cross-env": ("", 0),
    "env-cmd": ("--environments --file -e -f", 0),
    "dotenv": ("-c -e -v", 0),
    "direnv": ("", 2),
    "aws-vault": ("", 2),
}
GENERIC = {name: (frozenset(takes.split()), leading) for name, (takes, leading) in _GENERIC.items()}
GENERIC["mpiexec"] = GENERIC["orterun"] = GENERIC["mpirun"]
# `TOOL SUBCOMMAND [options] CMD...`: the subcommands that run a command, their options that take a value
_RUNNERS = {
    "uv": (
        "run",
        "--directory --env-file --extra --from --group --index "
        "--index-url --package --project --python --with --with-requirements -p",
    ),
    "poetry": ("run", "--directory --project -C -P"),
    "pipenv": ("run", ""),
    "pdm": ("run", "--project -p"),
    "hatch": ("run", "--env -e"),
    "rye": ("run", ""),
    "pixi": ("exec run", "--environment --manifest-path -e"),
    "conda": ("run", "--cwd --name --prefix -n -p"),
    "mamba": ("run", "--cwd --name --prefix -n -p"),
    "micromamba": ("run", "--cwd --name --prefix -n -p"),
    "pnpm": ("dlx exec", "--dir --filter -C"),
    "npm": ("exec x", "--call --package --workspace -c -w"),
    "yarn": ("dlx exec", "--package -p"),
    "bundle": ("exec", ""),
    "pipx": ("run", "--python --spec"),
    "devbox": ("run", "--config -c"),
    "op": ("run", "--env-file"),
    "doppler": ("run", "--config --project --token -c -p"),
    "nix": ("develop shell", ""),
}
RUNNERS = {name: (frozenset(subs.split()), frozenset(takes.split())) for name, (subs, takes) in _RUNNERS.items()}


def unwrap(name: str, args: list[str], ctx: Context, stdin: Stdin) -> bool:
    """Judges the command a wrapper runs; False when `name` is not a wrapper."""
    judge = ctx.judge
    if name in GENERIC:
        from glm5.parsing.shell.files import generic

        takes, leading = GENERIC[name]
        start = command_start(args, takes, leading)
        generic(name, args[:start], ctx)  # `time -o FILE`, `strace -o FILE`
        if name == "entr" and "-s" in args[:start]:
            _script(args[start : start + 1], ctx)
            return True
        judge.argv(args[start:], ctx, stdin)
        return True
    if name in RUNNERS and args:
        subs, takes = RUNNERS[name]
        if args[0] not in subs:
            return False  # `uv pip install`, `npm install`: the tool itself
        rest = args[1:]
        if name == "nix":  # `nix develop -c CMD`, `nix shell PKG... --command CMD`
            at = next((i for i, a in enumerate(rest) if a in ("-c", "--command")), None)
            judge.argv(rest[at + 1 :] if at is not None else [], ctx, stdin)
            return True
        if name in ("npm", "npx") and ("-c" in rest or "--call" in rest):
            _script(parse(rest, takes).value("-c", "--call"), ctx)
        judge.argv(rest[command_start(rest, takes) :], ctx, stdin)
        return True
    special = _SPECIAL.get(name)
    if special is None:
        return False
    special(args, ctx, stdin)
    return True


def _script(codes: list[str], ctx: Context) -> None:
    for code in codes:
        ctx.judge.script(code, ctx.nested())


def _env(args: list[str], ctx: Context, stdin: Stdin) -> None:
    from glm5.parsing.shell.environment import assignment

    i = 0
    words = list(args)
    while i < len(words):
        a = words[i]
        if a == "--":
            i += 1
            break
        split = None
        if a in ("-S", "--split-string") and i + 1 < len(words):
            split, i = words[i + 1], i + 2
        elif a.startswith("--split-string="):
            split, i = a.split("=", 1)[1], i + 1
        elif a.startswith("-") and not a.startswith("--") and "S" in a:
            _, _, rest = a.partition("S")
            if rest:
                split, i = rest, i + 1
            elif i + 1 < len(words):
                split, i = words[i + 1], i + 2
            else:
                i += 1
        if split is not None:
            known = literal(split)
            if known is None:
                raise Refused("env -S splits a string computed when it runs")
            try:
                pieces = shlex.split(known.replace("\\_", " "))
            except ValueError as exc:
                raise Refused("env -S string cannot be split") from exc
            words[i:i] = pieces
            continue
        if a in ("-u", "--unset", "-C", "--chdir", "-P", "--path"):
            i += 2
        elif a.startswith("-") and a != "-":
            i += 1
        elif "=" in a and not a.startswith("="):
            key, _, val = a.partition("=")
            assignment(key, [val], ctx)
            i += 1
        else:
            break
    ctx.judge.argv(words[i:], ctx, stdin)


def _command(args: list[str], ctx: Context, stdin: Stdin) -> None:
    opts = parse(args[: command_start(args)])
    if opts.has("-v", "-V"):
        return  # prints what a name is; runs nothing
    ctx.judge.argv(args[command_start(args) :], ctx, stdin)


def _applet(args: list[str], ctx: Context, stdin: Stdin) -> None:
    """busybox / toybox APPLET ARGS, `coreutils --coreutils-prog=NAME ARGS`."""
    if not args:
        return
    first = args[0]
    if first.startswith("--coreutils-prog="):
        ctx.judge.argv([first.split("=", 1)[1], *args[1:]], ctx, stdin)
        return
    if first == "--install":
        from glm5.parsing.shell.files import check_writes

        check_writes([a for a in args[1:] if not a.startswith("-")], ctx, "installs applet links into")
        return
    if first.startswith("-") and first != "-":
        return  # --list, --help
    ctx.judge.argv(args, ctx, stdin)


XARGS_TAKES = frozenset({"-a", "--arg-file", "-d", "--delimiter", "-E", "--eof", "-I", "-L", "--max-lines", "-n",
                         "--max-args", "-P", "--max-procs", "-s", "--max-chars", "--process-slot-var"})  # fmt: skip


def _xargs(args: list[str], ctx: Context, stdin: Stdin) -> None:
    start = command_start(args, XARGS_TAKES)
    opts = parse(args[:start], XARGS_TAKES)
    command = args[start:] or ["echo"]
    replace = opts.value("-I") + [a[len("--replace=") :] or "{}" for a in args[:start] if a.startswith("--replace")]
    replace += ["{}" for a in args[:start] if a == "-i" or (a.startswith("-i") and not a.startswith("-I"))]
    known = stdin.printed if stdin.piped and not opts.value("-a", "--arg-file") else None
    items = known if known is not None else [SPLIT]
    if replace:
        for item in items:
            ctx.judge.argv([w.replace(replace[0], item) for w in command], ctx, Stdin())
        return
    whole = opts.has("-0", "--null", "-d", "--delimiter")  # items are not split at blanks
    words = [w for item in items for w in (item.split() if known is not None and not whole else [item])]
    ctx.judge.argv([*command, *words], ctx, Stdin())


def _parallel(args: list[str], ctx: Context, stdin: Stdin) -> None:
    takes = {"-j", "--jobs", "-a", "--arg-file", "-S", "--sshlogin", "-I", "--colsep", "-d", "--delimiter",
             "--joblog", "--results", "--tmpdir", "-n", "--max-args", "-N", "--timeout", "--delay"}  # fmt: skip
    start = command_start(args, takes)
    rest = args[start:]
    seps = [i for i, a in enumerate(rest) if a in (":::", "::::", ":::+", "::::+")]
    command = rest[: seps[0]] if seps else rest
    items = [a for a in rest[seps[0] + 1 :] if a not in (":::", "::::", ":::+", "::::+")] if seps else None
    if items is None:
        items = stdin.printed if stdin.piped and stdin.printed is not None else [SPLIT]
    if not command:
        for item in items:
            ctx.judge.script(item, ctx.nested())  # with no command, each input line is a command
        return
    line = " ".join(command)
    for item in items:
        filled = line
        for token in ("{}", "{.}", "{/}", "{//}", "{/.}", "{#}", "{%}"):
            filled = filled.replace(token, item)
        ctx.judge.script(filled if filled != line else f"{line} {item}", ctx.nested())


def _watch(args: list[str], ctx: Context, stdin: Stdin) -> None:
    takes = {"-n", "--interval", "-q", "--equexit"}
    start = command_start(args, takes)
    if parse(args[:start], takes).has("-x", "--exec"):
        ctx.judge.argv(args[start:], ctx, Stdin())
    else:
        ctx.judge.script(" ".join(args[start:]), ctx.nested())


def _script_command(args: list[str], ctx: Context, stdin: Stdin) -> None:
    from glm5.parsing.shell.files import check_writes

    opts = parse(args, {"-c", "--command", "-T", "--log-timing", "-B", "--log-io", "-I", "--log-in", "-O",
                        "--log-out", "-E", "--echo", "-o", "--output-limit", "-m", "--logging-format"})  # fmt: skip
    commands = opts.value("-c", "--command")
    if not commands:
        raise Refused("script starts an interactive shell")
    _script(commands, ctx)
    check_writes([*opts.operands, *opts.value("-T", "-B", "-I", "-O", "--log-timing", "--log-io")], ctx,
                 "script writes its log to")  # fmt: skip


def _flock(args: list[str], ctx: Context, stdin: Stdin) -> None:
    takes = {"-w", "--timeout", "-E", "--conflict-exit-code", "-c", "--command"}
    start = command_start(args, takes, leading=1)
    opts = parse(args[:start], takes)
    _script(opts.value("-c", "--command"), ctx)
    rest = args[start:]
    if rest[:1] in (["-c"], ["--command"]):
        _script(rest[1:2], ctx)
    else:
        ctx.judge.argv(rest, ctx, stdin)


TMUX_RUNS = {"new-session", "new", "new-window", "neww", "split-window", "splitw", "respawn-pane", "respawnp",
             "respawn-window", "respawnw", "run-shell", "run", "if-shell", "if", "pipe-pane", "pipep"}  # fmt: skip
TMUX_TAKES = {"-s", "-n", "-c", "-t", "-x", "-y", "-e", "-F", "-f", "-l", "-L", "-S", "-d", "-b"}
KEYS = {"Enter", "C-m", "C-c", "C-d", "C-j", "Escape", "Space", "Tab", "BSpace", "Up", "Down", "Left", "Right"}


def _tmux(args: list[str], ctx: Context, stdin: Stdin) -> None:
    opts = parse(args, {"-L", "-S", "-f", "-c", "-T"}, first_operand_ends=True)
    _script(opts.value("-c"), ctx)
    words = opts.operands
    while words:
        sub, words = words[0], words[1:]
        end = words.index(";") if ";" in words else len(words)
        own, words = words[:end], words[end + 1 :]
        if sub in TMUX_RUNS or sub in ("send-keys", "send"):
            takes = {"-t", "-N"} if sub in ("send-keys", "send") else TMUX_TAKES - {"-d", "-b"}
            rest = parse(own, takes).operands
            if sub in ("send-keys", "send"):
                rest = [r for r in rest if r not in KEYS]
            if rest:
                _script([" ".join(rest)], ctx)


def _screen(args: list[str], ctx: Context, stdin: Stdin) -> None:
    takes = {"-S", "-c", "-e", "-h", "-p", "-T", "-t", "-X", "-Logfile", "-s"}
    start = command_start(args, takes)
    own = args[:start]
    if "-X" in own:
        at = own.index("-X")
        sent = [a.replace("\\n", "\n").replace("^M", "\n") for a in args[at + 1 :]]
        if sent[:1] == ["stuff"]:
            _script([" ".join(sent[1:])], ctx)
        return
    ctx.judge.argv(args[start:], ctx, stdin)


_SPECIAL = {
    "env": _env, "command": _command, "busybox": _applet, "toybox": _applet, "coreutils": _applet,
    "xargs": _xargs, "parallel": _parallel, "watch": _watch, "script": _script_command, "flock": _flock,
    "tmux": _tmux, "screen": _screen,
}  # fmt: skip
WRAPPERS = frozenset(GENERIC) | frozenset(RUNNERS) | frozenset(_SPECIAL)
