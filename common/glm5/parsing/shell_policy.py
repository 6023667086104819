"""The shell policy: judges a shell command a model wants a tool to run by what it would run, not by its text.

The command is parsed with tree-sitter's bash grammar (the parser GitHub uses; it reads all of bash, so only a
broken command fails to parse, and that is refused). Every simple command anywhere in it (pipelines, lists,
subshells, functions, command and process substitutions, `sh -c` strings and heredocs fed to shells, the
commands that `find -exec`, `xargs`, `env`, `timeout` and their kind run) is judged on its words after quote
removal: `r''m`, `"/"`, `\\rm` and `//` are what bash would make of them. A word bash computes at run time
(`$(...)`, `$VAR`) is unknown; an unknown command name is refused, and so is an unknown path where a known one
would matter (a recursive delete). What is refused: privilege tools; eval; code piped or substituted into an
interpreter (`curl | sh`, `base64 -d | bash`, `bash <(curl ...)`); recursive deletes, moves, ownership and mode
changes of / or a system or home directory; deleting or writing system files, cron, systemd, sudoers and shell
start-up files; raw writes to disks; formatting; setuid bits; reverse shells (/dev/tcp, nc -e); fork bombs;
power, account, firewall and kernel-module changes.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass

import tree_sitter_bash
from tree_sitter import Language, Node, Parser

_LANGUAGE = Language(tree_sitter_bash.language())
HOME = "~"  # $HOME, ${HOME} and ~ all read as this
MAX_DEPTH = 4  # `sh -c "sh -c ..."` nesting judged

SHELLS = {"sh", "bash", "zsh", "dash", "ksh", "mksh", "ash", "fish", "csh", "tcsh", "busybox"}
INTERPRETERS = SHELLS | {"python", "python2", "python3", "perl", "ruby", "node", "nodejs", "php", "lua", "tclsh",
                         "pwsh", "powershell", "osascript", "Rscript", "deno", "bun"}  # fmt: skip
PRIVILEGE = {"sudo", "su", "doas", "pkexec", "runuser", "sudoedit", "setpriv", "capsh", "chroot", "nsenter"}
FORBIDDEN = {  # name -> why
    **dict.fromkeys(["eval"], "runs a string as a command"),
    **dict.fromkeys(["chown", "chgrp"], "changes file ownership"),
    **dict.fromkeys(["fdisk", "sfdisk", "cfdisk", "parted", "wipefs", "mkswap", "mke2fs", "badblocks"],
                    "rewrites disks or partitions"),
    **dict.fromkeys(["shutdown", "reboot", "halt", "poweroff", "init", "telinit", "killall5"],
                    "stops or restarts the machine"),
    **dict.fromkeys(["useradd", "userdel", "usermod", "groupadd", "groupdel", "passwd", "chpasswd", "visudo",
                     "adduser", "deluser"], "changes accounts"),
    **dict.fromkeys(["iptables", "ip6tables", "nft", "ufw", "firewall-cmd"], "changes the firewall"),
    **dict.fromkeys(["insmod", "rmmod", "modprobe", "mount", "umount", "swapon", "swapoff"],
                    "changes the kernel or mounts"),
    **dict.fromkeys(["at", "batch"], "schedules commands"),
}  # fmt: skip
# wrappers that run the command in their arguments; the options of theirs that take a value
WRAPPERS = {"env": {"-u", "--unset", "-C", "--chdir", "-S"}, "nice": {"-n", "--adjustment"}, "nohup": set(),
            "timeout": {"-s", "--signal", "-k", "--kill-after"}, "stdbuf": {"-i", "-o", "-e"}, "setsid": set(),
            "time": set(), "command": set(), "builtin": set(), "exec": {"-a"}, "ionice": {"-c", "-n", "-p"},
            "taskset": set(), "chrt": set(), "unbuffer": set(), "xargs": {"-I", "-n", "-P", "-d", "-L", "-s", "-E",
                                                                          "-a", "--delimiter", "--max-args"},
            "flock": set(), "strace": {"-o", "-e", "-p"}, "ltrace": {"-o", "-e"}, "firejail": set()}  # fmt: skip
POSITIONAL_WRAPPERS = {"timeout": 1, "taskset": 1, "chrt": 1, "flock": 1}  # leading values before the command
SYSTEM_DIRS = {"/etc", "/usr", "/bin", "/sbin", "/boot", "/lib", "/lib32", "/lib64", "/libx32", "/var", "/sys",
               "/proc", "/dev", "/root", "/home", "/opt", "/srv", "/snap", "/run", "/mnt", "/media"}  # fmt: skip
PROTECTED = ("/etc", "/boot", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/sys", "/proc",
             "/root", "/var/spool", "/var/lib", "/var/log", "/dev", "~/.ssh", "~/.bashrc", "~/.bash_profile",
             "~/.bash_login", "~/.profile", "~/.zshrc", "~/.zprofile", "~/.config/autostart", "~/.config/systemd",
             "~/.local/share/systemd", "~/.gnupg", "~/.kube", "~/.aws", "~/.docker")  # fmt: skip
HARMLESS_DEVICES = {"/dev/null", "/dev/zero", "/dev/stdout", "/dev/stderr", "/dev/stdin", "/dev/tty",
                    "/dev/random", "/dev/urandom", "/dev/full"}  # fmt: skip
SYSTEMCTL_CHANGES = {"enable", "disable", "mask", "unmask", "start", "stop", "restart", "reload", "daemon-reload",
                     "edit", "link", "set-default", "isolate", "kill", "poweroff", "reboot", "halt"}  # fmt: skip


class Refused(Exception):
    """The command does something the policy forbids; the message says what."""


@dataclass
class _Context:
    depth: int = 0
    cwd: str | None = None  # known after a static `cd`


def violation(command: str) -> str | None:
    """Why `command` is refused, or None when the policy lets it run."""
    try:
        _judge(command, _Context())
    except Refused as exc:
        return str(exc)
    return None


def _judge(command: str, ctx: _Context) -> None:
    if ctx.depth > MAX_DEPTH:
        raise Refused("shell commands nested too deeply to judge")
    tree = Parser(_LANGUAGE).parse(command.encode())
    if tree.root_node.has_error:
        raise Refused("the command cannot be parsed as shell")
    for node in _walk(tree.root_node):
        if node.type == "function_definition":
            _function(node)
        elif node.type == "command":
            _command(node, ctx)
        elif node.type in ("file_redirect", "herestring_redirect"):
            _redirect(node, ctx)


def _text(node: Node) -> str:
    return node.text.decode(errors="replace") if node.text is not None else ""


def _walk(node: Node) -> Iterator[Node]:
    yield node
    for child in node.children:
        yield from _walk(child)


# -- words ----------------------------------------------------------------------------------------------------


def _value(node: Node) -> str | None:
    """A word after quote removal, or None when bash computes it at run time. $HOME / ~ read as HOME."""
    text = _text(node)
    kind = node.type
    if kind in ("word", "number"):
        return None if "`" in text else re.sub(r"\\(.)", r"\1", text, flags=re.S)
    if kind == "raw_string":
        return text[1:-1]
    if kind == "ansi_c_string":
        try:
            return text[2:-1].encode("latin-1", "backslashreplace").decode("unicode_escape")
        except UnicodeDecodeError:
            return None
    if kind in ("string", "concatenation", "translated_string"):
        parts = []
        for child in node.children:
            if child.type in ('"', "$"):
                continue
            if child.type == "string_content":
                parts.append(re.sub(r"\\([$`\"\\\n])", r"\1", _text(child)))
                continue
            value = _value(child)
            if value is None:
                return None
            parts.append(value)
        return "".join(parts)
    if kind in ("simple_expansion", "expansion"):
        names = [c.text.decode() for c in node.children if c.type == "variable_name" and c.text is not None]
        if names == ["HOME"] and len(node.children) <= 4:
            return HOME
        return None
    return None  # command/process substitution, arithmetic, brace expressions: known only when it runs


def _path(word: str | None, ctx: _Context) -> str | None:
    """A path as the filesystem sees it: ~ and $HOME as HOME, `//` and `/./` collapsed, `..` applied; relative
    paths against a known working directory (None when it cannot be known)."""
    if word is None:
        return None
    if word == "~" or word.startswith("~/"):
        word = HOME + word[1:]
    elif not word.startswith("/") and ctx.cwd is not None:
        word = f"{ctx.cwd}/{word}"
    if not word.startswith(("/", HOME)):
        return word  # relative to an unknown directory
    prefix, rest = (HOME, word[len(HOME):]) if word.startswith(HOME) else ("", word)  # fmt: skip
    rest = posixpath.normpath("/" + re.sub(r"/+", "/", rest))
    rest = "/" + rest.lstrip("/")
    return prefix + (rest if rest != "/" or not prefix else "")


def _is_top(path: str | None) -> bool:
    """/, HOME, a system directory, or everything in one (`/*`, `/etc/*`)."""
    if path is None:
        return False
    path = path.removesuffix("/*").removesuffix("*") or "/"
    path = path.rstrip("/") or "/"
    return path in ("/", HOME) or path in SYSTEM_DIRS


def _is_protected(path: str | None) -> bool:
    if path is None:
        return False
    if path in HARMLESS_DEVICES or path.startswith(("/dev/fd/", "/dev/shm/", "/proc/self/fd/")):
        return False
    return _is_top(path) or any(path == p or path.startswith(p + "/") for p in PROTECTED)


# -- commands -------------------------------------------------------------------------------------------------


def _command(node: Node, ctx: _Context) -> None:
    name_node = node.child_by_field_name("name")
    if name_node is None:
        return  # only assignments
    words = [_value(name_node.children[0] if name_node.children else name_node)]
    words += [_value(c) for c in node.children_by_field_name("argument")]
    nodes = [name_node, *node.children_by_field_name("argument")]
    if any(n.type == "process_substitution" or any(d.type == "process_substitution" for d in _walk(n))
           for n in nodes[1:]):  # fmt: skip
        _no_code_from_substitution(words)
    _simple(words, ctx, piped=_piped(node), stdin=_stdin_code(node))


def _piped(node: Node) -> bool:
    """A later stage of a pipeline: its standard input is another command's output."""
    parent = node.parent
    while parent is not None and parent.type == "redirected_statement":
        node, parent = parent, parent.parent
    if parent is None or parent.type != "pipeline":
        return False
    before = parent.children[: list(parent.children).index(node)]
    return any(c.type in ("|", "|&") for c in before)


