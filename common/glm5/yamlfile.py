"""YAML files people write (flag files, recipes): read errors name the file and what it was for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from glm5.errors import ConfigError


def read_yaml(path: Path, what: str, kind: str = "YAML") -> Any:
    """The parsed document at `path`; ConfigError naming `what` (e.g. "recipe") if unreadable or malformed."""
    try:
        return yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path} is not valid {kind}: {exc}") from exc
