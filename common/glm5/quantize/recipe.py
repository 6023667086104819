"""Quantization recipes: a scheme, the module-name globs it applies to, and how INT4 is calibrated.

A module is quantized when its name matches an `include` glob and no `exclude` glob (fnmatch: `*` crosses
dots). In `w4a16-fp8-mix` the included modules that also match an `int4` glob are INT4, the others FP8.
Default recipes per scheme ship in recipes/ with a comment on why each exclusion is there.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from glm5.errors import ConfigError
from glm5.yamlfile import read_yaml

SCHEMES = ("fp8-block", "w4a16", "w4a16-fp8-mix")
DEFAULTS = Path(__file__).parent / "recipes"
_KEYS = {"scheme", "group_size", "block_size", "include", "exclude", "int4", "calibration"}
_CALIBRATION_KEYS = {"method", "damp", "block", "max_samples", "max_tokens"}


@dataclass(frozen=True, slots=True)
class Calibration:
    method: str = "gptq"
    damp: float = 0.01
    block: int = 128
    max_samples: int = 512
    max_tokens: int = 2048


@dataclass(frozen=True, slots=True)
class Recipe:
    scheme: str
    include: tuple[str, ...]
    exclude: tuple[str, ...] = ()
    int4: tuple[str, ...] = ()
    group_size: int = 128
    block_size: tuple[int, int] = (128, 128)
    calibration: Calibration = field(default_factory=Calibration)

    def format_of(self, module: str) -> str | None:
        """'int4', 'fp8' or None (kept as stored) for a module name."""
        if not _any(module, self.include) or _any(module, self.exclude):
            return None
        if self.scheme == "fp8-block":
            return "fp8"
        if self.scheme == "w4a16":
            return "int4"
        return "int4" if _any(module, self.int4) else "fp8"

    def with_group_size(self, group_size: int | None) -> Recipe:
        if group_size is None:
            return self
        if group_size <= 0 or group_size % 8:
            raise ConfigError(f"--group-size must be a positive multiple of 8, got {group_size}")
        return replace(self, group_size=group_size)


def _any(name: str, globs: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, g) for g in globs)


def load_recipe(scheme: str | None, path: Path | None) -> Recipe:
    """The recipe at `path`, or the shipped default of `scheme`; the two must agree when both are given."""
    if path is None:
        if scheme not in SCHEMES:
            raise ConfigError(f"--scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
        path = DEFAULTS / f"{scheme}.yaml"
    recipe = _parse(read_yaml(path, "recipe"), path)
    if scheme is not None and scheme != recipe.scheme:
        raise ConfigError(f"--scheme {scheme} disagrees with recipe {path} (scheme: {recipe.scheme})")
    return recipe


def _parse(raw: Any, path: Path) -> Recipe:
    if not isinstance(raw, dict):
        raise ConfigError(f"recipe {path} must be a mapping")
    unknown = set(raw) - _KEYS
    if unknown:
        raise ConfigError(
            f"recipe {path}: unknown keys {', '.join(sorted(unknown))} (known: {', '.join(sorted(_KEYS))})"
        )
    scheme = raw.get("scheme")
    if scheme not in SCHEMES:
        raise ConfigError(f"recipe {path}: scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    globs = {key: _globs(raw.get(key, []), key, path) for key in ("include", "exclude", "int4")}
    if not globs["include"]:
        raise ConfigError(f"recipe {path}: include must list at least one module-name glob")
    if globs["int4"] and scheme != "w4a16-fp8-mix":
        raise ConfigError(f"recipe {path}: int4 globs only apply to scheme w4a16-fp8-mix")
    group = raw.get("group_size", 128)
    if not isinstance(group, int) or isinstance(group, bool) or group <= 0 or group % 8:
        raise ConfigError(f"recipe {path}: group_size must be a positive multiple of 8, got {group!r}")
    block = raw.get("block_size", [128, 128])
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"recipe {path}: block_size must be [rows, columns] of positive integers, got {block!r}")
    cal = raw.get("calibration") or {}
    if not isinstance(cal, dict) or set(cal) - _CALIBRATION_KEYS:
        raise ConfigError(f"recipe {path}: calibration takes only {', '.join(sorted(_CALIBRATION_KEYS))}")
    try:
        calibration = Calibration(**cal)
    except TypeError as exc:
        raise ConfigError(f"recipe {path}: calibration: {exc}") from exc
    if calibration.method not in ("gptq", "rtn"):
        raise ConfigError(f"recipe {path}: calibration method must be gptq or rtn, got {calibration.method!r}")
    if (
        not 0 <= calibration.damp < 1
        or calibration.block <= 0
        or calibration.max_samples <= 0
        or calibration.max_tokens <= 0
    ):
        raise ConfigError(f"recipe {path}: calibration needs 0 <= damp < 1 and positive block, max_samples, max_tokens")
    return Recipe(scheme, globs["include"], globs["exclude"], globs["int4"], group, (block[0], block[1]), calibration)


def _globs(value: Any, key: str, path: Path) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"recipe {path}: {key} must be a list of module-name globs")
    return tuple(value)
