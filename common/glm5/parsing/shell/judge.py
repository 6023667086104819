"""The shell policy's judge: parses a command line with tree-sitter's bash grammar and judges every simple
command in it (pipelines, lists, subshells, functions, substitutions, the bodies of loops) in the order bash
would meet them, carrying the working directory, the variables and what earlier commands wrote or downloaded.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterator

import tree_sitter_bash
from tree_sitter import Language, Node, Parser

from glm5.parsing.shell import environment, files, interpreters, network, system
from glm5.parsing.shell.context import Context, Facts, Refused, Stdin
from glm5.parsing.shell.names import ENV_PRINTERS, FORBIDDEN, NETWORK, PRIVILEGE, RELAYS, language, program
from glm5.parsing.shell.paths import is_network_device, is_protected, normalise
from glm5.parsing.shell.words import (
    DESCENDANTS,
    STAR,
    UNKNOWN,
    expand,
    is_computed,
    literal,
    shown,
    text,
    value,
    values,
)
from glm5.parsing.shell.wrappers import unwrap

_LANGUAGE = Language(tree_sitter_bash.language())
OUTPUT_OPS = (">", ">>", ">|", "&>", "&>>", "<>", ">&", "&>|")
FILTERS = {"head", "tail", "sort", "uniq", "tac", "shuf", "cat", "grep", "egrep", "fgrep", "rg", "tee"}
HISTORY_VARIABLES = {"HISTFILE", "HISTSIZE", "HISTFILESIZE", "SAVEHIST", "HISTCMD"}


def violation(command: str) -> str | None:
    """Why `command` is refused, or None when the policy lets it run."""
    judge = ShellJudge()
    ctx = Context(judge)
    try:
        judge.script(command, ctx)
        _conclude(ctx.facts)
    except Refused as exc:
        return str(exc)
    except RecursionError:
        return "the command is nested too deeply to judge"
    return None


def _conclude(facts: Facts) -> None:
    """The refusals that need two facts about the whole command line."""
    if facts.credentials and facts.network:
        raise Refused(f"sends credentials ({facts.credentials[0]}) over the network ({facts.network[0]})")
    if facts.fifos and facts.relays:
        raise Refused(f"a named pipe ({facts.fifos[0]}) with a network relay ({facts.relays[0]}): a reverse shell")


def parse(code: str) -> Node:
    data = _continuations(code.replace("\r\n", "\n").encode())
    tree = Parser(_LANGUAGE).parse(data)
    if tree.root_node.has_error:
        raise Refused("the command cannot be parsed as shell")
    return tree.root_node


def _continuations(data: bytes) -> bytes:
    """Backslash-newline joins lines before bash reads words (`r\\<newline>m` is rm), except inside single quotes,
    comments and quoted heredocs; tree-sitter splits the word there, so they go first."""
    if b"\\\n" not in data:
        return data
    keep: list[tuple[int, int]] = []
    for node in _walk(Parser(_LANGUAGE).parse(data).root_node):
        if node.type in ("raw_string", "comment", "ansi_c_string") or (
            node.type == "heredoc_body" and _quoted_heredoc(node.parent)
        ):
            keep.append((node.start_byte, node.end_byte))
    out = bytearray()
    last = 0
    for m in re.finditer(rb"(\\+)\n", data):
        cut = m.end() - 2
        if len(m.group(1)) % 2 == 1 and not any(a <= cut < b for a, b in keep):
            out += data[last:cut]
            last = m.end()
    out += data[last:]
    return bytes(out)


def _quoted_heredoc(redirect: Node | None) -> bool:
    if redirect is None:
        return False
    start = next((c for c in redirect.children if c.type == "heredoc_start"), None)
    return start is not None and any(q in text(start) for q in ("'", '"', "\\"))


def _walk(node: Node) -> Iterator[Node]:
    yield node
    for child in node.children:
        yield from _walk(child)


class ShellJudge:
    """Judges scripts and argument vectors (context.Judge)."""

    def script(self, code: str, ctx: Context) -> None:
        self._node(parse(code), ctx)

    def _node(self, node: Node, ctx: Context) -> None:
        kind = node.type
        parent = node.parent.type if node.parent is not None else ""
        if kind == "command":
            self._command(node, ctx)
        elif kind == "function_definition":
            _fork_bomb(node)
        elif kind == "variable_assignment" and parent not in ("command", "declaration_command"):
            self._assign(node, ctx)
        elif kind == "declaration_command":
            for child in node.children:
                if child.type == "variable_assignment":
                    self._assign(child, ctx)
        elif kind == "unset_command":
            for child in node.children[1:]:
                if text(child) in HISTORY_VARIABLES:
                    raise Refused(f"unset {text(child)} hides the shell history")
        elif kind == "for_statement":
            self._for(node, ctx)
        elif kind == "file_redirect":
            self._redirect(node, ctx)
        elif kind == "heredoc_body" and _quoted_heredoc(node.parent):
            return  # quoted: nothing in it runs here (what reads it is judged by the command)
        for child in node.children:
            self._node(child, ctx)

    # -- statements -------------------------------------------------------------------------------------------

    def _assign(self, node: Node, ctx: Context) -> None:
        name_node = node.child_by_field_name("name")
        if name_node is None or name_node.type != "variable_name":
            return
        rhs = node.child_by_field_name("value")
        if rhs is None:
            vals = [""]
        elif rhs.type == "array":
            vals = [w for c in rhs.named_children for w in expand(c, ctx)]
        else:
            vals = values(rhs, ctx)
        name = text(name_node)
        environment.assignment(name, vals, ctx)
        ctx.assign(name, vals)

    def _for(self, node: Node, ctx: Context) -> None:
        var = node.child_by_field_name("variable")
        if var is None:
            return
        vals = [w for v in node.children_by_field_name("value") for w in expand(v, ctx)]
        ctx.assign(text(var), vals if any(c.type == "in" for c in node.children) else [UNKNOWN])

    def _redirect(self, node: Node, ctx: Context) -> None:
        dest = node.child_by_field_name("destination")
        if dest is None:
            return
        op = next((c.type for c in node.children if not c.is_named), "")
        for word in expand(dest, ctx):
            path = normalise(word, ctx.cwd)
            if is_network_device(path):
                raise Refused("a network connection as a file (/dev/tcp): a reverse shell")
            if op not in OUTPUT_OPS or (op == ">&" and (word.isdigit() or word == "-")):
                continue
            if is_protected(path):
                raise Refused(f"writes to {shown(word)}")

    def _command(self, node: Node, ctx: Context) -> None:
        for child in node.children:
            if child.type == "variable_assignment":
                name_node = child.child_by_field_name("name")
                rhs = child.child_by_field_name("value")
                if name_node is not None:
                    environment.assignment(text(name_node), [value(rhs, ctx) if rhs is not None else ""], ctx)
        name_node = node.child_by_field_name("name")
        if name_node is None:
            return
        redirects = _redirects(node)
        starts = {r.start_byte for r in redirects}
        # `sh 0<&3`: tree-sitter reads the descriptor number as an argument
        arg_nodes = [a for a in node.children_by_field_name("argument")
                     if not (text(a).isdigit() and a.end_byte in starts)]  # fmt: skip
        head = name_node.children[0] if name_node.children else name_node
        words = expand(head, ctx)
        name = program(literal(words[0]) or "") if words else ""
        if name in ("eval", ".", "source") and self._evaluates_printer(arg_nodes, ctx):
            return
        for arg in arg_nodes:
            words += expand(arg, ctx)
        words += self._dropped_dash(node, redirects)
        stdin = self._stdin(node, redirects, ctx)
        if name == "eval":
            self._eval(words[1:], ctx)
            return
        self.argv(words, ctx, stdin)
        self._record_writes(redirects, words, stdin, ctx)

    def _evaluates_printer(self, args: list[Node], ctx: Context) -> bool:
        """`eval "$(ssh-agent -s)"`, `source <(kubectl completion bash)`: the shell runs what a known tool prints
        about its own setup; the tool's command is judged where it stands."""
        if len(args) != 1:
            return False
        subs = [n for n in _walk(args[0]) if n.type in ("command_substitution", "process_substitution")]
        if len(subs) != 1 or text(args[0]).strip('"') != text(subs[0]):
            return False
        commands = [n for n in subs[0].named_children]
        if len(commands) != 1 or commands[0].type != "command":
            return False
        name_node = commands[0].child_by_field_name("name")
        return name_node is not None and program(text(name_node)) in ENV_PRINTERS

    def _eval(self, args: list[str], ctx: Context) -> None:
        known = [literal(a) for a in args]
        if any(k is None for k in known):
            raise Refused("eval runs a string computed when the command runs")
        self.script(" ".join(k for k in known if k is not None), ctx.nested())

    def _dropped_dash(self, node: Node, redirects: list[Node]) -> list[str]:
        """tree-sitter drops a `-` written right before a heredoc (`python3 - <<EOF`); bash passes it."""
        parent = node.parent
        after = [r for r in redirects if r.start_byte >= node.end_byte]
        if parent is None or parent.type != "redirected_statement" or parent.text is None or not after:
            return []
        gap = parent.text[node.end_byte - parent.start_byte : after[0].start_byte - parent.start_byte].strip()
        if gap in (b"", b"|", b"|&", b"&&", b"||", b";", b"&") or gap.isdigit():
            return []
        if gap == b"-":
            return ["-"]
        raise Refused("the command cannot be parsed as shell")

    def _stdin(self, node: Node, redirects: list[Node], ctx: Context) -> Stdin:
        stdin = Stdin()
        previous = _previous_stage(node)
        if previous is not None:
            stdin.piped = True
            stdin.printed = self.printed(previous, ctx)
        for child in redirects:
            if child.type == "herestring_redirect":
                content = [value(c, ctx) for c in child.named_children]
                stdin.code.append(None if any(is_computed(c) for c in content) else " ".join(content) + "\n")
            elif child.type == "heredoc_redirect":
                body = next((c for c in child.children if c.type == "heredoc_body"), None)
                dynamic = body is not None and any(
                    c.type in ("expansion", "simple_expansion", "command_substitution") for c in body.children
                )
                stdin.code.append(None if dynamic and not _quoted_heredoc(child) else
                                  text(body) if body is not None else "")  # fmt: skip
            elif child.type == "file_redirect":
                self._stdin_redirect(child, stdin, ctx)
        return stdin

    def _stdin_redirect(self, child: Node, stdin: Stdin, ctx: Context) -> None:
        ops = [c.type for c in child.children if not c.is_named]
        fd_node = next((c for c in child.children if c.type == "file_descriptor"), None)
        fd = text(fd_node) if fd_node is not None else None
        dest = child.child_by_field_name("destination")
        target = expand(dest, ctx)[0] if dest is not None else ""
        if "<" in ops and fd in (None, "0"):
            if dest is not None and dest.type == "process_substitution":
                stdin.piped = True  # `sh < <(curl ...)`: another command's output
            else:
                stdin.file = target
        elif ("<&" in ops or ">&" in ops) and target.isdigit() and (int(target) >= 3 or fd == "0" or "<&" in ops):
            stdin.descriptor = True  # `<&3`, `0>&1`: a descriptor opened on a socket, typically

    def _record_writes(self, redirects: list[Node], words: list[str], stdin: Stdin, ctx: Context) -> None:
        """Files this command writes, for a later command that runs one (`curl -o x.sh ...; sh x.sh`)."""
        name = program(literal(words[0]) or "") if words else ""
        downloaded = name in network.DOWNLOAD_NAMES or (stdin.piped and stdin.printed == network.DOWNLOADED)
        content: str | None = None
        operands = [w for w in words[1:] if not w.startswith("-")]
        if name in ("echo", "printf"):
            pieces = [literal(w) for w in words[1:] if w not in ("-n", "-e", "-E")]
            content = None if any(k is None for k in pieces) else _unescape(" ".join(k or "" for k in pieces))
        elif (name == "tee" or (name == "cat" and not operands)) and stdin.code:
            content = None if any(c is None for c in stdin.code) else "".join(c or "" for c in stdin.code)
        for child in redirects:
            if child.type != "file_redirect" or not any(c.type in OUTPUT_OPS for c in child.children):
                continue
            dest = child.child_by_field_name("destination")
            for target in expand(dest, ctx) if dest is not None else []:
                known = literal(target)
                if known is not None and not known.isdigit():
                    ctx.facts.write(posixpath.basename(known), content, downloaded)
        if name == "tee":
            for target in words[1:]:
                known = literal(target)
                if known is not None and not known.startswith("-"):
                    ctx.facts.write(posixpath.basename(known), content, downloaded)

    # -- commands ---------------------------------------------------------------------------------------------

    def argv(self, words: list[str], ctx: Context, stdin: Stdin) -> None:
        if not words:
            return
        first = words[0]
        if is_computed(first):
            raise Refused("the command name is computed when it runs (a substitution or variable)")
        known = literal(first)
        if known is None:
            raise Refused("the command name is a glob: the files it matches choose the command")
        name = program(known)
        args = words[1:]
        if "/" in known:
            files.check_run_written(known, "shell", ctx)
        network.mentions(name, args + ([stdin.file] if stdin.file is not None else []), ctx)
        if name in NETWORK:
            ctx.facts.network.append(name)
        if name in RELAYS:
            ctx.facts.relays.append(name)
        if name in PRIVILEGE:
            raise Refused(f"{name} runs commands with other privileges")
        if system.forbidden(name, args):
            why = FORBIDDEN.get(name, "formats or repairs a filesystem")
            raise Refused(f"{name} {why}")
        if unwrap(name, args, ctx, stdin):
            return
        lang = language(name)
        if lang is not None:
            interpreters.judge(name, lang, args, ctx, stdin)
            return
        if name in (".", "source"):
            interpreters.source(name, args, ctx, stdin)
        elif name in ("cd", "pushd"):
            _cd(args, ctx)
        elif name in ("read", "mapfile", "readarray", "getopts"):
            for a in args:
                if re.fullmatch(r"[A-Za-z_]\w*", a):
                    ctx.assign(a, [UNKNOWN])
        elif name == "eval":
            self._eval(args, ctx)
        else:
            check = CHECKS.get(name)
            if check is not None:
                check(args, ctx, stdin)
            files.generic(name, args, ctx)

    def printed(self, node: Node, ctx: Context) -> list[str] | None:
        """What a command prints, as lines, when that is known without running it."""
        if node.type == "command_substitution":
            inner = [c for c in node.named_children if c.type != "comment"]
            if len(inner) != 1:
                return None
            node = inner[0]
        if node.type == "pipeline":
            stages = [c for c in node.named_children]
            node = stages[-1] if stages else node
        if node.type == "redirected_statement":
            body = node.child_by_field_name("body")
            node = body if body is not None else node
        if node.type != "command":
            return None
        name_node = node.child_by_field_name("name")
        if name_node is None:
            return None
        head = name_node.children[0] if name_node.children else name_node
        words = expand(head, ctx) + [w for a in node.children_by_field_name("argument") for w in expand(a, ctx)]
        name = program(literal(words[0]) or "") if words else ""
        args = words[1:]
        previous = _previous_stage(node)
        operands = [a for a in args if not a.startswith("-")]
        if name in FILTERS and not [a for a in args if a.startswith("-l")]:
            if previous is not None:
                return self.printed(previous, ctx)
            stdin = self._stdin(node, _redirects(node), ctx)
            if name == "cat" and not operands and stdin.code and all(c is not None for c in stdin.code):
                return "".join(c or "" for c in stdin.code).splitlines()
        if name in network.DOWNLOAD_NAMES:
            return network.DOWNLOADED
        return _printed_by(name, args, ctx)


