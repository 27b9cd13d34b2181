"""How a TOML table and ``BALLET_PLANNER__`` variables become a settings table.

The machinery of ``service.config.load_settings``, apart from the tables themselves:
placing environment variables in the parsed TOML data, building each table from its
defaults (a partial override keeps the keys it does not name), coercing values to the
field's type and checking the ranges declared with each field. Nothing here knows a
particular key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration key is unknown, has a bad value, or breaks a start-up check.

    The message starts with the key's dotted name, e.g.
    ``planner.max_rounds: must be >= 1, got 0``.
    """


class _EnvValue(str):
    """A raw string from the environment; remembers its variable for error messages."""

    variable: str

    def __new__(cls, value: str, variable: str) -> _EnvValue:
        instance = super().__new__(cls, value)
        instance.variable = variable
        return instance


def apply_environment(
    data: dict[str, Any], environ: Mapping[str, str], root: type[Any], prefix: str
) -> None:
    """Put every ``<prefix><TABLE>__<KEY>`` variable of ``environ`` into ``data`` (the
    parsed TOML) at its place under the settings class ``root``; raises ``ConfigError``
    for an unknown key or a table set as a value."""
    for variable in sorted(environ):
        if not variable.upper().startswith(prefix):
            continue
        path = [part.lower() for part in variable[len(prefix) :].split("__")]
        if not all(path):
            raise ConfigError(f"{variable}: malformed configuration variable name")
        dotted = ".".join(path)
        target = data
        cls: Any = root
        for index, part in enumerate(path):
            known = {f.name: f for f in fields(cls)}
            if part not in known:
                raise ConfigError(f"{dotted}: unknown key (from {variable})")
            hint = typing.get_type_hints(cls)[part]
            last = index == len(path) - 1
            if dataclasses.is_dataclass(hint):
                if last:
                    raise ConfigError(f"{dotted}: is a table; set its keys (from {variable})")
                child = target.setdefault(part, {})
                if not isinstance(child, dict):
                    raise ConfigError(f"{dotted}: is a table, not a value")
                target, cls = child, hint
            elif not last:
                raise ConfigError(f"{dotted}: unknown key (from {variable})")
            else:
                target[part] = _EnvValue(environ[variable], variable)


def build(base: Any, data: Any, prefix: str) -> Any:
    """``base`` (a table with its defaults) with the keys of ``data`` applied. A nested
    table starts from ``base``'s own value, so a partial override keeps the keys it does
    not name: ``[dependencies.gateway] address = ...`` keeps the gateway's 32 MiB limit."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'configuration'}: must be a table")
    known = {f.name: f for f in fields(base)}
    for name in data:
        if name not in known:
            raise ConfigError(f"{prefix}{name}: unknown key")
    hints = typing.get_type_hints(type(base))
    values: dict[str, Any] = {}
    for name, value in data.items():
        hint = hints[name]
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(hint):
            values[name] = build(getattr(base, name), value, f"{key}.")
        else:
            values[name] = _coerce(hint, value, key)
    built = dataclasses.replace(base, **values)
    _check_ranges(built, prefix)
    return built


def _describe(value: Any) -> str:
    if isinstance(value, _EnvValue):
        return f"{str(value)!r} (from {value.variable})"
    return repr(value)


def _coerce(hint: Any, value: Any, key: str) -> Any:
    optional = isinstance(hint, types.UnionType) and type(None) in typing.get_args(hint)
    if optional:
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if value == "":
            return None
    from_env = isinstance(value, _EnvValue)
    if hint is bool:
        if from_env:
            lowered = value.strip().lower()
            if lowered in {"1", "true", "yes", "on"}:
                return True
            if lowered in {"0", "false", "no", "off"}:
                return False
        elif isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {_describe(value)}")
    if hint is int:
        if from_env:
            try:
                return int(value.strip())
            except ValueError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {_describe(value)}")
    if hint is float:
        number: float | None = None
        if from_env:
            with contextlib.suppress(ValueError):
                number = float(value.strip())
        elif isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        # nan and inf parse as floats but are no durations or limits.
        if number is not None and math.isfinite(number):
            return number
        raise ConfigError(f"{key}: expected a finite number, got {_describe(value)}")
    if hint is str:
        if isinstance(value, str):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {_describe(value)}")
    if hint is Path:
        if isinstance(value, str):
            return Path(str(value))
        raise ConfigError(f"{key}: expected a path, got {_describe(value)}")
    if typing.get_origin(hint) is tuple:
        if from_env:
            return tuple(part.strip() for part in value.split(",") if part.strip())
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            return tuple(value)
        raise ConfigError(f"{key}: expected a list of strings, got {_describe(value)}")
    raise ConfigError(f"{key}: unsupported setting type {hint!r}")  # pragma: no cover


def _check_ranges(table: Any, prefix: str) -> None:
    for item in fields(table):
        value = getattr(table, item.name)
        key = f"{prefix}{item.name}"
        meta = item.metadata
        if meta.get("ge") is not None and value < meta["ge"]:
            raise ConfigError(f"{key}: must be >= {meta['ge']:g}, got {value:g}")
        if meta.get("gt") is not None and value <= meta["gt"]:
            raise ConfigError(f"{key}: must be > {meta['gt']:g}, got {value:g}")
        if meta.get("le") is not None and value > meta["le"]:
            raise ConfigError(f"{key}: must be <= {meta['le']:g}, got {value:g}")
        if meta.get("choices") and value not in meta["choices"]:
            allowed = ", ".join(meta["choices"])
            raise ConfigError(f"{key}: must be one of {allowed}, got {value!r}")
