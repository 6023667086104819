"""Network tools: reverse shells (`nc -e`, `socat exec:`), downloads (what they write, so that running one later is
refused), ssh options that run a local command, and the credential files a command line reads, which may not
meet a network tool in the same command line."""

from __future__ import annotations

import posixpath
import re

from glm5.parsing.shell.context import Context, Refused, Stdin
from glm5.parsing.shell.files import Check, check_writes
from glm5.parsing.shell.names import DOWNLOADERS, NETWORK
from glm5.parsing.shell.options import parse
from glm5.parsing.shell.paths import is_credential, is_protected, normalise
from glm5.parsing.shell.words import HOME, SPLIT, is_computed, literal, shown

DOWNLOAD_NAMES = DOWNLOADERS
DOWNLOADED = [SPLIT + "downloaded"]  # what a download prints: unknown, and known to be a download
# commands that name a credential file without reading it out
METADATA = {"chmod", "chown", "chgrp", "ls", "stat", "test", "[", "[[", "mkdir", "touch", "file", "ssh-add",
            "ssh-keygen", "rm", "wc", "du", "realpath", "readlink", "dirname", "basename", "cd", "pushd",
            "setfacl", "getfacl", "lsattr", "chattr", "namei", "echo"}  # fmt: skip
SSH_OPTION_VALUES = {"-i", "-F", "-o", "-J", "-l", "-p", "-P", "-S", "-c", "-b", "-E", "-L", "-R", "-D", "-W"}
SSH_RUNS = re.compile(r"(?i)(proxycommand|localcommand|knownhostscommand)\s*[= ]\s*(.*)")
CURL_TAKES = {"-o", "--output", "--output-dir", "-d", "--data", "--data-binary", "--data-raw", "--data-ascii",
              "--data-urlencode", "-F", "--form", "-H", "--header", "-u", "--user", "-X", "--request", "-T",
              "--upload-file", "-K", "--config", "-e", "--referer", "-A", "--user-agent", "-b", "--cookie", "-c",
              "--cookie-jar", "-D", "--dump-header", "--trace", "--trace-ascii", "--stderr", "-w", "--write-out",
              "-x", "--proxy", "--cacert", "--cert", "--key", "-E", "-m", "--max-time", "--connect-timeout", "-r",
              "--range", "-C", "--continue-at", "-y", "-Y", "-z", "--retry", "--max-filesize", "--limit-rate",
              "--resolve", "--interface", "--etag-save", "--hsts", "--alt-svc", "-U", "--proxy-user",
              "--url"}  # fmt: skip
WGET_TAKES = {"-O", "--output-document", "-P", "--directory-prefix", "-o", "--output-file", "-a", "--append-output",
              "-i", "--input-file", "-e", "--execute", "-U", "--user-agent", "--header", "--post-data",
              "--post-file", "--body-file", "--body-data", "--method", "-t", "--tries", "-T", "--timeout", "-Q",
              "--quota", "-l", "--level", "--user", "--password", "--load-cookies", "--save-cookies", "-A",
              "--accept", "-R", "--reject", "-D", "--domains", "-w", "--wait", "-B", "--base", "--ca-certificate",
              "--certificate", "--private-key"}  # fmt: skip


def mentions(name: str, args: list[str], ctx: Context) -> None:
    """Credential files among a command's words (`curl -F f=@~/.ssh/id_rsa`, `tar c ~/.aws | nc ...`)."""
    if name in NETWORK and ctx.cwd is not None and is_credential(normalise(ctx.cwd)):
        ctx.facts.credentials.append(shown(ctx.cwd))
    if name in METADATA:
        return
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if name in ("ssh", "scp", "sftp", "ssh-copy-id", "sshfs") and a in SSH_OPTION_VALUES:
            skip = True
            continue
        if name in ("curl", "wget") and a in ("--cert", "--key", "-E", "--cacert", "--private-key", "--certificate"):
            skip = True
            continue
        for piece in _embedded(a):
            if is_credential(normalise(piece, ctx.cwd)):
                ctx.facts.credentials.append(shown(piece))


def _embedded(word: str) -> list[str]:
    out = [word]
    for sep in ("=", "@", ","):
        if sep in word:
            out += [p for p in word.split(sep)[1:] if p]
    if ":" in word and not word.startswith(("/", "~", HOME)) and re.match(r"[\w.-]+(@[\w.-]+)?:", word):
        return []  # a path on another host
    return out


def _netcat(args: list[str], ctx: Context, stdin: Stdin) -> None:
    for a in args:
        if a in ("--exec", "--sh-exec", "--lua-exec") or a.startswith(("--exec=", "--sh-exec=", "--lua-exec=")):
            raise Refused("a network connection that runs a program (reverse shell)")
        if a.startswith("-") and not a.startswith("--") and set(a[1:]) & {"e", "c"}:
            raise Refused("a network connection that runs a program (reverse shell)")


def _socat(args: list[str], ctx: Context, stdin: Stdin) -> None:
    for a in args:
        if is_computed(a) or re.search(r"(?i)(^|[!,])(exec|system)\s*:", a):
            raise Refused("socat runs a program on a network connection (reverse shell)")
        m = re.match(r"(?i)(open|create|creat|gopen|file)\s*:\s*([^,]+)", a)
        if m is not None and is_protected(normalise(m.group(2), ctx.cwd)):
            raise Refused(f"socat writes to {m.group(2)}")


def _openssl(args: list[str], ctx: Context, stdin: Stdin) -> None:
    if args[:1] in (["s_client"], ["s_server"]):
        ctx.facts.network.append("openssl " + args[0])
        ctx.facts.relays.append("openssl " + args[0])