def _stdin_code(node: Node) -> list[str | None]:
    """What heredocs and here-strings feed the command (None: computed at run time)."""
    out: list[str | None] = []
    holders = [node] + ([node.parent] if node.parent is not None and node.parent.type == "redirected_statement" else [])
    for holder in holders:
        for child in holder.children:
            if child.type == "file_redirect" and any(c.type == "<" for c in child.children):
                dest = child.child_by_field_name("destination")
                if dest is not None and _value(dest) is None:  # `sh < <(curl ...)`; a plain file is a script
                    out.append(None)
            elif child.type == "herestring_redirect":
                out += [_value(c) for c in child.children if c.type != "<<<"]
            elif child.type == "heredoc_redirect":
                body = next((c for c in child.children if c.type == "heredoc_body"), None)
                if body is not None:
                    dynamic = any(c.type in ("expansion", "simple_expansion", "command_substitution")
                                  for c in body.children)  # fmt: skip
                    quoted = any(c.type == "heredoc_start" and c.text and c.text[:1] in b"'\"" for c in child.children)
                    out.append(None if dynamic and not quoted else _text(body))
    return out


def _no_code_from_substitution(words: list[str | None]) -> None:
    name = posixpath.basename(words[0] or "")
    if name in INTERPRETERS or name in ("source", "."):
        raise Refused(f"{name} would run code produced by another command (process substitution)")


