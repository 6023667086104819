"""Deletes, moves, writes and mode changes, by whichever tool makes them.

A recursive delete (rm -r, find -delete, rsync --delete, rimraf...) may not reach / or home, a system directory,
a directory above a protected path, or everything in a top directory, and may not name a path computed at run
time. Nothing may delete, move or write a protected path (paths.PROTECTED): redirections, tee, cp/mv/install/ln,
rsync/scp, dd, sed -i and the other in-place editors, sort -o, patch, compilers' -o, archives extracted into a
directory above one, and any program's output option (-o, --output, --out-dir ...). chmod and install may not set
setuid or setgid bits. A raw disk may not be an argument of anything but an inspector.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable

from glm5.parsing.shell import code
from glm5.parsing.shell.context import Context, Refused, Stdin
from glm5.parsing.shell.names import INSPECTORS
from glm5.parsing.shell.options import parse
from glm5.parsing.shell.paths import (
    PROTECTED,
    TOP,
    covers,
    is_network_device,
    is_protected,
    is_raw_disk,
    is_top,
    normalise,
)
from glm5.parsing.shell.words import DESCENDANTS, SPLIT, STAR, is_computed, literal, shown

Check = Callable[[list[str], Context, Stdin], None]
UNPACKED = "\ue000unpacked"  # the files of a downloaded archive, once unpacked
# they name a disk without reading or writing it
DISK_INSPECTORS = {"lsblk", "blkid", "df", "findmnt", "udevadm", "smartctl", "stat", "ls", "file", "readlink",
                   "realpath", "namei", "lsof", "fuser", "test", "[", "[[", "echo", "printf", "basename",
                   "dirname"}  # fmt: skip
OUTPUT_OPTIONS = {"-o", "--output", "--output-file", "--outfile", "--out", "-out", "-keyout", "--output-dir",
                  "--outdir", "--out-dir", "--log-file", "--logfile", "--dest", "--destination",
                  "--target-directory", "--target-dir", "--directory-prefix", "-O", "--output-document",
                  "--save-to", "--write-to", "--export-to"}  # fmt: skip
NOT_OUTPUT_O = {"ssh", "scp", "sftp", "ps", "set", "shopt", "kubectl", "helm", "docker", "podman", "python",
                "make", "gmake", "pip", "npm", "git", "lsblk", "mount", "unzip", "sshfs", "rsync", "java", "mvn",
                "gradle", "tar", "zip"}  # fmt: skip


def check_writes(words: list[str], ctx: Context, what: str) -> None:
    for w in words:
        path = normalise(w, ctx.cwd)
        if is_network_device(path):
            raise Refused(f"{what} {shown(w)}: a network connection")
        if is_protected(path):
            raise Refused(f"{what} {shown(w)}, a protected path")


def check_deletes(words: list[str], ctx: Context, recursive: bool, what: str = "deletes") -> None:
    for w in words:
        if recursive and is_computed(w):
            raise Refused(f"{what} a tree at a path computed when the command runs ({shown(w)})")
        path = normalise(w, ctx.cwd)
        if recursive and is_top(path):
            raise Refused(f"{what} {shown(w)} and everything below it")
        if is_protected(path):
            raise Refused(f"{what} {shown(w)}, a protected path")


def unpacks(archives: list[str], ctx: Context) -> None:
    """An archive this command line downloaded, unpacked: any file run after it may come from it."""
    for a in archives:
        entries = ctx.facts.written.get(posixpath.basename(literal(a) or ""), [])
        if any(e.downloaded for e in entries):
            ctx.facts.write(UNPACKED, None, downloaded=True)


def check_extraction(dirs: list[str], ctx: Context, what: str) -> None:
    """Unpacking an archive into a directory writes any path below it."""
    for d in dirs or [ctx.cwd or "."]:
        path = normalise(d, ctx.cwd)
        if is_protected(path) or (not is_computed(d) and covers(path, PROTECTED)):
            raise Refused(f"{what} {shown(d)}, above or in a protected path")


def check_run_written(path: str, lang: str, ctx: Context) -> None:
    """Running a file this command line wrote: what it wrote is judged; a download is refused."""
    from glm5.parsing.shell.interpreters import code as run_code
    from glm5.parsing.shell.interpreters import shebang

    entries = ctx.facts.written.get(posixpath.basename(path), []) + ctx.facts.written.get(UNPACKED, [])
    if not entries:
        return
    if any(e.downloaded for e in entries):
        raise Refused(f"runs {path}, which this command downloads")
    if any(e.content is None for e in entries):
        raise Refused(f"runs {path}, which this command writes with content only known when it runs")
    text = "".join(e.content or "" for e in entries)
    run_code(shebang(text) or lang, text, ctx, [])


def generic(name: str, args: list[str], ctx: Context) -> None:
    """What any program is judged for: raw disks among its arguments, output options aimed at protected paths."""
    if name not in DISK_INSPECTORS:
        for w in args:
            for piece in _pieces(w):
                if is_raw_disk(normalise(piece, ctx.cwd)):
                    raise Refused(f"{name} on a raw disk ({shown(piece)})")
    if name in NOT_OUTPUT_O or name in INSPECTORS:
        return
    for i, a in enumerate(args):
        option, eq, val = a.partition("=")
        if option in OUTPUT_OPTIONS:
            target = val if eq else (args[i + 1] if i + 1 < len(args) else "")
            check_writes([target], ctx, f"{name} writes to")
        elif re.fullmatch(r"-o[/~].*", a):
            check_writes([a[2:]], ctx, f"{name} writes to")


def _pieces(word: str) -> list[str]:
    """A word and the paths embedded in it (`of=/dev/sda`, `file=@/etc/x`, `--out=/x`)."""
    out = [word]
    for sep in ("=", "@", ","):
        if sep in word:
            out += [p for p in word.split(sep)[1:] if p]
    return out


# -- deletes --------------------------------------------------------------------------------------------------


def _rm(args: list[str], ctx: Context, stdin: Stdin) -> None:
    opts = parse(args)
    if opts.has("--no-preserve-root"):
        raise Refused("rm --no-preserve-root deletes /")
    recursive = opts.has("-r", "-R", "--recursive") or any(w.startswith(SPLIT) for w in opts.operands)
    check_deletes(opts.operands, ctx, recursive)


def _rimraf(args: list[str], ctx: Context, stdin: Stdin) -> None:
    check_deletes(parse(args).operands, ctx, recursive=True)


def _unlink(args: list[str], ctx: Context, stdin: Stdin) -> None:
    check_deletes(parse(args).operands, ctx, recursive=False)


FIND_TAKES_ONE = {"-name", "-iname", "-path", "-ipath", "-regex", "-iregex", "-type", "-xtype", "-user", "-group",
                  "-perm", "-size", "-mtime", "-mmin", "-atime", "-amin", "-ctime", "-cmin", "-newer", "-maxdepth",
                  "-mindepth", "-wholename", "-iwholename", "-lname", "-ilname", "-inum", "-links", "-uid", "-gid",
                  "-samefile", "-used", "-context", "-printf", "-fstype", "-regextype"}  # fmt: skip


def _find(args: list[str], ctx: Context, stdin: Stdin) -> None:
    i = 0
    while i < len(args) and (args[i] in ("-H", "-L", "-P") or args[i].startswith(("-D", "-O"))):
        i += 2 if args[i] == "-D" else 1
    roots: list[str] = []
    while i < len(args) and not args[i].startswith(("-", "(", "!", ")", ",")):
        roots.append(args[i])
        i += 1
    roots = roots or ["."]
    expr = args[i:]
    below = [r for root in roots for r in (root, root.rstrip("/") + "/" + DESCENDANTS)]
    if "-delete" in expr:
        check_deletes(roots, ctx, recursive=True, what="find -delete")
    j = 0
    while j < len(expr):
        a = expr[j]
        if a in ("-exec", "-execdir", "-ok", "-okdir"):
            end = next((k for k in range(j + 1, len(expr)) if expr[k] in (";", "+")), len(expr))
            command = expr[j + 1 : end]
            if any("{}" in w for w in command):
                for r in below:
                    ctx.judge.argv([w.replace("{}", r) for w in command], ctx, Stdin())
            else:
                ctx.judge.argv(command, ctx, Stdin())
            j = end + 1
            continue
        if a in ("-fprint", "-fprint0", "-fls", "-fprintf") and j + 1 < len(expr):
            check_writes([expr[j + 1]], ctx, "find writes to")
        j += 2 if a in FIND_TAKES_ONE else 1


# -- modes ----------------------------------------------------------------------------------------------------

CHMOD_FLAGS = {"-R", "--recursive", "-v", "--verbose", "-c", "--changes", "-f", "--silent", "--quiet",
               "--no-preserve-root", "--preserve-root", "-h", "--no-dereference", "-H", "-L", "-P"}  # fmt: skip


def sets_special_bits(mode: str) -> bool:
    """`u+s`, `g=rxs`, `+s`, or an octal mode (after an optional + or =) whose setuid or setgid bit is set; a
    computed mode might be any of them."""
    if is_computed(mode) or literal(mode) is None:
        return True
    m = re.fullmatch(r"([+=]?)0*([0-7]{1,5})", mode)
    if m is not None:
        digits = m.group(2)
        return len(digits) >= 4 and bool(int(digits[-4]) & 6)
    if re.fullmatch(r"-0*[0-7]{1,5}", mode):
        return False
    return any(op in "+=" and "s" in perms for op, perms in re.findall(r"([-+=])([rwxXstugo]*)", mode))


def _loosens(mode: str) -> bool:
    """The mode lets group or others write (chmod 600 ~/.ssh/id_rsa tightens; 666 /etc/shadow loosens)."""
    m = re.fullmatch(r"[+=]?0*([0-7]{1,4})", mode)
    if m is not None:
        return any(int(d) & 2 for d in m.group(1)[-2:])
    for who, op, perms in re.findall(r"([ugoa]*)([-+=])([rwxXst]*)", mode):
        if op in "+=" and "w" in perms and (not who or set(who) & set("goa")):
            return True
    return False


def _adds_exec(mode: str) -> bool:
    m = re.fullmatch(r"[+=]?0*([0-7]{1,5})", mode)
    if m is not None:
        return any(int(d) & 1 for d in m.group(1)[-3:])
    return any(op in "+=" and "x" in perms for op, perms in re.findall(r"([-+=])([rwxXst]*)", mode))


def _chmod(args: list[str], ctx: Context, stdin: Stdin) -> None:
    recursive = False
    mode: str | None = None
    paths: list[str] = []
    for a in args:
        if a in CHMOD_FLAGS:
            recursive |= a in ("-R", "--recursive")
        elif a.startswith("--reference"):
            raise Refused("chmod --reference copies another file's mode (setuid bits included)")
        elif mode is None:
            mode = a
        else:
            paths.append(a)
    if mode is None:
        return
    if sets_special_bits(mode):
        raise Refused(f"chmod {shown(mode)} sets setuid/setgid bits (or a mode computed when it runs)")
    for p in paths:
        path = normalise(p, ctx.cwd)
        if recursive and (is_computed(p) or is_top(path)):
            raise Refused(f"chmod -R of {shown(p)}")
        if covers(path, TOP) and not is_computed(p):
            raise Refused(f"chmod of {shown(p)}")
        if is_protected(path) and (path[0] != "\ue009" or _loosens(mode)):
            raise Refused(f"chmod of {shown(p)}, a protected path")
        if _adds_exec(mode):
            entries = ctx.facts.written.get(posixpath.basename(literal(p) or ""), [])
            if any(e.downloaded for e in entries):
                raise Refused(f"chmod +x of {shown(p)}, which this command downloads")


def _chattr(args: list[str], ctx: Context, stdin: Stdin) -> None:
    operands = [a for a in args if not a.startswith(("-", "+", "="))]
    for p in operands:
        path = normalise(p, ctx.cwd)
        if is_computed(p) or is_top(path) or is_protected(path):
            raise Refused(f"changes the attributes of {shown(p)}")


def _setfacl(args: list[str], ctx: Context, stdin: Stdin) -> None:
    opts = parse(args, {"-m", "--modify", "-x", "--remove", "-M", "--modify-file", "-X", "--remove-file", "--set",
                        "--set-file", "--restore"})  # fmt: skip
    _chattr(opts.operands, ctx, stdin)


# -- copies and moves -----------------------------------------------------------------------------------------

COPY_TAKES = {"-t", "--target-directory", "-S", "--suffix", "-m", "--mode", "-o", "--owner", "-g", "--group",
              "-e", "--rsh", "--rsync-path", "--exclude", "--include", "-f", "--filter", "--exclude-from",
              "--include-from", "--files-from", "--chmod", "--chown", "-T", "--temp-dir", "--backup-dir",
              "--log-file", "--password-file", "--partial-dir", "--compare-dest", "--copy-dest", "--link-dest",
              "-M", "--remote-option", "--out-format", "-B", "--port", "--timeout", "--bwlimit", "--max-size",
              "--min-size", "-i", "-F", "-P", "-l", "-c", "-J", "-n", "--namespace",
              "--container"}  # fmt: skip
REMOTE = re.compile(r"[^/.~\ue009\ue000\ue001][^/]*:.*|rsync://.*")


def _copy_like(name: str, args: list[str], ctx: Context) -> tuple[list[str], list[str]]:
    """The sources and the paths written, for cp, mv, install, ln, rsync, scp, docker/kubectl cp."""
    takes = set(COPY_TAKES)
    if name in ("cp", "mv", "ln") or name == "install":
        takes -= {"-e", "-i", "-F", "-P", "-l", "-c", "-J", "-n", "-f", "-B", "-T", "-M"}
    opts = parse(args, takes)
    if name == "install" and opts.has("-d", "--directory"):
        return [], opts.operands
    target = opts.value("-t", "--target-directory")
    operands = opts.operands
    sources, dest = (operands, target[-1]) if target else (operands[:-1], operands[-1] if operands else None)
    if dest is None or (name != "ln" and not sources) or REMOTE.fullmatch(dest):
        return sources, []
    written = [dest]
    recursive = opts.has("-r", "-R", "--recursive", "-a", "--archive") or name in ("rsync", "mv")
    for s in sources:
        if s.endswith(("/", "/.")) or s == ".":
            written.append(dest.rstrip("/") + "/" + (DESCENDANTS if recursive else STAR))
        else:
            written.append(dest.rstrip("/") + "/" + posixpath.basename(s))
    return sources, written


def _copy(name: str) -> Check:
    def check(args: list[str], ctx: Context, stdin: Stdin) -> None:
        sources, written = _copy_like(name, args, ctx)
        check_writes(written, ctx, f"{name} writes to")
        opts = parse(args, COPY_TAKES)
        for mode in opts.value("-m", "--mode", "--chmod") if name in ("install", "rsync") else []:
            if sets_special_bits(mode):
                raise Refused(f"{name} sets setuid/setgid bits ({shown(mode)})")
        if name == "rsync":
            for cmd in opts.value("-e", "--rsh"):
                ctx.judge.script(cmd, ctx.nested())
            if any(f.startswith("--delete") for f in opts.flags) and written:
                check_deletes(written[:1], ctx, recursive=True, what="rsync --delete empties")
            if opts.has("--remove-source-files"):
                check_deletes(sources, ctx, recursive=False, what="rsync moves")
        if name in ("rsync", "scp"):
            _remote_sources(sources, ctx)
            for cmd in opts.value("-S"):
                ctx.judge.script(cmd, ctx.nested())
            if name == "scp":
                from glm5.parsing.shell.network import ssh_options

                ssh_options(opts.value("-o"), ctx)

    return check


def _remote_sources(sources: list[str], ctx: Context) -> None:
    for s in sources:
        if REMOTE.fullmatch(s):
            ctx.facts.write(posixpath.basename(s.split(":", 1)[-1]), None, downloaded=True)


def _mv(args: list[str], ctx: Context, stdin: Stdin) -> None:
    sources, written = _copy_like("mv", args, ctx)
    for s in sources:
        path = normalise(s, ctx.cwd)
        if path[0] != "?" and (is_top(path) or is_protected(path)):
            raise Refused(f"moves {shown(s)}")
    check_writes(written, ctx, "mv writes to")


def _tee(args: list[str], ctx: Context, stdin: Stdin) -> None:
    check_writes(parse(args, {"--output-error"}).operands, ctx, "tee writes to")


def _dd(args: list[str], ctx: Context, stdin: Stdin) -> None:
    check_writes([a[3:] for a in args if a.startswith("of=")], ctx, "dd writes to")


def _shred(args: list[str], ctx: Context, stdin: Stdin) -> None:
    for p in parse(args, {"-n", "--iterations", "-s", "--size", "--random-source"}).operands:
        path = normalise(p, ctx.cwd)
        if is_computed(p) or is_protected(path) or path[1][:1] == ("dev",):
            raise Refused(f"destroys {shown(p)}")


def _operands_written(takes: set[str], what: str, skip_first: int = 0) -> Check:
    def check(args: list[str], ctx: Context, stdin: Stdin) -> None:
        check_writes(parse(args, takes).operands[skip_first:], ctx, what)

    return check


def _sort(args: list[str], ctx: Context, stdin: Stdin) -> None:
    opts = parse(args, {"-o", "--output", "-k", "--key", "-t", "--field-separator", "-S", "--buffer-size", "-T",
                        "--temporary-directory", "--parallel", "--files0-from", "--compress-program"})  # fmt: skip
    check_writes(opts.value("-o", "--output"), ctx, "sort writes to")
    for prog in opts.value("--compress-program"):
        ctx.judge.script(prog, ctx.nested())


def _uniq(args: list[str], ctx: Context, stdin: Stdin) -> None:
    operands = parse(args, {"-f", "--skip-fields", "-s", "--skip-chars", "-w", "--check-chars"}).operands
    check_writes(operands[1:2], ctx, "uniq writes to")


def _split(args: list[str], ctx: Context, stdin: Stdin) -> None:
    takes = {"-a", "--suffix-length", "-b", "--bytes", "-C", "--line-bytes", "-l", "--lines", "-n", "--number", "-t",
             "--separator", "--additional-suffix", "--filter", "-f", "--prefix"}  # fmt: skip
    opts = parse(args, takes)
    for cmd in opts.value("--filter"):
        ctx.judge.script(cmd, ctx.nested())
    check_writes(opts.operands[1:2] + opts.value("-f", "--prefix"), ctx, "split writes to")


def _patch(args: list[str], ctx: Context, stdin: Stdin) -> None:
    opts = parse(args, {"-o", "--output", "-d", "--directory", "-i", "--input", "-r", "--reject-file", "-B",
                        "--prefix", "-p", "--strip", "-F", "--fuzz", "-z", "--suffix", "-D", "--ifdef", "-V",
                        "--version-control", "-Y", "--basename-prefix"})  # fmt: skip
    check_writes(opts.value("-o", "--output", "-r", "--reject-file") + opts.operands[:1], ctx, "patch writes to")
    check_extraction(opts.value("-d", "--directory"), ctx, "patch writes into")
    for text in stdin.code:
        for line in (text or "").splitlines():
            m = re.match(r"(?:\+\+\+|---|\*\*\*) (\S+)", line)
            if m is not None and m.group(1) != "/dev/null":
                check_writes([m.group(1)], ctx, "the patch writes to")


def _tar(args: list[str], ctx: Context, stdin: Stdin) -> None:
    words = list(args)
    if words and not words[0].startswith("-") and re.fullmatch(r"[A-Za-z]+", words[0]):
        words[0] = "-" + words[0]  # old style: `tar xzf file`
    takes = {"-f", "--file", "-C", "--directory", "-I", "--use-compress-program", "-T", "--files-from", "-X",
             "--exclude-from", "-F", "--info-script", "--new-volume-script", "--to-command", "--checkpoint-action",
             "-g", "--listed-incremental", "-V", "--label", "-b", "--blocking-factor", "-H", "--format", "-K",
             "--starting-file", "-N", "--newer", "--owner", "--group", "--mode", "--transform", "--xform",
             "--exclude", "--strip-components", "--rsh-command", "--rmt-command", "--index-file", "-L",
             "--tape-length"}  # fmt: skip
    opts = parse(words, takes)
    for cmd in opts.value("--to-command", "-I", "--use-compress-program", "-F", "--info-script",
                          "--new-volume-script", "--rsh-command", "--rmt-command"):  # fmt: skip
        ctx.judge.script(cmd, ctx.nested())
    for action in opts.value("--checkpoint-action"):
        if action.startswith("exec="):
            ctx.judge.script(action[len("exec=") :], ctx.nested())
    for mode in opts.value("--mode"):
        if sets_special_bits(mode):
            raise Refused(f"tar --mode={shown(mode)} sets setuid/setgid bits")
    if opts.has("-x", "--extract", "--get"):
        if opts.has("-P", "--absolute-names"):
            raise Refused("tar -P extracts members at absolute paths")
        check_extraction(opts.value("-C", "--directory")[-1:], ctx, "tar extracts into")
        unpacks(opts.value("-f", "--file"), ctx)
    elif opts.has("-c", "--create", "-r", "--append", "-u", "--update", "-A", "--catenate"):
        check_writes(opts.value("-f", "--file"), ctx, "tar writes to")
        if opts.has("--remove-files"):
            check_deletes(opts.operands, ctx, recursive=True, what="tar --remove-files deletes")


def _unzip(args: list[str], ctx: Context, stdin: Stdin) -> None:
    opts = parse(args, {"-d", "-P", "-x"})
    check_extraction(opts.value("-d")[-1:], ctx, "unzip extracts into")
    unpacks(opts.operands[:1], ctx)


def _seven_zip(args: list[str], ctx: Context, stdin: Stdin) -> None:
    if args[:1] and args[0] in ("x", "e"):
        dirs = [a[2:] for a in args if a.startswith("-o")]
        check_extraction(dirs[-1:], ctx, "7z extracts into")
        unpacks([a for a in args[1:] if not a.startswith("-")][:1], ctx)
    elif args[:1] and args[0] in ("a", "u"):
        operands = [a for a in args[1:] if not a.startswith("-")]
        check_writes(operands[:1], ctx, "7z writes to")


def _unrar(args: list[str], ctx: Context, stdin: Stdin) -> None:
    operands = [a for a in args[1:] if not a.startswith("-")]
    if args[:1] and args[0] in ("x", "e"):
        check_extraction([o for o in operands[1:] if o.endswith("/")][-1:], ctx, "unrar extracts into")


def _cpio(args: list[str], ctx: Context, stdin: Stdin) -> None:
    opts = parse(args, {"-D", "--directory", "-F", "--file", "-O", "-I", "-H", "--format", "-E", "-M", "-R"})
    if opts.has("--absolute-filenames"):
        raise Refused("cpio --absolute-filenames extracts members at absolute paths")
    if opts.has("-i", "--extract"):
        check_extraction(opts.value("-D", "--directory")[-1:], ctx, "cpio extracts into")
    if opts.has("-p", "--pass-through"):
        check_extraction(opts.operands[-1:], ctx, "cpio copies into")
    if opts.has("-o", "--create"):
        check_writes(opts.value("-F", "--file", "-O"), ctx, "cpio writes to")


def _dpkg(args: list[str], ctx: Context, stdin: Stdin) -> None:
    for i, a in enumerate(args):
        if a in ("-x", "--extract", "-X", "--vextract", "-R", "--raw-extract") and i + 2 < len(args):
            check_extraction([args[i + 2]], ctx, "dpkg extracts into")


def _compressor(args: list[str], ctx: Context, stdin: Stdin) -> None:
    opts = parse(args, {"-S", "--suffix", "-o", "--output", "-b", "-T", "--threads", "-p", "--processes"})
    if opts.has("-c", "--stdout", "--to-stdout", "-t", "--test", "-l", "--list"):
        return
    check_writes(opts.operands, ctx, "rewrites")


def _editor(name: str) -> Check:
    def check(args: list[str], ctx: Context, stdin: Stdin) -> None:
        from glm5.parsing.shell.system import vim_commands

        if name in ("vi", "vim", "nvim", "gvim", "vimdiff", "rvim", "ex", "view", "evim"):
            vim_commands(args, ctx)
        if name in ("emacs", "emacsclient") and any(a in ("--eval", "-eval", "--execute", "-e") or
                                                    a.startswith(("--eval=", "--execute=")) for a in args):  # fmt: skip
            raise Refused(f"{name} evaluates Lisp given here, which is not judged")
        for text in stdin.code:  # an editor fed a script: `!` runs a command, whatever the mode
            if text is None or "!" in text:
                raise Refused(f"{name} runs a command from its script (!)")
        if stdin.piped and name in ("ed", "red", "ex", "vi", "vim", "nvim"):
            raise Refused(f"{name} reads editing commands piped from another command")
        if name != "view":
            check_writes([a for a in args if not a.startswith(("-", "+"))], ctx, f"{name} edits")

    return check


def _ssh_keygen(args: list[str], ctx: Context, stdin: Stdin) -> None:
    opts = parse(
        args, set("-f -t -b -C -N -P -R -F -E -I -n -O -V -z -s -m -a -Z -Y -w -D -G -J -K -M -S -W -j -T".split())
    )
    if opts.has("-l", "-y", "-F", "-B", "-e", "-L", "-Q", "-R", "-H", "-i", "-D", "-Y"):
        return
    check_writes([f for name in opts.value("-f") for f in (name, name + ".pub")], ctx, "ssh-keygen writes")


def _cmake(args: list[str], ctx: Context, stdin: Stdin) -> None:
    if "-E" not in args:
        return
    rest = args[args.index("-E") + 1 :]
    if not rest:
        return
    sub, tail = rest[0], rest[1:]
    mapping = {"rm": ["rm", *tail], "remove": ["rm", *tail], "remove_directory": ["rm", "-r", *tail],
               "rename": ["mv", *tail], "copy": ["cp", *tail], "copy_if_different": ["cp", *tail],
               "copy_directory": ["cp", "-r", *tail], "copy_directory_if_different": ["cp", "-r", *tail],
               "create_symlink": ["ln", "-s", *tail], "create_hardlink": ["ln", *tail], "touch": ["touch", *tail],
               "touch_nocreate": ["touch", *tail], "tar": ["tar", *tail], "env": ["env", *tail],
               "make_directory": []}  # fmt: skip
    if sub == "chdir" and tail:
        ctx.judge.argv(tail[1:], ctx, stdin)
    elif sub in mapping:
        ctx.judge.argv(mapping[sub], ctx, stdin)


def _mknod(args: list[str], ctx: Context, stdin: Stdin) -> None:
    operands = parse(args, {"-m", "--mode", "-Z", "--context"}).operands
    if len(operands) >= 2 and operands[1] in ("b", "c", "u"):
        raise Refused("mknod creates a device node")
    ctx.facts.fifos += operands[:1]
    _mkfifo(args, ctx, stdin)


def _mkfifo(args: list[str], ctx: Context, stdin: Stdin) -> None:
    opts = parse(args, {"-m", "--mode", "-Z", "--context"})
    ctx.facts.fifos += opts.operands
    for mode in opts.value("-m", "--mode"):
        if sets_special_bits(mode):
            raise Refused(f"sets setuid/setgid bits ({shown(mode)})")
    check_writes(opts.operands[:1], ctx, "creates")


def _mkdir(args: list[str], ctx: Context, stdin: Stdin) -> None:
    for mode in parse(args, {"-m", "--mode", "-Z", "--context"}).value("-m", "--mode"):
        if sets_special_bits(mode):
            raise Refused(f"mkdir -m {shown(mode)} sets setuid/setgid bits")


def _yq(args: list[str], ctx: Context, stdin: Stdin) -> None:
    if "-i" in args or "--inplace" in args or any(re.fullmatch(r"-[a-hj-zA-Z]*i[a-zA-Z]*", a) for a in args):
        check_writes([a for a in parse(args).operands[1:]], ctx, "yq -i rewrites")


def _sed(args: list[str], ctx: Context, stdin: Stdin) -> None:
    code.sed(args, ctx)


CHECKS: dict[str, Check] = {
    "rm": _rm, "srm": _rm, "rimraf": _rimraf, "trash": _rimraf, "trash-put": _rimraf, "unlink": _unlink,
    "rmdir": _unlink, "find": _find, "chmod": _chmod, "chattr": _chattr, "setfacl": _setfacl,
    "cp": _copy("cp"), "install": _copy("install"), "ln": _copy("ln"), "rsync": _copy("rsync"), "scp": _copy("scp"),
    "mv": _mv, "tee": _tee, "dd": _dd, "shred": _shred,
    "truncate": _operands_written({"-s", "--size", "-r", "--reference"}, "truncates"),
    "touch": _operands_written({"-d", "--date", "-t", "-r", "--reference"}, "touches"),
    "sponge": _operands_written(set(), "sponge writes to"),
    "dos2unix": _operands_written(set(), "rewrites"), "unix2dos": _operands_written(set(), "rewrites"),
    "csplit": lambda a, c, s: check_writes(parse(a, {"-f", "--prefix", "-b", "-n"}).value("-f", "--prefix"), c,
                                           "csplit writes to"),
    "sort": _sort, "uniq": _uniq, "split": _split, "patch": _patch, "tar": _tar, "bsdtar": _tar, "gtar": _tar,
    "unzip": _unzip, "7z": _seven_zip, "7za": _seven_zip, "7zr": _seven_zip, "unrar": _unrar, "cpio": _cpio,
    "dpkg": _dpkg, "dpkg-deb": _dpkg, "ssh-keygen": _ssh_keygen, "cmake": _cmake, "mknod": _mknod,
    "mkfifo": _mkfifo, "mkdir": _mkdir, "yq": _yq, "sed": _sed, "gsed": _sed,
    **{name: _compressor for name in ("gzip", "gunzip", "bzip2", "bunzip2", "xz", "unxz", "lzma", "unlzma",
                                      "zstd", "unzstd", "lz4", "pigz", "unpigz", "pbzip2", "compress",
                                      "uncompress", "lzip", "brotli")},
    **{name: _editor(name) for name in ("vi", "vim", "nvim", "gvim", "vimdiff", "rvim", "ex", "view", "evim",
                                        "nano", "pico", "emacs", "emacsclient", "ed", "red", "joe", "micro",
                                        "kak", "hx", "mcedit", "jed", "ne", "gedit", "kate", "code")},
    **{name: _operands_written(set(), "formats") for name in ("black", "isort", "autopep8", "yapf", "autoflake",
                                                              "prettier", "gofmt", "goimports", "clang-format",
                                                              "rustfmt", "shfmt", "stylua", "mdformat")},
}  # fmt: skip