def _printed_by(name: str, args: list[str], ctx: Context) -> list[str] | None:
    operands = [a for a in args if not a.startswith("-")]
    if name == "echo":
        return [" ".join(a for a in args if a not in ("-n", "-e", "-E"))]
    if name == "printf" and operands:
        return _printf(operands[0], operands[1:]).splitlines()
    if name in ("find", "fd", "fdfind"):
        roots = [a for a in args if not a.startswith(("-", "(", "!"))]
        roots = (roots[1:2] if name != "find" else roots[:1]) or ["."]
        return [line for r in roots for line in (r, r.rstrip("/") + "/" + DESCENDANTS)]
    if name == "ls":
        return [o.rstrip("/") + "/" + STAR for o in operands] or [STAR]
    if name == "git" and args[:1] in (["ls-files"], ["diff"], ["status"]):
        return [DESCENDANTS]
    if name in ("grep", "egrep", "rg") and any(a.startswith("-") and ("l" in a or "L" in a) for a in args):
        return [o.rstrip("/") + "/" + DESCENDANTS for o in operands[1:]] or [DESCENDANTS]
    if name in ("which", "command", "type") and operands:
        return operands[:1]
    if name == "pwd":
        return [ctx.cwd or "."]
    if name == "mktemp":
        base = next((a.split("=", 1)[1] for a in args if a.startswith("--tmpdir=")), "/tmp")
        return [base + "/" + STAR]
    if name in ("dirname", "basename", "realpath", "readlink") and operands:
        known = literal(operands[-1])
        if known is None:
            return None
        if name == "dirname":
            return [posixpath.dirname(known)]
        return [posixpath.basename(known)] if name == "basename" else [known]
    return None