def _simple(words: list[str | None], ctx: _Context, piped: bool = False, stdin: list[str | None] | None = None) -> None:
    """Judges one simple command from its words."""
    stdin = stdin or []
    if not words:
        return
    if words[0] is None:
        raise Refused("the command name is computed when it runs (a substitution or variable)")
    name = posixpath.basename(words[0])
    args = words[1:]
    if name in WRAPPERS:
        _simple(_unwrap(name, args), ctx, piped or name == "xargs", stdin)
        return
    if name in PRIVILEGE:
        raise Refused(f"{name} runs commands with other privileges")
    if name in FORBIDDEN:
        raise Refused(f"{name} {FORBIDDEN[name]}")
    if name.startswith("mkfs"):
        raise Refused(f"{name} formats a filesystem")
    if name in INTERPRETERS:
        _interpreter(name, args, ctx, piped, stdin)
    elif name in ("source", "."):
        if not args or args[0] is None:
            raise Refused(f"{name} runs a file chosen when the command runs")
    elif name == "cd":
        _cd(args, ctx)
    else:
        check = CHECKS.get(name)
        if check is not None:
            check(args, ctx, piped)


def _unwrap(name: str, args: list[str | None]) -> list[str | None]:
    """The command a wrapper runs; for xargs, with its input lines as run-time arguments."""
    takes_value = WRAPPERS[name]
    positional = POSITIONAL_WRAPPERS.get(name, 0)
    i = 0
    while i < len(args):
        a = args[i]
        if a is not None and name == "env" and "=" in a and not a.startswith("-"):
            i += 1
        elif a is not None and a.startswith("-") and a != "-":
            i += 2 if a in takes_value else 1
            if a == "--":
                break
        elif positional:
            positional -= 1
            i += 1
        else:
            break
    rest = args[i:]
    if name == "xargs":
        return [*(rest or ["echo"]), None]  # the input's words, known only when it runs
    return rest


