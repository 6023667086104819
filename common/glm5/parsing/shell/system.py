"""The machine itself: services, scheduled commands, processes, kernel settings, containers, the shell's own
history and hooks, and programs that run commands typed into them (editors, pagers, debuggers)."""

from __future__ import annotations

import re

from glm5.parsing.shell import git
from glm5.parsing.shell.context import Context, Refused, Stdin
from glm5.parsing.shell.files import Check
from glm5.parsing.shell.names import FORBIDDEN
from glm5.parsing.shell.options import parse
from glm5.parsing.shell.paths import PROTECTED, covers, is_credential, is_raw_disk, is_top, normalise, within
from glm5.parsing.shell.words import is_computed, shown

SYSTEMCTL_CHANGES = {"enable", "disable", "mask", "unmask", "start", "stop", "restart", "try-restart", "reload",
                     "reload-or-restart", "daemon-reload", "daemon-reexec", "edit", "link", "set-default",
                     "isolate", "kill", "poweroff", "reboot", "halt", "suspend", "hibernate", "hybrid-sleep",
                     "kexec", "emergency", "rescue", "revert", "preset", "preset-all", "set-property",
                     "set-environment", "import-environment", "switch-root", "add-wants", "add-requires",
                     "reenable", "freeze", "thaw", "clean"}  # fmt: skip
# read-only forms of otherwise refused programs
LISTINGS = {"mount": set(), "ldconfig": {"-p", "--print-cache"}, "swapon": {"--show", "-s", "--summary"},
            "update-alternatives": {"--display", "--list", "--query", "--get-selections"},
            "fdisk": {"-l", "--list"}, "sfdisk": {"-l", "--list"}, "parted": {"-l", "--list"}, "at": {"-l"},
            "blockdev": {"--report"}}  # fmt: skip
CONTAINER_RUNS = {"run", "create", "exec"}
HOST_NAMESPACES = ("--pid=host", "--ipc=host", "--uts=host", "--userns=host", "--cgroupns=host")


def forbidden(name: str, args: list[str]) -> bool:
    if name.startswith(("mkfs", "fsck", "mkntfs", "mke2fs", "mkdosfs")):
        return True
    if name not in FORBIDDEN:
        return False
    if name in LISTINGS:
        allowed = LISTINGS[name]
        return not (all(a in allowed for a in args) and (bool(args) or not allowed))
    return True


def _systemctl(args: list[str], ctx: Context, stdin: Stdin) -> None:
    verbs = parse(args, {"-t", "--type", "-p", "--property", "-H", "--host", "-M", "--machine", "-s", "--signal",
                         "--root", "-n", "--lines", "-o", "--output"}).operands  # fmt: skip
    if verbs and (is_computed(verbs[0]) or verbs[0] in SYSTEMCTL_CHANGES):
        raise Refused(f"systemctl {shown(verbs[0])} changes services")


def _service(args: list[str], ctx: Context, stdin: Stdin) -> None:
    if len(args) >= 2 and args[1] not in ("status", "--status-all"):
        raise Refused(f"service {shown(args[0])} {shown(args[1])} changes services")


def _crontab(args: list[str], ctx: Context, stdin: Stdin) -> None:
    opts = parse(args, {"-u"})
    if opts.operands or not opts.flags <= {"-l", "-u"}:
        raise Refused("crontab installs or removes scheduled commands")


def _kill(args: list[str], ctx: Context, stdin: Stdin) -> None:
    """`kill -9 -1` is every process, `kill 1` is init; `kill -1 PID` is SIGHUP to PID."""
    signal = False
    targets: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            targets += args[i + 1 :]
            break
        if a in ("-s", "-n", "--signal"):
            signal, i = True, i + 2
            continue
        if a.startswith("-") and not signal and a not in ("-l", "-L", "--list"):
            signal = True
        else:
            targets.append(a)
        i += 1
    if any(t in ("-1", "1") for t in targets) or (args and args[-1] in ("-1", "1")):
        raise Refused("kill of every process (or of init)")


