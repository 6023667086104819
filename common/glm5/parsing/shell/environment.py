"""Variables that change what other programs do: preloaded libraries, the shell history, and variables whose
value is a command some program runs later (PAGER, GIT_SSH_COMMAND, PROMPT_COMMAND, LESSOPEN...)."""

from __future__ import annotations

import re

from glm5.parsing.shell.context import Context, Refused
from glm5.parsing.shell.paths import normalise, within
from glm5.parsing.shell.words import is_computed, literal, shown

PRELOAD = {"LD_PRELOAD", "LD_AUDIT", "DYLD_INSERT_LIBRARIES", "DYLD_FORCE_FLAT_NAMESPACE"}
LIBRARY_PATHS = {"LD_LIBRARY_PATH", "DYLD_LIBRARY_PATH", "DYLD_FALLBACK_LIBRARY_PATH"}
SHARED_DIRS = ("/tmp", "/var/tmp", "/dev/shm")  # anyone can write there
COMMAND_VALUED = {"PAGER", "MANPAGER", "GIT_PAGER", "SYSTEMD_PAGER", "EDITOR", "VISUAL", "GIT_EDITOR",
                  "GIT_SEQUENCE_EDITOR", "GIT_SSH_COMMAND", "GIT_SSH", "GIT_ASKPASS", "SSH_ASKPASS", "SUDO_ASKPASS",
                  "GIT_EXTERNAL_DIFF", "GIT_PROXY_COMMAND", "PROMPT_COMMAND", "BROWSER", "LESSOPEN", "LESSCLOSE",
                  "FCEDIT", "SVN_EDITOR", "KUBE_EDITOR", "TERMINAL"}  # fmt: skip
SOURCED = {"BASH_ENV", "ENV", "ZDOTDIR"}  # a file every new shell runs
PROMPTS = {"PS0", "PS1", "PS2", "PS3", "PS4", "RPROMPT"}


def assignment(name: str, values: list[str], ctx: Context) -> None:
    """Judges giving variable `name` these values: `X=v cmd`, `export X=v`, `env X=v cmd`, `declare X=v`."""
    from glm5.parsing.shell.git import config_variable

    for value in values:
        if name in PRELOAD and value:
            raise Refused(f"{name} loads a library into every program it starts")
        if name in LIBRARY_PATHS:
            for entry in value.split(":"):
                path = normalise(entry, ctx.cwd)
                if entry and not is_computed(entry) and within(path, SHARED_DIRS):
                    raise Refused(f"{name} loads libraries from {shown(entry)}, which anyone can write")
        _history(name, value)
        if name in COMMAND_VALUED:
            command = value.lstrip("|-") if name.startswith("LESS") else value
            if is_computed(command):
                raise Refused(f"{name} is a command computed when it runs")
            if command.strip():
                ctx.judge.script(command.replace("%s", "FILE"), ctx.nested())
        if name in SOURCED and value not in ("", "/dev/null"):
            raise Refused(f"{name} makes every new shell run {shown(value)}")
        if name in PROMPTS:
            for code in re.findall(r"\$\((.*?)\)|`(.*?)`", value):
                ctx.judge.script(code[0] or code[1], ctx.nested())
        config_variable(name, value, ctx)


def _history(name: str, value: str) -> None:
    if name == "HISTFILE":
        raise Refused("HISTFILE redirects the shell history")
    if name in ("HISTSIZE", "HISTFILESIZE", "SAVEHIST"):
        known = literal(value)
        if known is None or not re.fullmatch(r"[1-9]\d*", known.strip()):
            raise Refused(f"{name}={shown(value)} turns the shell history off")
    if name == "HISTIGNORE" and "*" in shown(value):
        raise Refused("HISTIGNORE keeps commands out of the shell history")