def _interpreter(name: str, args: list[str | None], ctx: _Context, piped: bool, stdin: list[str | None]) -> None:
    is_shell = name in SHELLS
    code_flag = {"-c"} if is_shell else {"-c", "-e", "-E", "--eval", "-r", "--command", "-Command"}
    options = [a for a in args if a is not None and a.startswith("-") and a != "-"]
    for i, a in enumerate(args):
        if a in code_flag:
            code = args[i + 1] if i + 1 < len(args) else None
            if code is None:
                raise Refused(f"{name} {a} runs code that is computed when the command runs")
            if is_shell:
                _judge(code, _Context(ctx.depth + 1, ctx.cwd))
            return
        if a is None:
            raise Refused(f"{name} runs a script chosen when the command runs")
        if not a.startswith("-") or a == "-":
            if a == "-" and piped:
                break
            return  # a script file: what it does is not in this command
    if name == "busybox" and not options and not args:
        return
    if piped:
        raise Refused(f"{name} would run code piped into it")
    for code in stdin:
        if code is None:
            raise Refused(f"{name} would run code computed when the command runs")
        if is_shell:
            _judge(code, _Context(ctx.depth + 1, ctx.cwd))


def _cd(args: list[str | None], ctx: _Context) -> None:
    target = [a for a in args if a is None or not a.startswith("-")]
    if not target:
        ctx.cwd = HOME
        return
    path = _path(target[0], ctx)
    ctx.cwd = path if path is not None and path.startswith(("/", HOME)) else None


def _operands(args: list[str | None]) -> tuple[set[str], list[str | None]]:
    """Options (long ones whole, short ones split into letters) and operands, `--` ending the options."""
    flags: set[str] = set()
    operands: list[str | None] = []
    ended = False
    for a in args:
        if ended or a is None or not a.startswith("-") or a == "-":
            operands.append(a)
        elif a == "--":
            ended = True
        elif a.startswith("--"):
            flags.add(a.split("=", 1)[0])
        else:
            flags.update(f"-{c}" for c in a[1:])
    return flags, operands


def _rm(args: list[str | None], ctx: _Context, piped: bool) -> None:
    flags, targets = _operands(args)
    recursive = bool(flags & {"-r", "-R", "--recursive", "--dir", "-d"})
    if "--no-preserve-root" in flags:
        raise Refused("rm --no-preserve-root deletes /")
    for t in targets:
        path = _path(t, ctx)
        if path is None and recursive:
            raise Refused("recursive delete of a path computed when the command runs")
        if recursive and _is_top(path):
            raise Refused(f"recursive delete of {path}")
        if _is_protected(path):
            raise Refused(f"deletes {path}, a system or start-up file")