def _printf(fmt: str, args: list[str]) -> str:
    """What printf prints, near enough: each conversion takes the next argument; the format repeats while
    arguments are left."""
    conversion = re.compile(r"%%|%[-#0 +]*\d*(?:\.\d+)?[sdiqbcxXoeEfgG]")
    out: list[str] = []
    rest = list(args)
    while True:
        used = 0

        def fill(m: re.Match[str]) -> str:
            nonlocal used
            if m.group(0) == "%%":
                return "%"
            used += 1
            return rest.pop(0) if rest else ""

        out.append(conversion.sub(fill, fmt))
        if not rest or not used:
            return _unescape("".join(out))


def _unescape(s: str) -> str:
    return s.replace("\\n", "\n").replace("\\t", "\t")


REDIRECTS = ("file_redirect", "heredoc_redirect", "herestring_redirect")


def _redirects(node: Node) -> list[Node]:
    """The redirections that apply to a command: its own, its statement's, and for the last command of a
    pipeline those tree-sitter hangs on the whole pipeline (`a | b > f` redirects b)."""
    out = [c for c in node.children if c.type in REDIRECTS]
    parent = node.parent
    if parent is not None and parent.type == "redirected_statement":
        out += [c for c in parent.children if c.type in REDIRECTS]
    elif parent is not None and parent.type == "pipeline":
        stages = [c for c in parent.children if c.is_named]
        outer = parent.parent
        if stages and stages[-1] == node and outer is not None and outer.type == "redirected_statement":
            out += [c for c in outer.children if c.type in REDIRECTS and c.type != "heredoc_redirect"]
    # what follows `<<EOF` on its line (`cat <<EOF > f`) is parsed inside the heredoc redirection
    return out + [c for h in out if h.type == "heredoc_redirect" for c in h.children if c.type in REDIRECTS]


