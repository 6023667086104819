"""GLM-4.7 / GLM-5 tool calls: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`.

A registry built from the request's `tools` keys every tool by its name (unique within a request) and gives it a
signature fingerprint (name + parameter JSON schema). A call to an unknown tool, with arguments that do not
validate against the schema, or (for shell-type tools) with a command the shell policy forbids, comes back as an
error, never as a valid call. Argument values are kept verbatim when the schema says string; other values are
JSON-decoded.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from glm5.parsing.reasoning import _partial_suffix
from glm5.parsing.shell_policy import SHELLS
from glm5.parsing.shell_policy import violation as shell_violation

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
TAGS = (CALL_OPEN, CALL_CLOSE, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _verbatim_string(schema: dict[str, Any]) -> str:
    """A Lark terminal for a string argument as the chat template writes it (unquoted, no '<')."""
    if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
        return " | ".join(json.dumps(v) for v in schema["enum"])
    low = schema.get("minLength", 0)
    high = schema.get("maxLength")
    if isinstance(low, int) and isinstance(high, int):
        return f"/[^<]{{{low},{high}}}/"
    return f"/[^<]{{{low if isinstance(low, int) else 0},}}/"


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolCallError:
    name: str
    error: str
    raw: str
    # what went wrong, for metrics: unknown_tool, invalid_arguments, shell_policy, malformed (markup that is not a
    # whole call) or unclosed
    reason: str = "invalid_arguments"


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    parameters: dict[str, Any]
    signature: str


def signature(name: str, parameters: dict[str, Any]) -> str:
    canonical = json.dumps(parameters, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"{name}\0{canonical}".encode()).hexdigest()[:16]


class ShellPolicy:
    """Which tool arguments are shell commands, judged by glm5.parsing.shell_policy. An argument is one
    when its schema says so (`"x-shell-command": true`: any tool, any name), or when the tool's name is one of
    the usual shell-tool names (any case) and the argument one of the usual command names. A string is a
    command line; an array of strings is an argv (`["bash", "-c", "..."]` judges the script)."""

    SHELL_TOOLS = ("bash", "shell", "sh", "zsh", "terminal", "run_shell", "run_command", "execute_command", "exec",
                   "execute", "run", "shell_exec", "run_terminal_cmd", "execute_bash", "cmd", "command")  # fmt: skip
    COMMAND_ARGS = ("command", "cmd", "commands", "script", "shell_command", "cmdline", "command_line", "code")
    MARK = "x-shell-command"

    def __init__(self, shell_tools: tuple[str, ...] = SHELL_TOOLS, command_args: tuple[str, ...] = COMMAND_ARGS,
                 enabled: bool = True) -> None:  # fmt: skip
        self.shell_tools = {t.lower() for t in shell_tools}
        self.command_args = {a.lower() for a in command_args}
        self.enabled = enabled

    def shell_arguments(self, tool: str, parameters: dict[str, Any] | None = None) -> set[str]:
        props = (parameters or {}).get("properties") or {}
        marked = {k for k, v in props.items() if isinstance(v, dict) and v.get(self.MARK) is True}
        if tool.lower() in self.shell_tools:
            marked |= {k for k in props if k.lower() in self.command_args} or set(self.command_args)
        return marked

    def violation(self, tool: str, arguments: dict[str, Any], parameters: dict[str, Any] | None = None) -> str | None:
        if not self.enabled:
            return None
        for key in self.shell_arguments(tool, parameters):
            value = next((v for k, v in arguments.items() if k.lower() == key.lower()), None)
            if isinstance(value, list) and all(isinstance(x, str) for x in value):
                value = _argv_command(value)
            elif value is not None and not isinstance(value, str):
                return f"shell policy: {key} must be a command line or a list of strings"
            problem = shell_violation(value) if value else None
            if problem:
                return f"shell policy forbids this command: {problem}"
        return None


def _argv_command(argv: list[str]) -> str:
    """An argv as the command line that runs it; a shell's `-c SCRIPT` is the script itself."""
    if len(argv) >= 3 and argv[0].rsplit("/", 1)[-1] in SHELLS and argv[1] == "-c":
        return argv[2]
    return shlex.join(argv)


