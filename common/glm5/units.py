"""Sizes as people write them in flags and recipes."""

from __future__ import annotations

from glm5.errors import ConfigError


def parse_bytes(text: str) -> int | None:
    """'auto' -> None; '512MiB', '4G', '1073741824' -> bytes."""
    t = text.strip().lower()
    if t == "auto":
        return None
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "k": 10**3, "m": 10**6, "g": 10**9, "kb": 10**3, "mb": 10**6,
             "gb": 10**9, "b": 1}  # fmt: skip
    for suffix in sorted(units, key=len, reverse=True):
        if t.endswith(suffix):
            number = t[: -len(suffix)]
            break
    else:
        suffix, number = "b", t
    try:
        value = int(float(number) * units[suffix])
    except ValueError:
        raise ConfigError(f"cannot read {text!r} as a size; use 'auto' or e.g. 512MiB, 4GiB, 1073741824") from None
    if value <= 0:
        raise ConfigError(f"size must be > 0, got {text!r}")
    return value