# what keeps the machine reachable, scheduled and logged: killing one by name is a service change, like systemctl stop
SYSTEM_DAEMONS = frozenset({"init", "systemd", "sshd", "ssh", "cron", "crond", "atd", "rsyslogd", "syslogd",
                            "systemd-journald", "journald", "dbus-daemon", "dockerd", "containerd", "kubelet",
                            "udevd", "systemd-udevd", "auditd", "polkitd", "NetworkManager", "networkd",
                            "systemd-networkd", "systemd-logind"})  # fmt: skip


def _pkill(args: list[str], ctx: Context, stdin: Stdin) -> None:
    opts = parse(args, {"-u", "--euid", "-U", "--uid", "-g", "--pgroup", "-G", "--group", "-P", "--parent", "-s",
                        "--session", "-t", "--terminal", "--signal", "-F", "--pidfile", "-n", "-o"})  # fmt: skip
    if opts.has("-v", "--inverse") or any(o in (".", ".*", "", "^", "$", "^.*$", ".+") for o in opts.operands):
        raise Refused("kills every process")
    daemon = next((o for o in opts.operands if o.strip("^$") in SYSTEM_DAEMONS), None)
    if daemon is not None or "root" in opts.value("-u", "--euid", "-U", "--uid"):
        raise Refused(f"kills {'a system service (' + shown(daemon) + ')' if daemon else 'processes of root'}")


def _sysctl(args: list[str], ctx: Context, stdin: Stdin) -> None:
    if any(is_computed(a) or a in ("-w", "--write", "-p", "--load", "--system") or "=" in a for a in args):
        raise Refused("sysctl changes kernel settings")


def _containers(args: list[str], ctx: Context, stdin: Stdin) -> None:
    sub = next((a for a in args if not a.startswith("-")), "")
    if sub == "container":
        rest = args[args.index("container") + 1 :]
        sub = rest[0] if rest else ""
    if sub not in CONTAINER_RUNS:
        if sub == "cp":
            from glm5.parsing.shell.files import CHECKS

            CHECKS["cp"](args[args.index("cp") + 1 :], ctx, stdin)
        return
    for i, a in enumerate(args):
        name, eq, val = a.partition("=")
        val = val if eq else (args[i + 1] if i + 1 < len(args) else "")
        if a == "--privileged" or a.startswith(HOST_NAMESPACES) or name == "--cap-add":
            raise Refused(f"a privileged container ({a})")
        if name == "--security-opt" and re.search(r"unconfined|disable|no-new-privileges[:=]false", val):
            raise Refused(f"a container without confinement ({val})")
        if name == "--device" and (is_raw_disk(normalise(val.split(":")[0])) or val.startswith("/dev/mem")):
            raise Refused(f"a container with the host's disk ({val})")
        if name in ("-v", "--volume", "--mount"):
            source = val.split(":", 1)[0]
            if name == "--mount":
                source = next((p.split("=", 1)[1] for p in val.split(",") if p.startswith(("src=", "source="))), "")
            path = normalise(source, ctx.cwd)
            if source.startswith(("/", "~", "\ue009")) and (
                is_top(path) or within(path, PROTECTED) or covers(path, PROTECTED) or is_credential(path)
                or within(path, ("/var/run/docker.sock", "/run/docker.sock", "/run/containerd"))
            ):  # fmt: skip
                raise Refused(f"a container mounting the host's {shown(source)}")


def _journalctl(args: list[str], ctx: Context, stdin: Stdin) -> None:
    if any(a.startswith(("--vacuum", "--rotate", "--flush", "--relinquish-var")) for a in args):
        raise Refused("journalctl deletes or rotates the system logs")


def _dmesg(args: list[str], ctx: Context, stdin: Stdin) -> None:
    opts = parse(args, {"-n", "--console-level", "-f", "--facility", "-l", "--level", "-F", "--file"})
    if opts.has("-c", "-C", "--clear", "--read-clear", "-n", "--console-level", "-D", "--console-off", "-E",
                "--console-on"):  # fmt: skip
        raise Refused("dmesg clears the kernel log or changes console logging")


