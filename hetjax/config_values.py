"""Config values: the error every bad key or value raises, byte sizes, and parsing a
command-line value into a field's type. Imports nothing else from hetjax but the error
base (``hetjax/errors.py``), so every layer (the memory model and the model zoo too) can
raise and format with it."""

from __future__ import annotations

import difflib
import re
import types
import typing
from typing import Any

from hetjax.errors import UserError


class ConfigError(UserError, ValueError):
    """A config key is unknown or its value is invalid; the message names the key. A
    command exits 2 on it (``hetjax/errors.py``)."""

    status = 2
    label = "config error"


_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: int | str, key: str = "value") -> int:
    """Parses a byte size such as ``4096``, ``"512MiB"``, ``"1.5GB"`` into bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a byte size such as '512MiB', got {value!r}")
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _BYTE_UNITS:
        raise ConfigError(
            f"{key}: cannot read {value!r} as a byte size; "
            "write e.g. 4096, '512MiB', '2GiB', '1.5GB'"
        )
    return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    """Formats bytes with a binary unit, e.g. ``1.50 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _check(cond: bool, key: str, msg: str, value: Any) -> None:
    if not cond:
        raise ConfigError(f"config key '{key}' {msg}, got {value!r}")


def _choice(section: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"config key '{section}.{name}' must be one of {', '.join(choices)}, "
            f"got {value!r}{hint}"
        )


def _field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _parse_value(key: str, text: Any, typ: Any) -> Any:
    if not isinstance(text, str):
        return text
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(typ) if a is not type(None)]
        if text.lower() in ("none", "null") and type(None) in typing.get_args(typ):
            return None
        errors = []
        for option in options:
            try:
                return _parse_value(key, text, option)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[-1])
    if typ is bool:
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"config key '{key}' must be true or false, got {text!r}")
    if typ is int:
        try:
            return int(text.replace("_", ""))
        except ValueError:
            try:
                f = float(text)
            except ValueError:
                f = None
            if f is not None and f.is_integer():
                return int(f)
            raise ConfigError(f"config key '{key}' must be an integer, got {text!r}") from None
    if typ is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"config key '{key}' must be a number, got {text!r}") from None
    if typ is str:
        return text
    raise AssertionError(f"unsupported config field type {typ} for {key}")


# -- loading config files ----------------------------------------------------------------
