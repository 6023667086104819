"""Python programs (`python3 -c`, heredocs, files this command line wrote) judged by their syntax tree.

Names are followed through imports and aliases (`import os as o`, `from os import system as s`,
`__import__('os')`, `getattr(os, 'system')`). A command Python runs (`os.system`, `subprocess.*`, `os.exec*`,
`pty.spawn`, ...) is judged as a shell command when it is a literal, and refused otherwise; deletes, moves,
writes and mode changes are judged on their paths like the shell's (`shutil.rmtree` of a computed path is
refused, as `rm -rf "$X"` is). Refused outright: code built at run time (`eval`/`exec`/`compile` of anything but
a literal, `__import__` of a computed name), Python's internals (`__globals__`, `__subclasses__`, ...), ctypes,
fork, descriptor duplication, privilege changes, unpickling; running commands in a program that also uses the
network. Code that does not parse as Python 3 is judged by the calls it names, like other languages (code.py).
"""

from __future__ import annotations

import ast
import posixpath

from glm5.parsing.shell import code as foreign
from glm5.parsing.shell.context import Context, Refused, Stdin
from glm5.parsing.shell.paths import is_credential, is_network_device, is_protected, is_top, normalise
from glm5.parsing.shell.words import DESCENDANTS, HOME, STAR, UNKNOWN, is_computed, shown

MAX_PATHS = 16
# calls that run a command: how to read it (script: a shell command line; argv: a program and its arguments)
SCRIPT_CALLS = {"os.system", "os.popen", "platform.popen", "commands.getoutput", "commands.getstatusoutput",
                "subprocess.getoutput", "subprocess.getstatusoutput", "asyncio.create_subprocess_shell"}  # fmt: skip
ARGV_CALLS = {"subprocess.run", "subprocess.call", "subprocess.check_call", "subprocess.check_output",
              "subprocess.Popen", "pty.spawn", "asyncio.create_subprocess_exec", "os.posix_spawn",
              "os.posix_spawnp"}  # fmt: skip
EXEC_FAMILY = ("os.exec", "os.spawn")
REFUSED = {"os.fork", "os.forkpty", "pty.fork", "os.dup2", "os.dup", "os.setuid", "os.setgid", "os.seteuid",
           "os.setegid", "os.setreuid", "os.setregid", "os.setresuid", "os.setresgid", "os.setgroups",
           "os.initgroups", "os.chroot", "os.putenv", "os.killpg", "os.chown", "os.lchown", "os.fchown",
           "shutil.chown", "pickle.loads", "pickle.load", "marshal.loads", "marshal.load", "os.startfile",
           "code.interact", "code.InteractiveConsole", "code.InteractiveInterpreter", "imp.load_source",
           "importlib.util.spec_from_file_location", "builtins.breakpoint", "builtins.globals", "builtins.locals",
           "builtins.vars", "os.execvpe", "sys.settrace", "os.system"}  # fmt: skip
REFUSED_MODULES = ("ctypes", "cffi", "_posixsubprocess", "pexpect", "sh", "plumbum", "fabric", "invoke", "runpy",
                   "multiprocessing.popen_fork", "_ctypes", "_winapi")  # fmt: skip
DYNAMIC = {"builtins.eval", "builtins.exec", "builtins.compile", "builtins.execfile"}
INTERNALS = {"__globals__", "__builtins__", "__subclasses__", "__getattribute__", "__code__", "__closure__",
             "__reduce__", "__reduce_ex__", "__loader__", "__import__", "__bases__", "__base__", "__mro__",
             "__self__", "__func__", "__class__", "__dict__", "__spec__", "func_globals"}  # fmt: skip
NETWORK_MODULES = {"socket", "urllib", "urllib2", "urllib3", "http", "requests", "httpx", "aiohttp", "ftplib",
                   "smtplib", "telnetlib", "paramiko", "pycurl", "websocket", "websockets", "xmlrpc",
                   "socketserver", "poplib", "imaplib", "nntplib", "ssl", "asyncssh"}  # fmt: skip
