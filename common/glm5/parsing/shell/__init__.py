"""The shell policy of tool calls: judges a shell command a model wants a tool to run by what it would run.

`violation(command)` says why a command is refused, or None. What is and is not claimed: docs/security.md,
"The shell policy of tool calls". The modules follow a command through the policy: words.py (quote removal and
expansion), paths.py (what a path may name), judge.py (the parse and the walk), wrappers.py, interpreters.py
(python_code.py, code.py), files.py, network.py, system.py, environment.py, git.py.
"""

from glm5.parsing.shell.context import Refused
from glm5.parsing.shell.judge import violation
from glm5.parsing.shell.names import INTERPRETERS, SHELLS

__all__ = ["INTERPRETERS", "SHELLS", "Refused", "violation"]