def _previous_stage(node: Node) -> Node | None:
    child = node
    parent = node.parent
    while parent is not None and parent.type == "redirected_statement":
        child, parent = parent, parent.parent
    if parent is None or parent.type != "pipeline":
        return None
    stages = list(parent.children)
    at = stages.index(child)
    before = [c for c in stages[:at] if c.is_named]
    if not any(c.type in ("|", "|&") for c in stages[:at]):
        return None
    holder = parent.parent
    if not before and holder is not None and holder.type == "heredoc_redirect" and holder.parent is not None:
        before = [holder.parent]  # `cat <<EOF | sh`: tree-sitter puts the rest of the pipeline in the heredoc
    if not before:
        return None
    prev = before[-1]
    if prev.type == "redirected_statement":
        body = prev.child_by_field_name("body")
        prev = body if body is not None else prev
    return prev


def _cd(args: list[str], ctx: Context) -> None:
    target = [a for a in args if not a.startswith("-") or is_computed(a)]
    if not target:
        ctx.cwd = "~" if not args else UNKNOWN
        return
    word = target[0]
    if is_computed(word):
        ctx.cwd = UNKNOWN  # somewhere only known when it runs: paths relative to it could be anything
        return
    root, segments = normalise(word, ctx.cwd)
    joined = "/".join(segments)
    ctx.cwd = {"/": "/" + joined, "": joined or ".", "?": UNKNOWN}.get(root, "~/" + joined)


def _fork_bomb(node: Node) -> None:
    """A function that calls itself in a pipeline or in the background is a fork bomb."""
    name_node = node.child_by_field_name("name")
    body = node.child_by_field_name("body")
    if name_node is None or body is None:
        return
    name = text(name_node)
    for call in _walk(body):
        called = call.child_by_field_name("name") if call.type == "command" else None
        if called is None or text(called) != name:
            continue
        parent = call.parent
        while parent is not None and parent != node:
            if parent.type == "pipeline" or any(c.type == "&" for c in parent.children):
                raise Refused("a fork bomb (a function that starts copies of itself)")
            parent = parent.parent


CHECKS = {**files.CHECKS, **system.CHECKS, **network.CHECKS}