BUILTINS = {"eval", "exec", "compile", "execfile", "__import__", "getattr", "open", "globals", "locals", "vars",
            "breakpoint"}  # fmt: skip
DELETE_TREE = {"shutil.rmtree"}
DELETE = {"os.remove", "os.unlink", "os.rmdir", "os.removedirs"}
MOVE = {"os.rename", "os.replace", "os.renames", "shutil.move"}
COPY_TO = {"shutil.copy", "shutil.copy2", "shutil.copyfile", "shutil.copytree", "shutil.copymode",
           "shutil.copystat", "os.link", "os.symlink"}  # fmt: skip
WRITE_FIRST = {"os.truncate", "os.mknod", "os.utime", "os.mkfifo"}
OPEN = {"builtins.open", "io.open", "codecs.open", "os.open", "io.FileIO", "os.fdopen"}
CHMOD = {"os.chmod", "os.lchmod"}
PATH_TYPES = {"pathlib.Path", "pathlib.PosixPath", "pathlib.PurePath", "pathlib.PurePosixPath"}
PATH_METHODS = {"write_text", "write_bytes", "touch", "unlink", "rmdir", "rename", "replace", "symlink_to",
                "hardlink_to", "chmod", "lchmod", "open"}  # fmt: skip
WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND"}
SERVERS = {"http.server", "SimpleHTTPServer", "uploadserver", "pyftpdlib", "smtpd", "aiosmtpd", "wsgiref"}


def judge(code: str, ctx: Context, argv: list[str]) -> None:
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        foreign.judge("python", code, ctx, argv)
        return
    _Python(ctx, argv).run(tree)


def module(name: str, argv: list[str], ctx: Context) -> None:
    """`python -m MODULE ARGS`."""
    from glm5.parsing.shell import network
    from glm5.parsing.shell.files import check_extraction

    root = name.split(".")[0]
    if name in SERVERS or root in SERVERS:
        ctx.facts.network.append(f"python -m {name}")
        places = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("-d", "--directory")]
        places += [a.split("=", 1)[1] for a in argv if a.startswith("--directory=")]
        network.mentions("python", [*places, ctx.cwd or "."], ctx)
    elif name == "timeit":
        for stmt in [a for i, a in enumerate(argv) if not a.startswith("-") and (i == 0 or argv[i - 1] != "-n")]:
            judge(stmt, ctx.nested(), [])
    elif name in ("zipfile", "tarfile") and "-e" in argv:
        at = argv.index("-e")
        check_extraction(argv[at + 2 : at + 3], ctx, f"python -m {name} extracts into")
    elif name in ("code", "pdb", "asyncio", "idlelib", "IPython") and not argv:
        raise Refused(f"python -m {name} reads commands from a terminal: an interactive shell")
    elif name in ("pip", "pip3") and argv[:1] == ["install"]:
        from glm5.parsing.shell.files import check_writes

        targets = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("-t", "--target", "--prefix", "--root")]
        check_writes(targets, ctx, "pip installs into")