def _history(args: list[str], ctx: Context, stdin: Stdin) -> None:
    if any(a.startswith("-") and set(a[1:]) & set("cds") for a in args):
        raise Refused("history -c/-d/-s rewrites the shell history")


def _set(args: list[str], ctx: Context, stdin: Stdin) -> None:
    for i, a in enumerate(args):
        if a == "+o" and args[i + 1 : i + 2] == ["history"]:
            raise Refused("set +o history stops recording the shell history")


def _shopt(args: list[str], ctx: Context, stdin: Stdin) -> None:
    if "history" in args and any(a.startswith("-") and "u" in a for a in args):
        raise Refused("shopt -u history stops recording the shell history")


def _alias(args: list[str], ctx: Context, stdin: Stdin) -> None:
    for a in args:
        name, eq, val = a.partition("=")
        if eq:
            if is_computed(val):
                raise Refused(f"alias {name} is a command computed when it runs")
            ctx.judge.script(val, ctx.nested())


def _trap(args: list[str], ctx: Context, stdin: Stdin) -> None:
    words = [a for a in args if a not in ("-p", "-l", "--")]
    if len(words) >= 2 and words[0] not in ("-", ""):
        if is_computed(words[0]):
            raise Refused("trap runs a command computed when it runs")
        ctx.judge.script(words[0], ctx.nested())


def _enable(args: list[str], ctx: Context, stdin: Stdin) -> None:
    if any(a.startswith("-") and "f" in a for a in args):
        raise Refused("enable -f loads a shell builtin from a shared library")


def _hash(args: list[str], ctx: Context, stdin: Stdin) -> None:
    if any(a.startswith("-") and "p" in a for a in args):
        raise Refused("hash -p makes a command name run another file")


GDB_RUNS = re.compile(r"\s*(!|shell\b|pipe\b|\||python|py\b|pi\b|python-interactive|guile|gu\b|compile|source\b|"
                      r"set\s+exec-wrapper|jit-reader-load)|.*\b(system|popen|exec[lv]p?e?)\s*\(|.*[`$]\(")  # fmt: skip


def _gdb(args: list[str], ctx: Context, stdin: Stdin) -> None:
    """gdb's options are single-dash words (`-ex`, `-batch`), not letter clusters."""
    takes = {"-ex", "--ex", "-eval-command", "--eval-command", "-iex", "--iex", "-init-eval-command",
             "--init-eval-command", "-x", "--command", "-command", "-ix", "-p", "--pid", "-pid", "-c", "--core",
             "-core", "-cd", "--cd", "-d", "--directory", "-s", "--symbols", "-e", "--exec", "-se", "-b", "-i",
             "--interpreter", "-interpreter", "-tty", "--tty"}  # fmt: skip
    runs = {"-ex", "--ex", "-eval-command", "--eval-command", "-iex", "--iex", "-init-eval-command",
            "--init-eval-command"}  # fmt: skip
    if "--args" in args:
        at = args.index("--args")
        ctx.judge.argv(args[at + 1 :], ctx, Stdin())
        args = args[:at]
    operands: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        name, eq, val = a.partition("=")
        if name in takes:
            if not eq:
                val, i = (args[i + 1] if i + 1 < len(args) else ""), i + 1
            if name in runs and (is_computed(val) or GDB_RUNS.match(val)):
                raise Refused(f"gdb runs a command ({shown(val)})")
        elif not a.startswith("-"):
            operands.append(a)
        i += 1
    if operands:
        ctx.judge.argv(operands[:1], ctx, Stdin())
    for text in stdin.code:
        if text is None or any(GDB_RUNS.match(line) for line in text.splitlines()):
            raise Refused("gdb runs a command from its script")