def tag_ids(token_id: Callable[[str], int | None]) -> dict[str, int] | None:
    """The tool-call tags' token ids (special tokens) by a tokenizer's `token_id`; None when it lacks one."""
    ids = {t: token_id(t) for t in TAGS}
    return {t: i for t, i in ids.items() if i is not None} if all(i is not None for i in ids.values()) else None


@dataclass
class ToolRegistry:
    tools: dict[str, Tool] = field(default_factory=dict)  # by name; a name declared twice is refused
    policy: ShellPolicy = field(default_factory=ShellPolicy)

    @classmethod
    def from_openai(cls, tools: list[dict[str, Any]] | None, policy: ShellPolicy | None = None) -> ToolRegistry:
        """From the OpenAI `tools` array; raises ValueError naming the bad entry."""
        reg = cls(policy=policy or ShellPolicy())
        for i, entry in enumerate(tools or []):
            if (
                not isinstance(entry, dict)
                or entry.get("type") != "function"
                or not isinstance(entry.get("function"), dict)
            ):
                raise ValueError(f"tools[{i}]: expected {{'type': 'function', 'function': {{...}}}}")
            fn = entry["function"]
            name = fn.get("name")
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
                raise ValueError(f"tools[{i}].function.name: 1-64 letters, digits, '_', '.' or '-'")
            params = fn.get("parameters") or {"type": "object", "properties": {}}
            try:
                jsonschema.validators.validator_for(params).check_schema(params)
            except jsonschema.SchemaError as exc:
                raise ValueError(f"tools[{i}].function.parameters: not a valid JSON schema: {exc.message}") from exc
            if name in reg.tools:
                raise ValueError(f"tools[{i}].function.name: {name!r} is declared twice")
            reg.tools[name] = Tool(name, params, signature(name, params))
        return reg

    def call_grammar(self, name: str | None, token_ids: dict[str, int], lazy: bool = False) -> str:
        """A Lark grammar (llguidance's dialect) for `tool_choice`: exactly one call to `name`, or (None) one or
        more calls to any tool; `lazy` (tool_choice "auto"): any text, then zero or more calls, so the model may
        answer without a call but every call it opens is one the tools accept (llama.cpp's lazy tool-call
        grammars do the same). Arguments come in the schema's property order, the required ones always;
        string values verbatim (as the chat template writes them), others as JSON valid against their schema.
        `token_ids`: the ids of the tool-call tags, which are special tokens (text never holds them)."""
        tag = {t: f"<[{token_ids[t]}]>" for t in TAGS}
        rules, calls = [], []
        for i, tool in enumerate(self.tools.values()):
            if name is not None and tool.name != name:
                continue
            props: dict[str, Any] = tool.parameters.get("properties") or {}
            required = set(tool.parameters.get("required") or [])
            args = []
            for j, (key, schema) in enumerate(props.items()):
                value = f"v{i}_{j}"
                if isinstance(schema, dict) and schema.get("type") == "string":
                    rules.append(f"{value.upper()}: {_verbatim_string(schema)}")
                    value = value.upper()
                else:
                    rules.append(f"{value}: %json {json.dumps(schema if isinstance(schema, dict) else {})}")
                arg = (f'{tag["<arg_key>"]} {json.dumps(key)} {tag["</arg_key>"]} '
                       f'{tag["<arg_value>"]} {value} {tag["</arg_value>"]}')  # fmt: skip
                args.append(arg if key in required else f"({arg})?")
            rules.append(f"call{i}: {tag[CALL_OPEN]} {json.dumps(tool.name)} {' '.join(args)} {tag[CALL_CLOSE]}")
            calls.append(f"call{i}")
        if not calls:
            raise ValueError(f"no tool named {name!r}")
        if lazy:
            if name is not None:
                raise ValueError("a lazy grammar is for tool_choice auto: any tool or none")
            return "\n".join([f"start: TEXT ({' | '.join(calls)})*", "TEXT: /(?s:.)*/", *rules])
        start = calls[0] if name is not None else f"({' | '.join(calls)})+"
        return "\n".join([f"start: {start}", *rules])

    def resolve(self, raw: str) -> ToolCall | ToolCallError:
        """One `<tool_call>` body (without the tags) -> a validated call or an error."""
        name, _, rest = raw.partition("<arg_key>")
        name = name.strip()
        rest = "<arg_key>" + rest if rest else ""
        tool = self.tools.get(name)
        if tool is None:
            return ToolCallError(name, f"unknown tool {name!r}", raw, "unknown_tool")
        props: dict[str, Any] = tool.parameters.get("properties", {})
        args: dict[str, Any] = {}
        for key, value in _ARG.findall(rest):
            key = key.strip()
            if props.get(key, {}).get("type") == "string":
                args[key] = value  # verbatim
            else:
                try:
                    args[key] = json.loads(value)
                except ValueError:
                    args[key] = value
        leftover = _ARG.sub("", rest).strip()
        if leftover:
            return ToolCallError(name, f"malformed arguments: {leftover[:80]!r}", raw, "malformed")
        try:
            jsonschema.validate(args, tool.parameters)
        except jsonschema.ValidationError as exc:
            where = "/".join(str(p) for p in exc.absolute_path) or "arguments"
            return ToolCallError(name, f"{where}: {exc.message}", raw)
        problem = self.policy.violation(name, args, tool.parameters)
        if problem:
            return ToolCallError(name, problem, raw, "shell_policy")
        return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, args)