class _Python(ast.NodeVisitor):
    def __init__(self, ctx: Context, argv: list[str]) -> None:
        self.ctx = ctx
        self.argv = argv
        self.aliases: dict[str, str] = {}
        self.star: list[str] = []
        self.assigned: dict[str, list[ast.expr]] = {}
        self.loops: dict[str, ast.expr] = {}
        self.called: set[int] = set()
        self.network: list[str] = []
        self.runs: list[str] = []

    def run(self, tree: ast.AST) -> None:
        for node in ast.walk(tree):
            self._collect(node)
        self.visit(tree)
        if self.network:
            self.ctx.facts.network.extend(self.network)
        if self.network and self.runs:
            raise Refused(f"Python code that uses the network ({self.network[0]}) and runs {self.runs[0]}")

    def _collect(self, node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                self._imported(a.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if a.name == "*":
                    self.star.append(node.module)
                else:
                    self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            self._imported(node.module)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    self.assigned.setdefault(target.id, []).append(node.value)
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and isinstance(node.target, ast.Name) and node.value:
            self.assigned.setdefault(node.target.id, []).append(node.value)
        elif isinstance(node, (ast.For, ast.comprehension)):
            target = node.target
            elements = target.elts if isinstance(target, ast.Tuple) else [target]
            names = [e for e in elements if isinstance(e, ast.Name)]
            for i, name in enumerate(names):
                self.loops[name.id] = node.iter if i == 0 else ast.Constant(UNKNOWN)

    def _imported(self, name: str) -> None:
        root = name.split(".")[0]
        if root in NETWORK_MODULES:
            self.network.append(f"python {name}")
        if root in REFUSED_MODULES or name in REFUSED_MODULES:
            raise Refused(f"Python code imports {name}, which runs native code or commands")

    # -- names ------------------------------------------------------------------------------------------------

    def qualname(self, expr: ast.expr, depth: int = 0) -> str | None:
        if depth > 8:
            return None
        if isinstance(expr, ast.Name):
            if expr.id in self.aliases:
                return self.aliases[expr.id]
            values = self.assigned.get(expr.id, [])
            if len(values) == 1 and not isinstance(values[0], ast.Constant):
                q = self.qualname(values[0], depth + 1)
                if q is not None:
                    return q
            if expr.id in BUILTINS:
                return f"builtins.{expr.id}"
            for mod in self.star:
                return f"{mod}.{expr.id}"
            return None
        if isinstance(expr, ast.Attribute):
            base = self.qualname(expr.value, depth + 1)
            return f"{base}.{expr.attr}" if base else None
        if isinstance(expr, ast.Call):
            func = self.qualname(expr.func, depth + 1)
            first = _literal(expr.args[0]) if expr.args else None
            if func in ("builtins.__import__", "importlib.import_module", "importlib.__import__"):
                if first is None:
                    raise Refused("Python code imports a module whose name is computed when it runs")
                self._imported(first)
                return first
            if func == "builtins.getattr" and len(expr.args) >= 2:
                attr = _literal(expr.args[1])
                if attr is None:
                    raise Refused("Python code reaches an attribute whose name is computed when it runs (getattr)")
                base = self.qualname(expr.args[0], depth + 1)
                return f"{base}.{attr}" if base else None
        return None

    # -- visits -----------------------------------------------------------------------------------------------

    def visit_Call(self, node: ast.Call) -> None:
        self.called.add(id(node.func))
        q = self.qualname(node.func)
        if q is not None:
            self._call(q, node)
        elif isinstance(node.func, ast.Attribute) and node.func.attr in PATH_METHODS:
            self._path_method(node.func.attr, node.func.value, node)
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in INTERNALS:
            raise Refused(f"Python code reaches its own internals ({node.attr})")
        if id(node) not in self.called:
            self._reference(node)
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in ("__builtins__", "__import__") and id(node) not in self.called:
            raise Refused(f"Python code reaches its own internals ({node.id})")
        if id(node) not in self.called and isinstance(node.ctx, ast.Load):
            self._reference(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str):
            self._text(node.value)

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        for p in self.paths(node):
            self._text(p)
        self.generic_visit(node)

    def visit_keyword(self, node: ast.keyword) -> None:
        if node.arg in ("LD_PRELOAD", "LD_AUDIT"):
            raise Refused(f"Python code sets {node.arg}, which loads a library into every program it starts")
        self.generic_visit(node)

    def _text(self, s: str) -> None:
        if "/dev/tcp/" in s or "/dev/udp/" in s:
            raise Refused("Python code opens /dev/tcp: a reverse shell")
        if s in ("LD_PRELOAD", "LD_AUDIT"):
            raise Refused(f"Python code sets {s}, which loads a library into every program it starts")
        if s.startswith(("/", "~", HOME)) or "/." in s:
            path = normalise(s)
            if is_credential(path):
                self.ctx.facts.credentials.append(shown(s))

    def _reference(self, node: ast.expr) -> None:
        q = self.qualname(node)
        if q is None:
            return
        if _dangerous(q) or q in DELETE_TREE | DELETE | MOVE | COPY_TO | CHMOD | DYNAMIC:
            raise Refused(f"Python code passes {q} around instead of calling it on known arguments")

    # -- calls ------------------------------------------------------------------------------------------------

    def _call(self, q: str, node: ast.Call) -> None:
        args = node.args
        if q in DYNAMIC:
            text = _literal(args[0]) if args else None
            if text is None:
                raise Refused(f"Python code runs code built when it runs ({q.split('.')[-1]})")
            judge(text, self.ctx.nested(), self.argv)
            return
        if q in SCRIPT_CALLS or q in ARGV_CALLS or q.startswith(EXEC_FAMILY):
            self._runs(q, node)
            return
        if _dangerous(q):
            raise Refused(f"Python code calls {q}")
        if q == "os.kill" and args and _literal_int(args[0]) in (-1, 0, 1):
            raise Refused("Python code kills every process (or init)")
        if q in DELETE_TREE:
            self._deletes(args[:1], recursive=True)
        elif q in DELETE:
            self._deletes(args[:1], recursive=False)
        elif q in MOVE:
            self._deletes(args[:1], recursive=True, what="moves")
            self._writes(args[1:2])
        elif q in COPY_TO:
            self._writes(args[1:2])
        elif q in WRITE_FIRST:
            self._writes(args[:1])
            if q == "os.mkfifo":
                self.ctx.facts.fifos.append("os.mkfifo")
        elif q in OPEN:
            if _opens_for_writing(q, node):
                self._writes(args[:1], content=None)
        elif q in CHMOD:
            self._chmod(args[:1], args[1] if len(args) > 1 else None)
        elif q in ("urllib.request.urlretrieve", "urllib.urlretrieve") and len(args) >= 2:
            for p in self.paths(args[1]):
                self.ctx.facts.write(posixpath.basename(p), None, downloaded=True)
        elif q.rsplit(".", 1)[-1] in PATH_METHODS and q.split(".")[0] == "pathlib":
            pass
        if q in PATH_TYPES:
            return

    def _runs(self, q: str, node: ast.Call) -> None:
        args = node.args
        shell = any(k.arg == "shell" and not (isinstance(k.value, ast.Constant) and not k.value.value)
                    for k in node.keywords)  # fmt: skip
        self.runs.append(q)
        first = args[0] if args else next((k.value for k in node.keywords if k.arg in ("args", "cmd")), None)
        if q.startswith(EXEC_FAMILY):
            skip = 1 if q.startswith("os.spawn") else 0
            rest = args[skip:]
            program = _literal(rest[0]) if rest else None
            if q.endswith(("v", "ve", "vp", "vpe")):
                words = _literal_list(rest[1]) if len(rest) > 1 else None
                argv = None if program is None or words is None else [program, *words[1:]]
            else:
                pieces = [_literal(a) for a in rest[2:]]
                known = [w for w in pieces if w is not None]
                argv = None if program is None or len(known) < len(pieces) else [program, *known]
        elif q in SCRIPT_CALLS or (shell and first is not None and _literal(first) is not None):
            script = _literal(first) if first is not None else None
            if script is None:
                raise Refused(f"Python code runs a command computed when it runs ({q})")
            self.ctx.judge.script(script, self.ctx.nested())
            return
        elif q in ("os.posix_spawn", "os.posix_spawnp"):
            program = _literal(args[0]) if args else None
            words = _literal_list(args[1]) if len(args) > 1 else None
            argv = None if program is None or words is None else [program, *words[1:]]
        elif q == "asyncio.create_subprocess_exec":
            pieces = [_literal(a) for a in args]
            known = [w for w in pieces if w is not None]
            argv = None if len(known) < len(pieces) else known
        else:
            argv = _literal_list(first) if first is not None else None
            if argv is None and first is not None and _literal(first) is not None:
                argv = [_literal(first) or ""]
        if not argv:
            raise Refused(f"Python code runs a command computed when it runs ({q})")
        self.ctx.judge.argv(argv, self.ctx.nested(), Stdin())

    def _path_method(self, method: str, obj: ast.expr, node: ast.Call) -> None:
        if method in ("rename", "replace") and not self._pathlike(obj):
            return  # str.replace
        if method == "open" and not self._pathlike(obj):
            return
        if method in ("unlink", "rmdir"):
            self._deletes([obj], recursive=False)
        elif method in ("rename", "replace"):
            self._deletes([obj], recursive=True, what="moves")
            self._writes(node.args[:1])
        elif method in ("chmod", "lchmod"):
            self._chmod([obj], node.args[0] if node.args else None)
        elif method == "open":
            mode = _literal(node.args[0]) if node.args else _keyword(node, "mode", "r")
            if mode is None or any(c in mode for c in "wax+"):
                self._writes([obj])
        else:
            content = _literal(node.args[0]) if method == "write_text" and node.args else None
            self._writes([obj], content=content)

    def _pathlike(self, expr: ast.expr, depth: int = 0) -> bool:
        if depth > 6:
            return False
        if isinstance(expr, ast.Call):
            q = self.qualname(expr.func)
            if q in PATH_TYPES or (q is not None and q.startswith("pathlib.Path.")):
                return True
            return isinstance(expr.func, ast.Attribute) and self._pathlike(expr.func.value, depth + 1)
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Div):
            return True
        if isinstance(expr, ast.Attribute):
            return self._pathlike(expr.value, depth + 1)
        if isinstance(expr, ast.Name):
            values = self.assigned.get(expr.id, []) + ([self.loops[expr.id]] if expr.id in self.loops else [])
            return any(self._pathlike(v, depth + 1) for v in values)
        return False

    def _deletes(self, exprs: list[ast.expr], recursive: bool, what: str = "deletes") -> None:
        for expr in exprs:
            for p in self.paths(expr):
                path = normalise(p)
                if recursive and (is_computed(p) and path[0] in ("?", "")) and what == "deletes":
                    raise Refused("Python code deletes a tree at a path computed when it runs")
                if (recursive and is_top(path)) or is_protected(path):
                    raise Refused(f"Python code {what} {shown(p)}")

    def _writes(self, exprs: list[ast.expr], content: str | None = None) -> None:
        for expr in exprs:
            for p in self.paths(expr):
                path = normalise(p)
                if is_protected(path) or is_network_device(path):
                    raise Refused(f"Python code writes to {shown(p)}")
                if not is_computed(p):
                    self.ctx.facts.write(posixpath.basename(p), content)

    def _chmod(self, exprs: list[ast.expr], mode: ast.expr | None) -> None:
        bits = _mode_bits(mode) if mode is not None else None
        if bits is None or bits & 0o6000:
            raise Refused("Python code sets setuid/setgid bits (or a mode computed when it runs)")
        for expr in exprs:
            for p in self.paths(expr):
                if is_protected(normalise(p)):
                    raise Refused(f"Python code changes the mode of {shown(p)}")

    # -- values -----------------------------------------------------------------------------------------------

    def paths(self, expr: ast.expr, depth: int = 0) -> list[str]:
        """The strings a path expression may be, with what is computed at run time as UNKNOWN."""
        out = self._paths(expr, depth)
        return out[:MAX_PATHS] if len(out) <= MAX_PATHS else [UNKNOWN]

    def _paths(self, expr: ast.expr, depth: int) -> list[str]:
        if depth > 8:
            return [UNKNOWN]
        if isinstance(expr, ast.Constant):
            return [expr.value] if isinstance(expr.value, str) else [UNKNOWN]
        if isinstance(expr, ast.JoinedStr):
            parts: list[list[str]] = []
            for v in expr.values:
                if isinstance(v, ast.Constant) and isinstance(v.value, str):
                    parts.append([v.value])
                elif isinstance(v, ast.FormattedValue):
                    parts.append(self._paths(v.value, depth + 1))
            return _join_all(parts, "")
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, (ast.Add, ast.Div)):
            sep = "/" if isinstance(expr.op, ast.Div) else ""
            left, right = self._paths(expr.left, depth + 1), self._paths(expr.right, depth + 1)
            return [_joined(a, b) if sep else a + b for a in left for b in right]
        if isinstance(expr, (ast.List, ast.Tuple, ast.Set)):
            return [p for e in expr.elts for p in self._paths(e, depth + 1)]
        if isinstance(expr, ast.Name):
            values = self.assigned.get(expr.id, [])
            if expr.id in self.loops:
                return self._iterated(self.loops[expr.id], depth + 1)
            if values:
                return [p for v in values for p in self._paths(v, depth + 1)]
            return [UNKNOWN]
        if isinstance(expr, ast.Subscript):
            base = self.qualname(expr.value)
            index = _literal_int(expr.slice)
            if base == "sys.argv" and index is not None and index >= 1:
                return [self.argv[index - 1]] if index - 1 < len(self.argv) else [UNKNOWN]
            if base in ("os.environ",) and _literal(expr.slice) == "HOME":
                return [HOME]
            return [UNKNOWN]
        if isinstance(expr, ast.Attribute):
            if expr.attr == "parent":
                return [posixpath.dirname(p) for p in self._paths(expr.value, depth + 1)]
            return [UNKNOWN]
        if isinstance(expr, ast.Call):
            return self._call_paths(expr, depth)
        return [UNKNOWN]

    def _call_paths(self, expr: ast.Call, depth: int) -> list[str]:
        q = self.qualname(expr.func)
        args = [self._paths(a, depth + 1) for a in expr.args]
        if q in ("os.path.join", "posixpath.join") or q in PATH_TYPES:
            return _join_all(args, "/") if args else ["."]
        if q in ("os.path.expanduser", "os.path.expandvars", "os.path.abspath", "os.path.realpath",
                 "os.path.normpath", "builtins.str", "os.fspath") and args:  # fmt: skip
            return args[0]
        if q in ("os.getenv", "os.environ.get") and expr.args and _literal(expr.args[0]) == "HOME":
            return [HOME]
        if q in ("pathlib.Path.home", "os.path.expanduser") or (q or "").endswith("Path.home"):
            return [HOME]
        if q in ("os.getcwd", "pathlib.Path.cwd"):
            return ["."]
        if q in ("tempfile.mkdtemp", "tempfile.mkstemp", "tempfile.gettempdir"):
            return ["/tmp/" + STAR]
        if q in ("os.path.dirname",) and args:
            return [posixpath.dirname(p) for p in args[0]]
        if isinstance(expr.func, ast.Attribute):
            method = expr.func.attr
            base = self._paths(expr.func.value, depth + 1)
            if method in ("expanduser", "resolve", "absolute", "strip", "rstrip", "with_suffix", "with_name"):
                return base
            if method == "joinpath":
                return _join_all([base, *args], "/")
            if method == "format":
                return [UNKNOWN]
        return [UNKNOWN]

    def _iterated(self, expr: ast.expr, depth: int) -> list[str]:
        """What a loop over `expr` gives each time."""
        if isinstance(expr, ast.Call):
            q = self.qualname(expr.func) or ""
            args = [self._paths(a, depth + 1) for a in expr.args]
            if q in ("glob.glob", "glob.iglob") and args:
                return [_globbed(p) for p in args[0]]
            if q in ("os.listdir", "os.scandir"):
                return [STAR]
            if q == "os.walk" and args:
                return [p.rstrip("/") + "/" + DESCENDANTS for p in args[0]]
            if isinstance(expr.func, ast.Attribute) and expr.func.attr in ("glob", "rglob", "iterdir"):
                base = self._paths(expr.func.value, depth + 1)
                pattern = _globbed(args[0][0]) if args and args[0] else STAR
                sep = "/" + DESCENDANTS + "/" if expr.func.attr == "rglob" else "/"
                return [b.rstrip("/") + sep + pattern for b in base]
        if isinstance(expr, (ast.List, ast.Tuple, ast.Set)):
            return self._paths(expr, depth)
        if isinstance(expr, ast.Subscript) and self.qualname(expr.value) == "sys.argv":
            return self.argv or [UNKNOWN]
        return [UNKNOWN]


