"""git: settings that make git run a command later (`core.hooksPath`, `core.sshCommand`, `alias.x=!cmd`,
filters...), wherever they are given (`git config`, `git -c`, GIT_CONFIG_* variables), and the subcommands that
run one now (`rebase --exec`, `bisect run`, `submodule foreach`, `filter-branch`, `ext::` remotes)."""

from __future__ import annotations

import re

from glm5.parsing.shell.context import Context, Refused, Stdin
from glm5.parsing.shell.options import parse
from glm5.parsing.shell.words import is_computed, literal, shown

# settings whose value is a command git runs (judged as one)
COMMAND_KEYS = re.compile(
    r"core\.(sshcommand|pager|editor|askpass|gitproxy|fsmonitor|alternaterefscommand)|sequence\.editor"
    r"|credential\.(.+\.)?helper|gpg\.(.+\.)?program|diff\.external|diff\..+\.(command|textconv)"
    r"|merge\..+\.driver|filter\..+\.(clean|smudge|process)|pager\..+|alias\..+|uploadpack\.packobjectshook"
    r"|remote\..+\.(uploadpack|receivepack|vcs)|mergetool\..+\.cmd|difftool\..+\.cmd|interactive\.difffilter"
    r"|browser\..+\.(cmd|path)|web\.browser|man\..+\.(cmd|path)|sendemail\.(smtpserver|tocmd|cccmd)"
)
# settings that make git run what a file or directory holds, or read settings from elsewhere: refused
FILE_KEYS = re.compile(r"core\.hookspath|include\.path|includeif\..+\.path|init\.templatedir|protocol\..*allow")
BOOLEAN = re.compile(r"(?i)true|false|yes|no|on|off|1|0|")
CREDENTIAL_HELPERS = {"store", "cache", "osxkeychain", "manager", "manager-core", "libsecret", "wincred",
                      "gnome-keyring", "oauth"}  # fmt: skip
WRITES = {"checkout", "switch", "reset", "restore", "clean", "stash", "pull", "merge", "apply", "am", "rm", "mv",
          "init", "clone", "cherry-pick", "revert", "rebase", "worktree", "read-tree", "checkout-index"}  # fmt: skip
GLOBAL_TAKES = {"-C", "-c", "--git-dir", "--work-tree", "--namespace", "--config-env", "--exec-path"}


def config(key: str, value: str | None, ctx: Context) -> None:
    """Judges setting `key` to `value` (None: computed when it runs)."""
    key = key.lower()
    if FILE_KEYS.fullmatch(key):
        if key == "core.hookspath" and value == "/dev/null":
            return  # turns hooks off
        if key.startswith("protocol.") and value is not None and value.lower() in ("never", "user"):
            return
        raise Refused(f"git {key} makes git run or read files chosen by this command")
    if not COMMAND_KEYS.fullmatch(key):
        return
    if value is None or is_computed(value):
        raise Refused(f"git {key} is a command computed when it runs")
    if key.startswith("alias.") and not value.startswith("!"):
        return  # an alias for git's own subcommands
    if key == "core.fsmonitor":
        if BOOLEAN.fullmatch(value):
            return
        raise Refused("git core.fsmonitor runs a program chosen by this command on every git command")
    if key.startswith("pager.") and BOOLEAN.fullmatch(value):
        return
    if key.startswith("credential.") and value in CREDENTIAL_HELPERS:
        return
    ctx.judge.script(value.lstrip("!"), ctx.nested())


def config_variable(name: str, value: str, ctx: Context) -> None:
    """GIT_CONFIG_KEY_n / GIT_CONFIG_PARAMETERS: settings given through the environment."""
    if re.fullmatch(r"GIT_CONFIG_KEY_\d+", name):
        key = literal(value)
        if key is None or COMMAND_KEYS.fullmatch(key.lower()) or FILE_KEYS.fullmatch(key.lower()):
            raise Refused(f"{name}={shown(value)} sets a git setting that runs commands")
    if name == "GIT_CONFIG_PARAMETERS":
        for key in re.findall(r"'([^'=]+)'?=", value):
            if COMMAND_KEYS.fullmatch(key.lower()) or FILE_KEYS.fullmatch(key.lower()):
                raise Refused(f"GIT_CONFIG_PARAMETERS sets {key}, a git setting that runs commands")