def _find(args: list[str | None], ctx: _Context, piped: bool) -> None:
    starts: list[str | None] = []
    i = 0
    while i < len(args) and (args[i] is None or not args[i].startswith(("-", "(", "!"))):  # type: ignore[union-attr]
        starts.append(args[i])
        i += 1
    starts = starts or ["."]
    roots = [_path(s, ctx) for s in starts]
    expr = args[i:]
    if "-delete" in expr:
        for root in roots:
            if root is None or _is_top(root) or _is_protected(root):
                raise Refused(f"find -delete under {root or 'a path computed when the command runs'}")
    for j, a in enumerate(expr):
        if a in ("-exec", "-execdir", "-ok", "-okdir"):
            end = next((k for k in range(j + 1, len(expr)) if expr[k] in (";", "+")), len(expr))
            for root in roots:  # `{}` may be the starting directory itself
                _simple([root if w == "{}" else w for w in expr[j + 1 : end]], ctx)


def _chmod(args: list[str | None], ctx: _Context, piped: bool) -> None:
    flags, operands = _operands(args)
    mode, paths = (operands[0], operands[1:]) if operands else (None, [])
    # `u+s`, `g=rxs`, or four octal digits whose first sets setuid (4) or setgid (2)
    if mode is None or re.search(r"[+=][rwxXt]*s", mode) or re.fullmatch(r"0*[2-7][0-7]{3}", mode):
        raise Refused("chmod sets setuid/setgid bits (or a mode computed when it runs)")
    for p in paths:
        path = _path(p, ctx)
        if (
            _is_top(path)
            or (_is_protected(path) and _loosens(mode))
            or (path is None and {"-R", "--recursive"} & flags)
        ):
            raise Refused(f"chmod of {path or 'a path computed when the command runs'}")


def _chattr(args: list[str | None], ctx: _Context, piped: bool) -> None:
    for p in _operands(args)[1][1:]:
        path = _path(p, ctx)
        if path is None or _is_top(path) or _is_protected(path):
            raise Refused(f"chattr of {path or 'a path computed when the command runs'}")


def _loosens(mode: str) -> bool:
    """The mode lets group or others write (chmod 644 ~/.ssh/config tightens; 666 /etc/shadow loosens)."""
    if re.fullmatch(r"[0-7]{3,4}", mode):
        return any(int(d) & 2 for d in mode[-2:])
    for clause in mode.split(","):
        m = re.match(r"([ugoa]*)([-+=])([rwxXst]*)", clause)
        if m and m.group(2) in "+=" and "w" in m.group(3) and (not m.group(1) or set(m.group(1)) & set("goa")):
            return True
    return False


def _writes(dest: list[str | None], ctx: _Context, what: str) -> None:
    for d in dest:
        path = _path(d, ctx)
        if _is_protected(path) or (path is not None and path.startswith(("/dev/tcp/", "/dev/udp/"))):
            raise Refused(f"{what} {path}")


def _copy(args: list[str | None], ctx: _Context, piped: bool) -> None:
    operands = _operands(args)[1]
    if not operands:
        return
    dest = [operands[-1]]
    for i, a in enumerate(args):
        if a in ("-t", "--target-directory") and i + 1 < len(args):
            dest = [args[i + 1]]
        elif a is not None and a.startswith("--target-directory="):
            dest = [a.split("=", 1)[1]]
    _writes(dest, ctx, "writes to")


def _mv(args: list[str | None], ctx: _Context, piped: bool) -> None:
    _copy(args, ctx, piped)
    _, operands = _operands(args)
    for src in operands[:-1]:
        path = _path(src, ctx)
        if _is_top(path) or _is_protected(path):
            raise Refused(f"moves {path}")


def _tee(args: list[str | None], ctx: _Context, piped: bool) -> None:
    _writes(_operands(args)[1], ctx, "writes to")


def _dd(args: list[str | None], ctx: _Context, piped: bool) -> None:
    for a in args:
        if a is None:
            continue
        if a.startswith("of="):
            _writes([a[3:]], ctx, "dd writes to")


def _shred(args: list[str | None], ctx: _Context, piped: bool) -> None:
    for p in _operands(args)[1]:
        path = _path(p, ctx)
        if path is None or _is_protected(path) or path.startswith("/dev/"):
            raise Refused(f"destroys {path or 'a path computed when the command runs'}")


def _crontab(args: list[str | None], ctx: _Context, piped: bool) -> None:
    flags, operands = _operands(args)
    if operands or not flags <= {"-l", "-u"}:
        raise Refused("crontab installs or removes scheduled commands")