def _dangerous(q: str) -> bool:
    if q in REFUSED or q.startswith(tuple(m + "." for m in REFUSED_MODULES)):
        return True
    return q.startswith(EXEC_FAMILY)


def _literal(expr: ast.expr | None) -> str | None:
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return expr.value
    if isinstance(expr, ast.JoinedStr) and all(isinstance(v, ast.Constant) for v in expr.values):
        return "".join(str(v.value) for v in expr.values if isinstance(v, ast.Constant))
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        left, right = _literal(expr.left), _literal(expr.right)
        return left + right if left is not None and right is not None else None
    return None


def _literal_int(expr: ast.expr | None) -> int | None:
    if isinstance(expr, ast.Constant) and isinstance(expr.value, int):
        return expr.value
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub):
        inner = _literal_int(expr.operand)
        return -inner if inner is not None else None
    return None


def _literal_list(expr: ast.expr) -> list[str] | None:
    if isinstance(expr, (ast.List, ast.Tuple)):
        words = [_literal(e) for e in expr.elts]
        return None if any(w is None for w in words) else [w for w in words if w is not None]
    text = _literal(expr)
    return [text] if text is not None else None


def _keyword(node: ast.Call, name: str, default: str) -> str | None:
    for k in node.keywords:
        if k.arg == name:
            return _literal(k.value)
    return default


