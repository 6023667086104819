"""The shell policy of tool calls; it lives in glm5.parsing.shell, this name is kept for its importers."""

from glm5.parsing.shell import INTERPRETERS, SHELLS, Refused, violation

__all__ = ["INTERPRETERS", "SHELLS", "Refused", "violation"]