def check(args: list[str], ctx: Context, stdin: Stdin) -> None:
    from glm5.parsing.shell.files import check_extraction, check_writes

    i = 0
    places: list[str] = []
    while i < len(args) and args[i].startswith("-"):
        a = args[i]
        name, eq, val = a.partition("=")
        if name in GLOBAL_TAKES and not eq:
            val, i = (args[i + 1] if i + 1 < len(args) else ""), i + 1
        if name == "-c":
            key, _, setting = val.partition("=")
            config(key, setting if literal(setting) is not None else None, ctx)
        elif name == "--config-env":
            key = val.partition("=")[0]
            config(key, None, ctx)
        elif name in ("-C", "--work-tree"):
            places.append(val)
        i += 1
    sub, rest = (args[i], args[i + 1 :]) if i < len(args) else ("", [])
    if sub in WRITES:
        check_extraction(places, ctx, f"git {sub} writes into")
    for a in rest:
        if a.startswith("ext::") or "::ext::" in a:
            raise Refused("a git ext:: remote runs a command")
        if a.startswith(("--upload-pack=", "--receive-pack=", "--exec=")):
            _script(a.split("=", 1)[1], ctx)
        if a.startswith("--template"):
            raise Refused("git --template installs hooks from a directory")
    if sub == "config":
        _config_command(rest, ctx)
    elif sub == "clone":
        opts = parse(rest, {"-b", "--branch", "-o", "--origin", "-u", "--upload-pack", "--depth", "-c",
                            "--config", "--reference", "--separate-git-dir", "-j", "--jobs", "--filter"})  # fmt: skip
        for setting in opts.value("-c", "--config"):
            key, _, val = setting.partition("=")
            config(key, val, ctx)
        for cmd in opts.value("-u", "--upload-pack"):
            _script(cmd, ctx)
        check_writes(opts.operands[1:2] + opts.value("--separate-git-dir"), ctx, "git clone writes into")
    elif sub == "rebase":
        for cmd in parse(rest, {"-x", "--exec", "-s", "--strategy", "-X", "--onto"}).value("-x", "--exec"):
            _script(cmd, ctx)
    elif sub == "bisect" and rest[:1] == ["run"]:
        ctx.judge.argv(rest[1:], ctx, Stdin())
    elif sub == "submodule" and "foreach" in rest:
        tail = [a for a in rest[rest.index("foreach") + 1 :] if a not in ("--recursive", "-q", "--quiet")]
        _script(" ".join(tail), ctx)
    elif sub == "filter-branch":
        for j, a in enumerate(rest):
            if a.endswith("-filter") and j + 1 < len(rest):
                _script(rest[j + 1], ctx)
    elif sub == "difftool":
        for cmd in parse(rest, {"-x", "--extcmd", "-t", "--tool"}).value("-x", "--extcmd"):
            _script(cmd, ctx)
    elif sub == "credential" and rest[:1] == ["fill"]:
        ctx.facts.credentials.append("git credential fill")
    elif sub in ("fetch", "pull", "ls-remote", "push"):
        for cmd in parse(rest, {"--upload-pack", "--receive-pack"}).value("--upload-pack", "--receive-pack"):
            _script(cmd, ctx)


def _config_command(args: list[str], ctx: Context) -> None:
    reading = {"--get", "--get-all", "--get-regexp", "--list", "-l", "--unset", "--unset-all", "--remove-section",
               "--rename-section", "--edit", "-e", "--show-origin", "--show-scope", "--name-only", "--get-urlmatch",
               "--get-color", "--get-colorbool"}  # fmt: skip
    takes = {"-f", "--file", "--blob", "--type", "--default", "--comment"}
    opts = parse(args, takes)
    words = opts.operands
    if words[:1] in (["get"], ["list"], ["unset"], ["rename-section"], ["remove-section"], ["edit"]):
        return
    if words[:1] == ["set"]:
        words = words[1:]
    if opts.flags & reading or len(words) < 2:
        return
    config(words[0], words[1] if literal(words[1]) is not None else None, ctx)


def _script(code: str, ctx: Context) -> None:
    if is_computed(code):
        raise Refused("git runs a command computed when it runs")
    ctx.judge.script(code, ctx.nested())
