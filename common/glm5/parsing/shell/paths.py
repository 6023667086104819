"""Which paths a word may name, and the paths the policy protects.

A path is judged as a pattern (words.py): a glob or brace names every path it matches, text computed at run time
names anything from where it starts, the output of `find DIR` names DIR and everything below it. The three
questions asked of it: may it name a path inside a protected tree (a write, a delete); may it name a protected
path or a directory holding one (a recursive delete, a move, a recursive mode change); may it name a file that
holds credentials, a raw disk.
"""

from __future__ import annotations

import re
from functools import lru_cache

from glm5.parsing.shell.words import BRACKET, COMPUTED, DESCENDANTS, GLOBS, HOME, QUESTION, STAR, UNKNOWN, shown

Path = tuple[str, tuple[str, ...]]  # root ("/", HOME, "" relative to the start, "?" computed) and segments
_Token = tuple[str, str]  # ("lit", text) | ("re", pattern) | ("any", "")

TOP = ("/", "~", "/etc", "/usr", "/bin", "/sbin", "/boot", "/lib", "/lib32", "/lib64", "/libx32", "/var", "/sys",
       "/proc", "/dev", "/root", "/home", "/opt", "/srv", "/snap", "/run", "/mnt", "/media", "/usr/local",
       "/var/lib", "/var/log")  # fmt: skip
SYSTEM = ("/etc", "/boot", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/sys", "/proc", "/root",
          "/var/spool", "/var/lib", "/var/log", "/var/mail", "/var/backups", "/dev", "/snap", "/run/systemd",
          "/var/run/systemd", "/vmlinuz", "/initrd.img")  # fmt: skip
HOME_FILES = (".ssh", ".bashrc", ".bash_profile", ".bash_login", ".bash_logout", ".profile", ".zshrc", ".zshenv",
              ".zprofile", ".zlogin", ".zlogout", ".kshrc", ".mkshrc", ".cshrc", ".tcshrc", ".login", ".logout",
              ".config/fish", ".config/autostart", ".config/systemd", ".config/environment.d",
              ".local/share/systemd", ".pam_environment", ".xinitrc", ".xprofile", ".xsession", ".xsessionrc",
              ".gnupg", ".kube", ".aws", ".docker", ".azure", ".config/gcloud", ".gitconfig", ".config/git",
              ".netrc", ".git-credentials", ".npmrc", ".pypirc", ".pgpass", ".my.cnf", ".vault-token",
              ".terraform.d", ".config/gh", ".password-store", ".local/share/keyrings", ".bash_history",
              ".zsh_history", ".history", ".sh_history", ".zhistory", ".python_history", ".mysql_history",
              ".psql_history", ".node_repl_history", ".lesshst", ".local/share/fish", ".vimrc", ".vim",
              ".config/nvim", ".emacs", ".emacs.d", ".tmux.conf", ".screenrc", ".Xauthority")  # fmt: skip
PROTECTED = SYSTEM + tuple(f"~/{f}" for f in HOME_FILES)
WRITABLE = ("/dev/null", "/dev/zero", "/dev/stdout", "/dev/stderr", "/dev/stdin", "/dev/tty", "/dev/random",
            "/dev/urandom", "/dev/full", "/dev/fd", "/dev/shm", "/dev/pts", "/proc/self/fd", "/dev/ptmx",
            "~/.ssh/known_hosts", "~/.ssh/known_hosts.old")  # fmt: skip
CREDENTIALS = ("~/.ssh", "~/.aws", "~/.kube", "~/.docker/config.json", "~/.netrc", "~/.git-credentials", "~/.gnupg",
               "~/.config/gcloud", "~/.azure", "~/.npmrc", "~/.pypirc", "~/.pgpass", "~/.my.cnf", "~/.vault-token",
               "~/.terraform.d", "~/.config/gh", "~/.password-store", "~/.local/share/keyrings", "/etc/shadow",
               "/etc/gshadow", "/etc/ssl/private", "/root", "/var/run/secrets", "/run/secrets")  # fmt: skip
NOT_SECRET = re.compile(r".*\.pub|known_hosts.*|authorized_keys.*|config")  # in ~/.ssh
KEY_FILE = re.compile(r"(id_(rsa|dsa|ecdsa|ed25519)(_sk)?|ssh_host_\w+_key)")
RAW_DISKS = ("sda", "sdb1", "hda", "vda", "xvda", "nvme0n1", "nvme0n1p1", "mmcblk0", "mmcblk0p1", "md0", "md/0",
             "dm-0", "mapper/root", "loop0", "disk/by-id/x", "sr0", "nbd0", "rbd0", "zd0", "mem", "kmem", "port",
             "sg0", "bsg/0", "mtd0", "ubda", "ram0")  # fmt: skip


def normalise(word: str, cwd: str | None = None) -> Path:
    """`~`, `~user`, $HOME and /home/USER as HOME; `//`, `/./` and `..` applied; a relative path against a known
    working directory."""
    if word.startswith("~"):
        name, _, rest = word[1:].partition("/")
        base = HOME if name not in ("+", "-") else UNKNOWN if name == "-" else cwd or "."
        word = base + "/" + rest
    if word.startswith(HOME):
        root, rest = HOME, word[1:]
    elif word.startswith("/"):
        root, rest = "/", word
    elif word[:1] in COMPUTED:
        root, rest = "?", word
    elif cwd is not None:
        base_root, base_segments = normalise(cwd)
        return _normalised(base_root, [*base_segments, *word.split("/")])
    else:
        root, rest = "", word
    return _normalised(root, rest.split("/"))