def ssh_options(values: list[str], ctx: Context) -> None:
    """`-o ProxyCommand=...`, `LocalCommand`, `KnownHostsCommand`: commands ssh runs here."""
    for v in values:
        m = SSH_RUNS.match(v)
        if m is not None:
            cmd = m.group(2).strip()
            if is_computed(cmd):
                raise Refused("ssh runs a command computed when it runs")
            ctx.judge.script(re.sub(r"%[a-zA-Z%]", "x", cmd), ctx.nested())


def _ssh(args: list[str], ctx: Context, stdin: Stdin) -> None:
    opts = parse(args, SSH_OPTION_VALUES, first_operand_ends=True)
    values = opts.value("-o") + [a[2:] for a in args if a.startswith("-o") and len(a) > 2]
    ssh_options(values, ctx)


def _sftp(args: list[str], ctx: Context, stdin: Stdin) -> None:
    opts = parse(args, SSH_OPTION_VALUES | {"-D", "-s", "-B", "-R", "-l"})
    ssh_options(opts.value("-o"), ctx)
    for cmd in opts.value("-S", "-D", "-s"):
        ctx.judge.script(cmd, ctx.nested())


def _url_name(url: str) -> str | None:
    known = literal(url)
    if known is None:
        return None
    path = re.sub(r"^[a-z]+://[^/]*", "", known).split("?", 1)[0].split("#", 1)[0]
    return posixpath.basename(path) or "index.html"


def _curl(args: list[str], ctx: Context, stdin: Stdin) -> None:
    opts = parse(args, CURL_TAKES)
    outputs = [o for o in opts.value("-o", "--output") if o != "-"]
    dirs = opts.value("--output-dir")
    check_writes(dirs, ctx, "curl downloads into")
    logs = opts.value("-c", "--cookie-jar", "-D", "--dump-header", "--trace", "--trace-ascii", "--stderr",
                      "--etag-save", "--hsts", "--alt-svc")  # fmt: skip
    check_writes(outputs + logs, ctx, "curl writes to")
    names = [posixpath.basename(o) for o in outputs]
    if opts.has("-O", "--remote-name", "--remote-name-all", "-J"):
        urls = [u for u in opts.operands + opts.value("--url") if "://" in u or "." in u]
        names += [n for n in map(_url_name, urls) if n]
        check_writes([f"{d}/{n}" for d in dirs for n in names], ctx, "curl downloads into")
    for n in names:
        ctx.facts.write(n, None, downloaded=True)


def _wget(args: list[str], ctx: Context, stdin: Stdin) -> None:
    opts = parse(args, WGET_TAKES)
    documents = [o for o in opts.value("-O", "--output-document") if o != "-"]
    prefixes = opts.value("-P", "--directory-prefix")
    check_writes(documents + opts.value("-o", "--output-file", "-a", "--append-output", "--save-cookies"), ctx,
                 "wget writes to")  # fmt: skip
    check_writes(prefixes, ctx, "wget downloads into")
    for command in opts.value("-e", "--execute"):
        for piece in re.split(r"[=\s]+", command):
            check_writes([piece] if piece.startswith(("/", "~")) else [], ctx, "wget writes to")
    if documents:
        names = [posixpath.basename(d) for d in documents]
    elif "-" in opts.value("-O", "--output-document"):
        names = []
    else:
        names = [n for n in map(_url_name, opts.operands) if n]
        check_writes([f"{p}/{n}" for p in prefixes for n in names], ctx, "wget downloads into")
    for n in names:
        ctx.facts.write(n, None, downloaded=True)


def _aria2c(args: list[str], ctx: Context, stdin: Stdin) -> None:
    opts = parse(args, {"-d", "--dir", "-o", "--out", "-i", "--input-file", "-x", "-s", "-j", "--on-download-complete",
                        "--on-download-start", "--on-download-error", "--on-download-stop", "--on-bt-download-complete",
                        "--on-download-pause"})  # fmt: skip
    for hook in ("--on-download-complete", "--on-download-start", "--on-download-error", "--on-download-stop",
                 "--on-bt-download-complete", "--on-download-pause"):  # fmt: skip
        for cmd in opts.value(hook):
            ctx.judge.argv([cmd], ctx.nested(), Stdin())
    check_writes(opts.value("-d", "--dir", "-o", "--out"), ctx, "aria2c downloads into")
    names = [posixpath.basename(o) for o in opts.value("-o", "--out")] or [
        n for n in map(_url_name, opts.operands) if n
    ]
    for n in names:
        ctx.facts.write(n, None, downloaded=True)


def _httpie(args: list[str], ctx: Context, stdin: Stdin) -> None:
    opts = parse(args, {"-o", "--output", "-a", "--auth", "-A", "--auth-type", "--session", "--verify", "--cert",
                        "--cert-key", "--proxy", "--timeout"})  # fmt: skip
    outputs = opts.value("-o", "--output")
    check_writes(outputs, ctx, "downloads into")
    if opts.has("-d", "--download"):
        names = [posixpath.basename(o) for o in outputs] or [n for n in map(_url_name, opts.operands[:2]) if n]
        for n in names:
            ctx.facts.write(n, None, downloaded=True)


def _relay(args: list[str], ctx: Context, stdin: Stdin) -> None:
    return  # the name alone marks it (judge.py); the fifo rule needs nothing more


CHECKS: dict[str, Check] = {
    "nc": _netcat, "ncat": _netcat, "netcat": _netcat, "cryptcat": _netcat, "pwncat": _netcat, "socat": _socat,
    "openssl": _openssl, "ssh": _ssh, "sftp": _sftp, "curl": _curl, "wget": _wget, "aria2c": _aria2c,
    "http": _httpie, "https": _httpie, "xh": _httpie, "telnet": _relay,
}  # fmt: skip
