"""Words as bash would pass them to a command: quotes removed, variables and braces expanded, globs kept.

A word is a `str` in which what bash decides at run time is a private-use character: text computed when the
command runs (`$VAR` nobody assigned, `$(curl ...)`), unquoted glob characters, the home directory, and the
descendants of a directory (what `find DIR` prints). Paths are judged on these patterns (glob.py), so `/e*`,
`/e{t,}c` and `$D` with `D=/etc` earlier in the script all read as what they could name.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable, Iterator
from itertools import pairwise, product
from typing import Protocol

from tree_sitter import Node

UNKNOWN = "\ue000"  # text computed at run time, one word
SPLIT = "\ue001"  # unquoted text computed at run time: it may be several words, options among them
STAR = "\ue002"
QUESTION = "\ue003"
BRACKET = "\ue004"  # `[` of a bracket expression; its `]` stays a plain character
DESCENDANTS = "\ue005"  # any path below a directory, never `..`
LBRACE = "\ue006"
COMMA = "\ue007"
RBRACE = "\ue008"
HOME = "\ue009"  # ~, ~user, $HOME
FIELD = "\ue00a"  # where an unquoted expansion splits into words

COMPUTED = (UNKNOWN, SPLIT)
GLOBS = (STAR, QUESTION, BRACKET, DESCENDANTS)
MARKERS = "".join([UNKNOWN, SPLIT, STAR, QUESTION, BRACKET, DESCENDANTS, LBRACE, COMMA, RBRACE, HOME, FIELD])
MAX_WORDS = 64  # alternatives of one word (braces times variables); past this it counts as computed
_SHOWN = {UNKNOWN: "…", SPLIT: "…", STAR: "*", QUESTION: "?", BRACKET: "[", DESCENDANTS: "**", HOME: "~",
          LBRACE: "{", COMMA: ",", RBRACE: "}", FIELD: " "}  # fmt: skip
_GLOB_OF = {"*": STAR, "?": QUESTION, "[": BRACKET}
_BRACE_OF = {"{": LBRACE, ",": COMMA, "}": RBRACE}


class Environment(Protocol):
    """What expansion needs to know about the script so far."""

    def variable(self, name: str) -> list[str] | None:
        """The values a variable may hold (None: only known when it runs)."""
        ...

    def substitution(self, node: Node) -> list[str] | None:
        """The words `$(...)` prints, when they can be known without running it."""
        ...


def literal(word: str) -> str | None:
    """The word exactly, or None when part of it is decided at run time (a glob counts)."""
    if any(m in word for m in (*COMPUTED, *GLOBS)):
        return None
    return word.replace(HOME, "~")


def is_computed(word: str) -> bool:
    return any(m in word for m in COMPUTED)


def shown(word: str) -> str:
    """The word for a message."""
    return "".join(_SHOWN.get(c, c) for c in word)


def plain(word: str) -> str:
    """Markers back to the characters they came from (an assignment's value is not globbed)."""
    return "".join(_SHOWN.get(c, c) if c in (STAR, QUESTION, BRACKET, LBRACE, COMMA, RBRACE) else c for c in word)


def text(node: Node) -> str:
    return node.text.decode(errors="replace") if node.text is not None else ""


def expand(node: Node, env: Environment) -> list[str]:
    """The words one argument node becomes."""
    words: list[str] = []
    for alternative in _alternatives(node, env, quoted=False):
        for braced in _braces(alternative):
            words += [_unbrace(w) for w in braced.split(FIELD) if w or FIELD not in braced]
    return words[:MAX_WORDS] if len(words) <= MAX_WORDS else [SPLIT]


def value(node: Node, env: Environment) -> str:
    """An assignment's value: one word, no splitting, no globbing, no brace expansion."""
    alternatives = _alternatives(node, env, quoted=True)
    return plain(alternatives[0]) if len(alternatives) == 1 else UNKNOWN


def values(node: Node, env: Environment) -> list[str]:
    """Every value an assignment's right-hand side may take."""
    return [plain(a) for a in _alternatives(node, env, quoted=True)]


def unquoted(raw: str) -> str:
    """Unquoted characters of a word: backslash escapes one character (a backslash-newline is nothing), glob and
    brace characters become markers."""
    out: list[str] = []
    chars: Iterator[str] = iter(raw)
    for c in chars:
        if c == "\\":
            nxt = next(chars, "")
            out.append("" if nxt == "\n" else nxt)
        elif c in _GLOB_OF:
            out.append(_GLOB_OF[c])
        elif c in _BRACE_OF:
            out.append(_BRACE_OF[c])
        else:
            out.append(c)
    return "".join(out)


def _product(parts: list[list[str]]) -> list[str]:
    size = 1
    for p in parts:
        size *= max(len(p), 1)
    if size > MAX_WORDS:
        return [SPLIT]
    return ["".join(combo) for combo in product(*parts)]


def _alternatives(node: Node, env: Environment, quoted: bool) -> list[str]:
    kind = node.type
    if kind in ("word", "number"):
        raw = text(node)
        if quoted:
            return [re.sub(r"\\(.)", lambda m: "" if m.group(1) == "\n" else m.group(1), raw, flags=re.S)]
        return [unquoted(raw)]
    if kind == "raw_string":
        return [text(node)[1:-1]]
    if kind == "ansi_c_string":
        try:
            return [codecs.decode(text(node)[2:-1].encode("latin-1", "backslashreplace"), "unicode_escape")]
        except UnicodeDecodeError:
            return [UNKNOWN]
    if kind in ("string", "translated_string"):
        # newlines between the parts are in no child: the text between children is taken from the node itself
        source = node.text or b""
        parts: list[list[str]] = []
        pos: int | None = None
        for child in node.children:
            if pos is None:
                if child.type == '"':
                    pos = child.end_byte
                continue
            if child.start_byte > pos:
                parts.append([_double_quoted(source[pos - node.start_byte : child.start_byte - node.start_byte])])
            if child.type == '"':
                break
            if child.type == "string_content":
                parts.append([_double_quoted(child.text or b"")])
            else:
                parts.append(_alternatives(child, env, quoted=True))
            pos = child.end_byte
        return _product(parts)
    if kind == "concatenation":
        return _product([_alternatives(c, env, quoted) for c in node.children])
    if kind in ("simple_expansion", "expansion"):
        return _expansion(node, env, quoted)
    if kind == "command_substitution":
        printed = env.substitution(node)
        if printed is None:
            return [UNKNOWN if quoted else SPLIT]
        return [" ".join(printed)] if quoted else [FIELD.join(_splittable(w) for w in printed)]
    if kind == "process_substitution":
        return ["/dev/fd/63"]  # what bash passes; the interpreter checks know such a path is another's output
    if kind == "brace_expression":
        inner = "".join(text(c) for c in node.children if c.type not in ("{", "}"))
        return [LBRACE + inner + RBRACE]
    return [UNKNOWN if quoted else SPLIT]


def _double_quoted(raw: bytes) -> str:
    """Inside double quotes a backslash escapes only $ ` " \\ and newline (which it removes)."""
    return re.sub(r"\\([$`\"\\\n])", lambda m: "" if m.group(1) == "\n" else m.group(1), raw.decode(errors="replace"))


def _expansion(node: Node, env: Environment, quoted: bool) -> list[str]:
    names = [c for c in node.children if c.type == "variable_name"]
    others = [c for c in node.children if c.type not in ("$", "${", "}", "variable_name")]
    if len(names) != 1 or node.children[0].type not in ("$", "${"):
        return [UNKNOWN if quoted else SPLIT]  # $@, ${#x}, ${!x}, ${x[i]}: not followed
    name = text(names[0])
    held = env.variable(name)
    if not quoted and env.variable("IFS") is not None:
        return [SPLIT]  # words split at characters this script chose
    if others:
        # `${X:-default}` and its kind may be X or the default; any other operator computes a new value
        if others[0].type not in (":-", "-", ":=", "=") or len(others) > 2:
            return [UNKNOWN if quoted else SPLIT]
        default = _alternatives(others[1], env, quoted) if len(others) == 2 else [""]
        held = [*(held or [UNKNOWN]), *(plain(d) for d in default)]
    if held is None:
        return [UNKNOWN if quoted else SPLIT]
    return held if quoted else [_splittable(v) for v in held]


def _splittable(v: str) -> str:
    """An unquoted expansion's value: split at blanks, and globbed."""
    v = "".join(_GLOB_OF.get(c, c) for c in v)
    return FIELD.join(v.split()) if v.strip() else ""


def _unbrace(word: str) -> str:
    return word.replace(LBRACE, "{").replace(COMMA, ",").replace(RBRACE, "}")


def _braces(word: str, budget: int = MAX_WORDS) -> list[str]:
    """Brace expansion over the unquoted braces: `a{b,c}d`, `{1..3}`, nested ones; others stay literal."""
    start = 0
    while True:
        i = word.find(LBRACE, start)
        if i < 0:
            return [word]
        depth, j = 0, i
        commas: list[int] = []
        while j < len(word):
            if word[j] == LBRACE:
                depth += 1
            elif word[j] == RBRACE:
                depth -= 1
                if depth == 0:
                    break
            elif word[j] == COMMA and depth == 1:
                commas.append(j)
            j += 1
        if j >= len(word):
            return [word]
        inner = word[i + 1 : j]
        if commas:
            cuts = [i, *commas, j]
            choices = [word[a + 1 : b] for a, b in pairwise(cuts)]
        else:
            sequence = _sequence(_unbrace(inner))
            if sequence is None:
                start = i + 1
                continue
            choices = sequence
        out: list[str] = []
        for choice in choices:
            out += _braces(word[:i] + choice + word[j + 1 :], budget)
            if len(out) > budget:
                return [SPLIT]
        return out


def _sequence(inner: str) -> list[str] | None:
    m = re.fullmatch(r"(-?\d+|[A-Za-z])\.\.(-?\d+|[A-Za-z])(?:\.\.(-?\d+))?", inner)
    if m is None:
        return None
    first, last, step = m.group(1), m.group(2), abs(int(m.group(3) or 1)) or 1
    convert: Callable[[int], str]
    if first.lstrip("-").isdigit() and last.lstrip("-").isdigit():
        a, b, convert = int(first), int(last), str
    elif first.isalpha() and last.isalpha():
        a, b, convert = ord(first), ord(last), chr
    else:
        return None
    if abs(b - a) // step > MAX_WORDS:
        return [SPLIT]
    direction = step if b >= a else -step
    return [convert(k) for k in range(a, b + (1 if direction > 0 else -1), direction)]