VIM_RUNS = re.compile(
    r"(?i)^\s*:?\s*(sh|shell|py|pyt|pyx|python3?|py3|pythonx|lua|luado|luafile|perl|perldo|rub|"
    r"ruby|rubydo|rubyfile|mz|mzscheme|tcl|tcldo|tclfile|ter|term|terminal|call|exe|execute|so|"
    r"source|runtime|norm|normal|redir|let|au|autocmd|com|command|cal|!)|!|system|libcall|\\="
)


def vim_commands(args: list[str], ctx: Context) -> None:
    """`vim -c CMD`, `+CMD`, `--cmd CMD`: ex commands; `:!` and the interfaces to other languages run code."""
    cmds: list[str] = []
    for i, a in enumerate(args):
        if a in ("-c", "--cmd", "-S") and i + 1 < len(args):
            cmds.append(args[i + 1] if a != "-S" else "source " + args[i + 1])
        elif a.startswith("+") and len(a) > 1:
            cmds.append(a[1:])
    for cmd in cmds:
        if is_computed(cmd) or (not re.fullmatch(r"\d+|\$|/.*|\?.*", cmd) and VIM_RUNS.search(cmd)):
            raise Refused(f"the editor runs a command ({shown(cmd)})")
        m = re.match(r"\s*:?\s*(w|write|wq|x|sav|saveas|up|update)!?\s+(\S+)", cmd)
        if m is not None:
            from glm5.parsing.shell.files import check_writes

            check_writes([m.group(2)], ctx, "the editor writes to")


def _pager(args: list[str], ctx: Context, stdin: Stdin) -> None:
    for a in args:
        if a.startswith("+") and "!" in a:
            raise Refused(f"the pager runs a command ({shown(a)})")


def _man(args: list[str], ctx: Context, stdin: Stdin) -> None:
    opts = parse(args, {"-P", "--pager", "-H", "--html", "-B", "-E", "--encoding", "-M", "--manpath", "-S",
                        "--sections", "-L", "--locale", "-m", "--systems", "-C", "--config-file"})  # fmt: skip
    for cmd in opts.value("-P", "--pager", "-H", "--html", "-B"):
        if is_computed(cmd):
            raise Refused("man runs a pager computed when it runs")
        ctx.judge.script(cmd, ctx.nested())


def _kubectl(args: list[str], ctx: Context, stdin: Stdin) -> None:
    from glm5.parsing.shell.files import CHECKS

    if "cp" in args:
        CHECKS["cp"](args[args.index("cp") + 1 :], ctx, stdin)


def _zip(args: list[str], ctx: Context, stdin: Stdin) -> None:
    """`zip -TT CMD` / `--unzip-command CMD` tests the archive with a command of this one's choosing."""
    for i, a in enumerate(args):
        name, eq, val = a.partition("=")
        if name in ("-TT", "--unzip-command"):
            cmd = val if eq else (args[i + 1] if i + 1 < len(args) else "")
            if is_computed(cmd):
                raise Refused("zip -TT runs a command computed when it runs")
            ctx.judge.script(cmd, ctx.nested())


def _nmap(args: list[str], ctx: Context, stdin: Stdin) -> None:
    if "--interactive" in args:
        raise Refused("nmap --interactive runs commands typed into it")


CHECKS: dict[str, Check] = {
    "systemctl": _systemctl, "service": _service, "rc-service": _service, "crontab": _crontab, "kill": _kill,
    "pkill": _pkill, "killall": _pkill, "sysctl": _sysctl, "docker": _containers, "podman": _containers,
    "nerdctl": _containers, "journalctl": _journalctl, "dmesg": _dmesg, "history": _history, "set": _set,
    "shopt": _shopt, "alias": _alias, "trap": _trap, "enable": _enable, "hash": _hash, "gdb": _gdb,
    "less": _pager, "more": _pager, "most": _pager, "man": _man, "nmap": _nmap,
    "git": git.check, "kubectl": _kubectl, "zip": _zip,
}  # fmt: skip