def _systemctl(args: list[str | None], ctx: _Context, piped: bool) -> None:
    verbs = [a for a in _operands(args)[1]]
    if verbs and (verbs[0] is None or verbs[0] in SYSTEMCTL_CHANGES):
        raise Refused(f"systemctl {verbs[0] or '...'} changes services")


def _kill(args: list[str | None], ctx: _Context, piped: bool) -> None:
    # the targets come last: `kill -9 -1` is every process, `kill 1` is init (`kill -1 PID` is SIGHUP to PID)
    if args and args[-1] in ("-1", "1"):
        raise Refused("kill of every process (or of init)")


def _netcat(args: list[str | None], ctx: _Context, piped: bool) -> None:
    flags, _ = _operands(args)
    if flags & {"-e", "-c", "--exec", "--sh-exec", "--lua-exec"}:
        raise Refused("a network listener that runs a shell (reverse shell)")


def _socat(args: list[str | None], ctx: _Context, piped: bool) -> None:
    if any(a is None or re.match(r"(?i)(exec|system):", a) for a in args):
        raise Refused("socat running a command (reverse shell)")


def _download(args: list[str | None], ctx: _Context, piped: bool) -> None:
    for i, a in enumerate(args):
        if a in ("-o", "--output", "-O", "--output-document") and i + 1 < len(args):
            _writes([args[i + 1]], ctx, "downloads into")
        elif a is not None and a.startswith(("--output=", "--output-document=")):
            _writes([a.split("=", 1)[1]], ctx, "downloads into")


def _containers(args: list[str | None], ctx: _Context, piped: bool) -> None:
    for i, a in enumerate(args):
        if a is None:
            continue
        if a == "--privileged" or a.startswith("--pid=host"):
            raise Refused("a privileged container")
        if a in ("-v", "--volume", "--mount") and i + 1 < len(args):
            mount = args[i + 1] or ""
            if mount.split(":", 1)[0] in ("/", "/etc", "/root", "/var/run/docker.sock") or "src=/," in mount:
                raise Refused(f"a container mounting {mount.split(':', 1)[0]}")


def _sysctl(args: list[str | None], ctx: _Context, piped: bool) -> None:
    if any(a is None or a == "-w" or (a is not None and "=" in a) for a in args):
        raise Refused("sysctl changes kernel settings")


def _truncate(args: list[str | None], ctx: _Context, piped: bool) -> None:
    _writes(_operands(args)[1], ctx, "truncates")


CHECKS = {
    "rm": _rm, "unlink": _rm, "rmdir": _rm, "find": _find, "chmod": _chmod, "cp": _copy, "install": _copy,
    "ln": _copy, "rsync": _copy, "scp": _copy, "mv": _mv, "tee": _tee, "dd": _dd, "shred": _shred,
    "crontab": _crontab, "systemctl": _systemctl, "kill": _kill, "nc": _netcat, "ncat": _netcat,
    "netcat": _netcat, "socat": _socat, "curl": _download, "wget": _download, "docker": _containers,
    "podman": _containers, "sysctl": _sysctl, "truncate": _truncate, "chattr": _chattr,
}  # fmt: skip


def _redirect(node: Node, ctx: _Context) -> None:
    dest = node.child_by_field_name("destination")
    if dest is None:
        return
    op = next((c.type for c in node.children if c.type in (">", ">>", ">|", "&>", "&>>", "<>", ">&", "<", "<&")), "")
    value = _value(dest)
    path = _path(value, ctx)
    if path is not None and path.startswith(("/dev/tcp/", "/dev/udp/")):
        raise Refused("a network connection as a file (/dev/tcp): a reverse shell")
    if op in ("<", "<&"):
        return
    if _is_protected(path):
        raise Refused(f"writes to {path}")


def _function(node: Node) -> None:
    """A function that calls itself in a pipeline or in the background is a fork bomb."""
    name_node = node.child_by_field_name("name")
    name = _value(name_node) if name_node is not None else None
    body = node.child_by_field_name("body")
    if name is None or body is None:
        return
    for call in _walk(body):
        called = call.child_by_field_name("name") if call.type == "command" else None
        if called is None or called.text is None or called.text.decode() != name:
            continue
        parent = call.parent
        while parent is not None and parent != node:
            if parent.type == "pipeline" or any(c.type == "&" for c in parent.children):
                raise Refused("a fork bomb (a function that starts copies of itself)")
            parent = parent.parent