def _normalised(root: str, parts: list[str]) -> Path:
    segments: list[str] = []
    for part in parts:
        if part in ("", "."):
            continue
        if part == ".." and segments and segments[-1] != "..":
            segments.pop()
        elif part == ".." and root == HOME:
            root, segments = "/", ["home"]
        elif part == ".." and root in ("/", "?"):
            continue
        else:
            segments.append(part)
    if root == "/" and len(segments) >= 2 and segments[0] in ("home", "Users"):
        root, segments = HOME, segments[2:]
    return root, tuple(segments)


def display(path: Path) -> str:
    root, segments = path
    head = {"/": "/", HOME: "~/", "": "", "?": "…/"}[root]
    return shown(head + "/".join(segments)).rstrip("/") or ("~" if root == HOME else "/" if root == "/" else ".")


@lru_cache(maxsize=256)
def _entry(text: str) -> Path:
    return normalise(HOME + text[1:] if text.startswith("~") else text)


def _tokens(segments: tuple[str, ...]) -> tuple[_Token, ...]:
    out: list[_Token] = []
    for seg in segments:
        if seg == DESCENDANTS or any(m in seg for m in COMPUTED):
            out.append(("any", ""))
        elif any(m in seg for m in GLOBS):
            out.append(("re", _segment_regex(seg)))
        else:
            out.append(("lit", seg))
    return tuple(out)


def _segment_regex(seg: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(seg):
        c = seg[i]
        if c == STAR:
            out.append("[^/]*")
        elif c == QUESTION:
            out.append("[^/]")
        elif c == BRACKET:
            end = seg.find("]", i + 2)
            if end < 0:
                out.append(re.escape("["))
            else:
                body = seg[i + 1 : end].replace("\\", "\\\\")
                out.append("[" + ("^" + body[1:] if body[:1] in "!^" else body) + "]")
                i = end
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


@lru_cache(maxsize=4096)
def _match(pattern: tuple[_Token, ...], target: tuple[str, ...], mode: str) -> bool:
    """mode "equal": the pattern may name target; "inside": target or below it; "covers": target or above it."""
    if not target:
        return mode == "inside" or all(kind == "any" for kind, _ in pattern)
    if not pattern:
        return mode == "covers"
    (kind, body), rest = pattern[0], pattern[1:]
    if kind == "any":
        return _match(rest, target, mode) or _match(pattern, target[1:], mode) or mode == "inside"
    if kind == "lit" and body != target[0]:
        return False
    if kind == "re" and not re.fullmatch(body, target[0]):
        return False
    return _match(rest, target[1:], mode)


def _may(path: Path, entries: tuple[str, ...], mode: str) -> bool:
    root, segments = path
    tokens = _tokens(segments)
    for text in entries:
        e_root, e_segments = _entry(text)
        if root == "?":
            if _match((("any", ""), *tokens), e_segments, mode):
                return True
        elif root == e_root and _match(tokens, e_segments, mode):
            return True
    return False


def names(path: Path, entries: tuple[str, ...]) -> bool:
    return _may(path, entries, "equal")


def within(path: Path, entries: tuple[str, ...]) -> bool:
    return _may(path, entries, "inside")


def covers(path: Path, entries: tuple[str, ...]) -> bool:
    return _may(path, entries, "covers")


def is_exact(path: Path) -> bool:
    return not any(any(m in seg for m in (*COMPUTED, *GLOBS)) for seg in path[1]) and path[0] != "?"


def is_protected(path: Path) -> bool:
    """A write or delete here changes the system, a start-up file, credentials or history, or a git repository's
    hooks or settings (which run commands)."""
    root, segments = path
    for i in range(len(segments) - 1):
        if segments[i] == ".git" and segments[i + 1] in ("hooks", "config"):
            return True
    if root == "?" or not within(path, PROTECTED):
        return False
    return not (is_exact(path) and within(path, WRITABLE))


def is_top(path: Path) -> bool:
    """A recursive delete, move or mode change here reaches a protected path: / or home, a system directory, a
    directory above a protected path, or everything in one of them (`/opt/*`)."""
    if covers(path, TOP) or covers(path, PROTECTED) or within(path, PROTECTED):
        return True
    root, segments = path
    if segments and _tokens(segments[-1:])[0][0] != "lit" and names((root, segments[:-1]), TOP):
        return True
    tokens = _tokens(segments)
    literal_part = [s for s, (kind, _) in zip(segments, tokens, strict=True) if kind == "lit"]
    globbed_tail = all(kind != "lit" for kind, _ in tokens[len(literal_part) :])
    # a directory above the one it starts in (`..`, `../../*`): the project and what holds it
    return root == "" and bool(literal_part) and all(s == ".." for s in literal_part) and globbed_tail


def is_credential(path: Path) -> bool:
    """A file holding keys, tokens or passwords (a path computed at run time is not judged as one)."""
    root, segments = path
    if root == "?":
        return False
    name = segments[-1] if segments else ""
    if root == "/" and segments[:2] == ("etc", "ssh"):
        return len(segments) == 2 or not is_exact(path) or bool(KEY_FILE.fullmatch(name))
    if within(path, CREDENTIALS):
        in_ssh = root == HOME and segments[:1] == (".ssh",) and len(segments) >= 2
        return not (in_ssh and is_exact(path) and NOT_SECRET.fullmatch(name))
    if root == "/" and len(segments) == 3 and segments[0] == "proc" and segments[2] == "environ":
        return True
    return bool(KEY_FILE.fullmatch(name))


def is_raw_disk(path: Path) -> bool:
    return path[0] == "/" and any(names(path, (f"/dev/{d}",)) for d in RAW_DISKS)


def is_network_device(path: Path) -> bool:
    return path[0] == "/" and path[1][:1] == ("dev",) and path[1][1:2] in (("tcp",), ("udp",))