STRAY = TAGS[1:]  # markup that only belongs inside a call: outside one it starts a malformed call


class ToolCallParser:
    """Streams content through, holding back <tool_call> blocks and resolving each one when it closes. Tool-call
    markup outside a block (`<arg_value>47</arg_value></tool_call>` with no `<tool_call>`: a model that lost the
    format) is never content: from its first tag through the next `</tool_call>` (or the end) it is a malformed
    call, a ToolCallError."""

    def __init__(self, registry: ToolRegistry) -> None:
        self.registry = registry
        self._buf = ""
        self._in_call = False
        self._stray = False  # inside markup that did not open with <tool_call>
        self.calls: list[ToolCall] = []
        self.errors: list[ToolCallError] = []

    def feed(self, delta: str) -> tuple[str, list[ToolCall | ToolCallError]]:
        """Content that is plain text, and the calls completed by this delta."""
        text = self._buf + delta
        self._buf = ""
        out: list[str] = []
        done: list[ToolCall | ToolCallError] = []
        while text:
            if self._stray:  # up to its `</tool_call>`, or up to a `<tool_call>` that opens a real call
                close, reopen = text.find(CALL_CLOSE), text.find(CALL_OPEN, 1)
                if close < 0 and reopen < 0:
                    self._buf = text
                    break
                end = close + len(CALL_CLOSE) if close >= 0 and (reopen < 0 or close < reopen) else reopen
                done.append(self._record(self._stray_error(text[:end])))
                text, self._stray = text[end:], False
                continue
            if self._in_call:
                at = text.find(CALL_CLOSE)
                if at < 0:
                    self._buf = text
                    break
                done.append(self._record(self.registry.resolve(text[:at])))
                text, self._in_call = text[at + len(CALL_CLOSE) :], False
                continue
            found = [(i, tag) for tag in TAGS if (i := text.find(tag)) >= 0]
            if found:
                at, tag = min(found)
                out.append(text[:at])
                if tag == CALL_OPEN:
                    text, self._in_call = text[at + len(CALL_OPEN) :], True
                else:
                    text, self._stray = text[at:], True
                continue
            keep = max(_partial_suffix(text, tag) for tag in TAGS)
            out.append(text[: len(text) - keep])
            self._buf = text[len(text) - keep :]
            break
        return "".join(out), done

    def _record(self, result: ToolCall | ToolCallError) -> ToolCall | ToolCallError:
        (self.calls if isinstance(result, ToolCall) else self.errors).append(result)  # type: ignore[arg-type]
        return result

    def _stray_error(self, raw: str) -> ToolCallError:
        return ToolCallError("", "tool-call markup outside a <tool_call> block (the model broke the call format): "
                             f"{raw[:80]!r}", raw, "malformed")  # fmt: skip

    def finish(self) -> tuple[str, list[ToolCall | ToolCallError]]:
        """End of stream: an unclosed call is an error; a held partial tag is plain text."""
        buf, self._buf = self._buf, ""
        if self._in_call or self._stray:
            name = buf.partition("<arg_key>")[0].strip()
            err = self._stray_error(buf) if self._stray else ToolCallError(name, "the tool call was not closed", buf,
                                                                             "unclosed")  # fmt: skip
            self._in_call = self._stray = False
            self.errors.append(err)
            return "", [err]
        return buf, []
