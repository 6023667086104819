"""Code for interpreters other than the shell and Python, judged by the calls it names.

This is deliberately coarse and conservative: a Perl, Ruby, Node, PHP, Lua, Tcl, R, Julia, AppleScript or
PowerShell program is refused when it names a way to run a command (`system`, backticks, `child_process`,
`os.execute`, ...) or to build code at run time (`eval`, `Function`, `send`, `$f()`...); a delete, write or mode
change is refused when one of its string literals or arguments is a protected path (or, for a recursive delete,
when it has none to judge). awk is judged for `system()`, command pipes, `/inet/` sockets and output files; sed
for its `e` command and `s///e`, and for `w` files. What this does not see: code that spells a call in a way
these patterns miss (string-built names in languages without `eval`). The sandbox is the first layer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from glm5.parsing.shell.context import Context, Refused
from glm5.parsing.shell.paths import is_credential, is_protected, is_top, normalise
from glm5.parsing.shell.words import HOME, UNKNOWN, shown


@dataclass(frozen=True, slots=True)
class Rules:
    runs: str
    dynamic: str = r"(?!x)x"
    deletes: str = r"(?!x)x"
    trees: str = r"(?!x)x"
    writes: str = r"(?!x)x"
    modes: str = r"(?!x)x"
    owners: str = r"(?!x)x"
    network: str = r"(?!x)x"


RULES = {
    "perl": Rules(
        runs=r"\b(system|exec|qx|readpipe|fork|syscall|open[23]|pipe_(from|to)_fork)\b|`|\bIPC::|\bProc::",
        dynamic=r"\beval\b(?!\s*\{)|\bdo\s*['\"$]|\brequire\s+\$|&\s*\$|&\s*\{|->\s*\$\w+\s*\(|\bcan\s*\(|"
        r"\bs([/|#!,])(?:\\.|(?!\1).)*\1(?:\\.|(?!\1).)*\1[msixpodualngcr]*e",
        deletes=r"\b(unlink|rmdir|rmtree|remove_tree)\b",
        trees=r"\b(rmtree|remove_tree)\b",
        writes=r"\b(sysopen|rename|link|symlink|truncate|utime|copy|move|mkpath|make_path)\b|>",
        modes=r"\bchmod\b",
        owners=r"\bchown\b",
        network=r"\b(IO::Socket|Socket|LWP|HTTP::|Net::|socket|connect)\b",
    ),
    "ruby": Rules(
        runs=r"\b(system|exec|spawn|fork|syscall|popen\d?|capture[23]e?|pipeline\w*|Open3|PTY|Kernel\.open)\b|`|"
        r"%x|\bopen\s*\(?\s*['\"]\|",
        dynamic=r"\b(eval|instance_eval|class_eval|module_eval|instance_exec|class_exec|send|__send__|public_send|"
        r"const_get|method|define_method|binding|ObjectSpace|load)\b|\brequire\s*\(?\s*[^'\"\s(]",
        deletes=r"\b(delete|unlink|rmdir|rm|rm_f|rm_r|rm_rf|rmtree|safe_unlink|remove_file|remove_dir|remove_entry"
        r"|remove_entry_secure|remove)\b",
        trees=r"\b(rm_r|rm_rf|rmtree|remove_dir|remove_entry|remove_entry_secure)\b",
        writes=r"\b(write|binwrite|cp|cp_r|mv|ln|ln_s|ln_sf|install|touch|rename|symlink|link|copy|copy_file|move"
        r"|truncate|syswrite|mkdir_p)\b|['\"][wa]\+?b?['\"]",
        modes=r"\bchmod(_R)?\b",
        owners=r"\bchown(_R)?\b",
        network=r"\b(TCPSocket|UDPSocket|Socket|Net::|URI\.open|open-uri|HTTParty|Faraday|RestClient|httpd)\b",
    ),
    "node": Rules(
        runs=r"\b(child_process|execSync|execFileSync|spawnSync|execFile|exec|spawn|fork|Deno\.run|Deno\.Command|"
        r"Bun\.spawn\w*|shelljs|process\.binding|process\.dlopen|zx)\b|\$`|\bBun\.\$",
        dynamic=r"\b(eval|Function|vm|constructor\.constructor|mainModule|module\.constructor)\b|"
        r"\b(setTimeout|setInterval)\s*\(\s*['\"`]|\b(globalThis|global|this)\s*\[|"
        r"\brequire\s*\(\s*[^'\"`\s)]|\bimport\s*\(\s*[^'\"`\s)]",
        deletes=r"\b(unlink|unlinkSync|rm|rmSync|rmdir|rmdirSync|Deno\.remove|remove|removeSync|emptyDir|"
        r"emptyDirSync|rimraf|deleteSync)\b",
        trees=r"\brecursive\b|\b(rimraf|removeSync|remove|emptyDir|emptyDirSync|deleteSync)\b",
        writes=r"\b(writeFile|writeFileSync|appendFile|appendFileSync|createWriteStream|copyFile|copyFileSync|cp|"
        r"cpSync|rename|renameSync|symlink|symlinkSync|link|linkSync|truncate|truncateSync|outputFile|"
        r"outputFileSync|writeTextFile|Bun\.write|openSync|open)\b",
        modes=r"\b(chmod|chmodSync|lchmod|lchmodSync)\b",
        owners=r"\b(chown|chownSync|lchown|lchownSync)\b",
        network=r"\b(net|http|https|dgram|tls|fetch|XMLHttpRequest|WebSocket|axios|request|got|undici)\b",
    ),
    "php": Rules(
        runs=r"\b(system|exec|shell_exec|passthru|popen|proc_open|pcntl_exec|pcntl_fork|mail|dl|expect_popen)\b|`",
        dynamic=r"\b(eval|assert|create_function|call_user_func|call_user_func_array|include|include_once|require|"
        r"require_once|ReflectionFunction|array_map|array_filter|usort|register_shutdown_function|extract|"
        r"parse_str|preg_replace_callback)\b|\$\w+\s*\(|\$\{|\$\$|preg_replace\s*\(\s*['\"](.).*\1[a-z]*e",
        deletes=r"\b(unlink|rmdir)\b",
        writes=r"\b(file_put_contents|fopen|fwrite|fputs|rename|copy|symlink|link|touch|move_uploaded_file)\b",
        modes=r"\bchmod\b",
        owners=r"\b(chown|chgrp|lchown|lchgrp)\b",
        network=r"\b(fsockopen|pfsockopen|socket_create|socket_connect|stream_socket_client|curl_exec|curl_init|"
        r"get_headers)\b|https?://",
    ),
    "lua": Rules(
        runs=r"\b(os\.execute|io\.popen|posix\.exec\w*|posix\.fork|posix\.spawn)\b",
        dynamic=r"\b(load|loadstring|dofile|loadfile)\b|\brequire\s*\(?\s*[^'\"\s(]",
        deletes=r"\b(os\.remove|lfs\.rmdir)\b",
        writes=r"\b(io\.open|io\.output|os\.rename|lfs\.link|lfs\.touch)\b",
        network=r"\b(socket|http)\b",
    ),
    "tcl": Rules(
        runs=r"\b(exec|spawn|system|interact)\b|\bopen\s+[\"{]?\|",
        dynamic=r"\b(eval|uplevel|interp|subst|source|after)\b",
        deletes=r"\bfile\s+delete\b",
        trees=r"\bfile\s+delete\s+-force\b",
        writes=r"\bopen\b|\bfile\s+(rename|copy|link|attributes)\b",
        network=r"\bsocket\b|\bhttp::",
    ),
    "r": Rules(
        runs=r"\b(system|system2|shell|pipe|processx|exec_wait|exec_background|callr)\b",
        dynamic=r"\b(eval|evalq|parse|source|do\.call|get|match\.fun|sys\.source)\b",
        deletes=r"\b(unlink|file\.remove|dir_delete|file_delete)\b",
        trees=r"\brecursive\s*=\s*(TRUE|T)\b|\bdir_delete\b",
        writes=r"\b(writeLines|write|cat|sink|file\.copy|file\.rename|file\.create|saveRDS|save|write\.csv|"
        r"write\.table|file\.symlink|download\.file)\b",
        modes=r"\bSys\.chmod\b",
        network=r"\b(url|download\.file|httr|curl|RCurl|socketConnection)\b",
    ),
    "julia": Rules(
        runs=r"\b(run|pipeline|spawn|ccall|success)\b|`",
        dynamic=r"\b(eval|Meta\.parse|include_string|include|Core\.eval)\b|@eval",
        deletes=r"\brm\b",
        trees=r"\brecursive\s*=\s*true\b",
        writes=r"\b(write|open|cp|mv|symlink|hardlink|touch)\b",
        modes=r"\bchmod\b",
        owners=r"\bchown\b",
        network=r"\b(Sockets|HTTP|download|Downloads|connect)\b",
    ),
    "applescript": Rules(
        runs=r"(?i)do\s+shell\s+script|doShellScript|\$\.system|\bObjC\b|NSTask|\bProcess\(\)",
        dynamic=r"(?i)\brun\s+script\b",
        deletes=r"(?i)\bdelete\b|removeItem",
        writes=r"(?i)\bwrite\b",
    ),
    "powershell": Rules(
        runs=r"(?i)\b(start-process|saps|invoke-expression|iex|invoke-command|icm|invoke-item|cmd(\.exe)?|bash|sh|"
        r"wsl)\b|diagnostics\.process|&\s*['\"$({]|^\s*\.\s+['\"$]",
        dynamic=r"(?i)\bscriptblock\b|\badd-type\b",
        deletes=r"(?i)\b(remove-item|rm|del|erase|rd|rmdir|ri|clear-content)\b",
        trees=r"(?i)-recurse\b",
        writes=r"(?i)\b(set-content|add-content|out-file|copy-item|move-item|new-item|sc|ac|cp|copy|mv|move|"
        r"tee-object)\b|>",
        network=r"(?i)\b(invoke-webrequest|iwr|invoke-restmethod|irm|webclient|downloadstring|downloadfile|"
        r"tcpclient|start-bitstransfer)\b",
    ),
    "dc": Rules(runs=r"!"),
}
_EVERY = Rules(runs="|".join(f"(?:{r.runs.removeprefix('(?i)')})" for r in RULES.values() if r.runs != "!"),
               dynamic="|".join(f"(?:{r.dynamic.removeprefix('(?i)')})" for r in RULES.values()))  # fmt: skip
_HOME = re.compile(
    r"\$ENV\{\s*['\"]?HOME['\"]?\s*\}|ENV\[\s*['\"]HOME['\"]\s*\]|process\.env\.HOME|process\.env\[\s*['\"]HOME"
    r"['\"]\s*\]|os\.homedir\(\s*\)|Dir\.home|\bhomedir\b|getenv\(\s*['\"]HOME['\"]\s*\)|\$_SERVER\[\s*['\"]HOME"
    r"['\"]\s*\]|Sys\.getenv\(\s*['\"]HOME['\"]\s*\)|\$\{?HOME\}?|\$env:(HOME|USERPROFILE)|expanduser|path\.home"
    r"|ENVIRON\[\s*\"HOME\"\s*\]|homedir\(\)"
)
_STRING = re.compile(r"'((?:[^'\\]|\\.)*)'|\"((?:[^\"\\]|\\.)*)\"|`((?:[^`\\]|\\.)*)`")
_INTERPOLATION = re.compile(r"\$\{[^}]*\}|#\{[^}]*\}|\$\w+(?:\{[^}]*\})?|@\w+")
_SETUID = re.compile(r"\b0?o?[2-7][0-7]{3}\b|\b[ugoa]*[+=][rwxXt]*s")


def judge(lang: str, text: str, ctx: Context, argv: list[str]) -> None:
    rules = RULES.get(lang, _EVERY)
    if "/dev/tcp/" in text or "/dev/udp/" in text:
        raise Refused(f"{lang} code opens /dev/tcp: a reverse shell")
    for kind, pattern in (("runs commands", rules.runs), ("builds code at run time", rules.dynamic),
                          ("changes file ownership", rules.owners)):  # fmt: skip
        m = re.search(pattern, text, flags=re.M)
        if m is not None:
            raise Refused(f"{lang} code {kind} ({m.group(0).strip()})")
    candidates = literals(text) + argv
    home = bool(_HOME.search(text))
    if home:
        candidates += [HOME] + [HOME + ("" if c.startswith("/") else "/") + c for c in candidates
                                if not c.startswith((HOME, "~"))]  # fmt: skip
    deletes = re.search(rules.deletes, text) is not None
    trees = deletes and re.search(rules.trees, text) is not None
    writes = re.search(rules.writes, text) is not None or deletes
    if trees and not candidates:
        raise Refused(f"{lang} code deletes a tree at a path computed when it runs")
    for c in candidates:
        path = normalise(c)
        if (trees and is_top(path)) or ((writes or deletes) and is_protected(path)):
            raise Refused(f"{lang} code {'deletes' if deletes else 'writes to'} {shown(c)}")
        if is_credential(path):
            ctx.facts.credentials.append(shown(c))
    if re.search(rules.modes, text) and (_SETUID.search(text) or any(is_protected(normalise(c)) for c in candidates)):
        raise Refused(f"{lang} code sets setuid bits or changes the mode of a protected path")
    if re.search(rules.network, text):
        ctx.facts.network.append(f"{lang} code")


def literals(text: str) -> list[str]:
    """The string literals of a program, `>`/`<` open modes stripped, interpolations computed, home references
    as the home directory."""
    out: list[str] = []
    for m in _STRING.finditer(_HOME.sub(HOME, text)):
        s = next(g for g in m.groups() if g is not None)
        s = _INTERPOLATION.sub(UNKNOWN, s).lstrip("+<>|&= ")
        if s:
            out.append(s)
    return out


def awk(text: str, ctx: Context) -> None:
    if "/inet/" in text:
        raise Refused("awk opens a network socket (/inet/)")
    if re.search(r"\bsystem\s*\(|@load\b", text):
        raise Refused("awk runs commands (system)")
    if re.search(r"(?<!\|)\|&?(?!\|)\s*getline|\b(print|printf)\b[^;}\n]*?(?<!\|)\|&?(?!\|)\s*[\"\w(]", text):
        raise Refused("awk pipes into or out of a command")
    for target in re.findall(r"\b(?:print|printf)\b[^;}\n]*?>>?\s*\"([^\"]+)\"", text):
        if is_protected(normalise(_HOME.sub(HOME, target))):
            raise Refused(f"awk writes to {target}")
    for lit in literals(text):
        if is_credential(normalise(lit)):
            ctx.facts.credentials.append(lit)


# -- sed ------------------------------------------------------------------------------------------------------


def sed(args: list[str], ctx: Context) -> None:
    from glm5.parsing.shell.files import check_writes

    in_place = sandbox = False
    scripts: list[str] = []
    script_files: list[str] = []
    operands: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        i += 1
        if a == "--":
            operands += args[i:]
            break
        if a.startswith("--"):
            key, eq, val = a.partition("=")
            in_place |= key == "--in-place"
            sandbox |= key == "--sandbox"
            if key in ("--expression", "--file"):
                if not eq and i < len(args):
                    val, i = args[i], i + 1
                (scripts if key == "--expression" else script_files).append(val)
            continue
        if a.startswith("-") and a != "-":
            for k, c in enumerate(a[1:], start=1):
                if c == "i":
                    in_place = True
                    break
                if c in "efl":
                    val = a[k + 1 :]
                    if not val and i < len(args):
                        val, i = args[i], i + 1
                    if c == "e":
                        scripts.append(val)
                    elif c == "f":
                        script_files.append(val)
                    break
            continue
        operands.append(a)
    if not scripts and not script_files and operands:
        scripts.append(operands.pop(0))
    if not sandbox:
        for script in scripts:
            for target in sed_targets(script):
                check_writes([target], ctx, "sed writes to")
    if in_place:
        check_writes(operands, ctx, "sed -i rewrites")


def sed_targets(script: str) -> list[str]:
    """The files a sed script writes (`w FILE`, `s///w FILE`); refuses one that runs commands (`e`, `s///e`)."""
    s = script
    n = len(s)
    i = 0
    targets: list[str] = []

    def rest_of_line(j: int) -> tuple[str, int]:
        end = s.find("\n", j)
        end = n if end < 0 else end
        return s[j:end].strip(), end

    def delimited(j: int, delim: str) -> int:
        while j < n and s[j] != delim:
            j += 2 if s[j] == "\\" else 1
        if j >= n:
            raise Refused("the sed script cannot be read")
        return j + 1

    while i < n:
        c = s[i]
        if c in " \t\n;}!":
            i += 1
            continue
        if c.isdigit() or c in "$,~+":
            i += 1
            continue
        if c == "/":
            i = delimited(i + 1, "/")
            while i < n and s[i] in "IM":
                i += 1
            continue
        if c == "\\" and i + 1 < n:
            i = delimited(i + 2, s[i + 1])
            continue
        if c == "{":
            i += 1
            continue
        if c == "#" or c == ":":
            _, i = rest_of_line(i)
            continue
        if c in "btTv":
            i += 1
            while i < n and s[i] not in ";\n}":
                i += 1
            continue
        if c in "aic":
            _, i = rest_of_line(i + 1)
            continue
        if c in "rRwW":
            name, i = rest_of_line(i + 1)
            if c in "wW":
                targets.append(name)
            continue
        if c == "e":
            raise Refused("the sed script runs a command (e)")
        if c in "sy":
            if i + 1 >= n:
                raise Refused("the sed script cannot be read")
            delim = s[i + 1]
            i = delimited(i + 2, delim)
            i = delimited(i, delim)
            if c == "y":
                continue
            while i < n and s[i] not in ";\n}":
                if s[i] == "e":
                    raise Refused("the sed substitution runs its result as a command (s///e)")
                if s[i] == "w":
                    name, i = rest_of_line(i + 1)
                    targets.append(name)
                    break
                i += 1
            continue
        if c in "dDgGhHlnNpPqQxzF=":
            i += 1
            continue
        raise Refused(f"the sed script cannot be read (at {c!r})")
    return targets