def _opens_for_writing(q: str, node: ast.Call) -> bool:
    if q == "os.open":
        flags = node.args[1] if len(node.args) > 1 else None
        if flags is None:
            return False
        names = {n.attr for n in ast.walk(flags) if isinstance(n, ast.Attribute)}
        names |= {n.id for n in ast.walk(flags) if isinstance(n, ast.Name)}
        return bool(names & WRITE_FLAGS) or not names
    if q == "os.fdopen":
        return False
    mode = _literal(node.args[1]) if len(node.args) > 1 else _keyword(node, "mode", "r")
    return mode is None or any(c in mode for c in "wax+")


def _mode_bits(expr: ast.expr) -> int | None:
    if isinstance(expr, ast.Constant) and isinstance(expr.value, int):
        return expr.value
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.BitOr):
        left, right = _mode_bits(expr.left), _mode_bits(expr.right)
        return left | right if left is not None and right is not None else None
    if isinstance(expr, ast.Attribute) and expr.attr.startswith("S_I"):
        return 0o6000 if expr.attr in ("S_ISUID", "S_ISGID") else 0o777
    return None


def _joined(a: str, b: str) -> str:
    return b if b.startswith("/") else (a.rstrip("/") + "/" + b if a else b)


def _join_all(parts: list[list[str]], sep: str) -> list[str]:
    out = [""]
    for options in parts:
        out = [(_joined(o, p) if sep else o + p) if o else p for o in out for p in options]
        if len(out) > MAX_PATHS:
            return [UNKNOWN]
    return out


def _globbed(pattern: str) -> str:
    return pattern.replace("*", STAR)
