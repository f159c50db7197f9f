"""Engine flags shared by ``pagedllm generate`` and ``pagedllm serve``, built from
``EngineConfig``'s fields: the name, help, unit and default of each are written there,
once (``engine/config.py``); this module only turns them into argparse options and back."""

from __future__ import annotations

import argparse
import re
import typing
from collections.abc import Callable
from typing import Any, NamedTuple

from pagedllm.engine.config import (
    BYTES,
    GIB,
    JSON,
    NO_PRESET,
    RENAMED,
    SECONDS,
    EngineConfig,
    Flag,
    Preset,
    flag_name,
    flagged_fields,
    make_config,
)
from pagedllm.planner.presets import parse_size as _parse_size

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*$")


def parse_size(text: str | int) -> int:
    """Bytes from ``4GiB``, ``512MiB``, ``1.5G`` (binary), ``2GB`` (decimal) or ``1024``."""
    return _parse_size(text, bare_unit=1)


class SizeRange(NamedTuple):
    """``--kv-cache-memory MIN[:MAX]`` parsed; prints back as it is written, so that a
    replica's command line (``server/data_parallel.py``) can repeat it."""

    low: int
    high: int | None

    def __str__(self) -> str:
        return f"{self.low}:{self.high}" if self.high is not None else str(self.low)


def _size_or_zero(text: str) -> int:
    """``parse_size``, and 0 (no swap tier): ``EngineConfig`` says where 0 is not allowed."""
    return 0 if text.strip() == "0" else parse_size(text)


def parse_size_range(text: str | int) -> SizeRange:
    """``4GiB`` -> (bytes, None); ``512MiB:4GiB`` -> (MIN, MAX), the elastic pool's range."""
    if isinstance(text, str) and ":" in text:
        low, high = text.split(":", 1)
        low_bytes, high_bytes = parse_size(low), parse_size(high)
        if low_bytes > high_bytes:
            raise ValueError(f"MIN ({low}) is larger than MAX ({high})")
        return SizeRange(low_bytes, high_bytes)
    return SizeRange(parse_size(text), None)


def parse_duration(text: str | float) -> float:
    """Seconds from ``30``, ``30s`` or ``128ms``."""
    if isinstance(text, int | float):
        return float(text)
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"not a duration: {text!r} (examples: 30, 30s, 128ms)")
    number = float(match.group(1))
    return number / 1000 if match.group(2) == "ms" else number


def add_engine_arguments(parser: argparse.ArgumentParser, preset: Preset = NO_PRESET) -> None:
    """Add the engine's flags (one per flagged ``EngineConfig`` field, plus the old
    spellings of renamed ones) to ``parser``; their help names ``preset``'s defaults."""
    groups: dict[str, Any] = {}
    hints = typing.get_type_hints(EngineConfig)
    for name, default, flag in flagged_fields():
        if flag.group not in groups:
            groups[flag.group] = parser.add_argument_group(flag.group)
        group = groups[flag.group]
        options = [flag_name(name), *([flag.short] if flag.short else [])]
        group.add_argument(*options, dest=name, default=default, **_kind(flag, hints[name]),
                           help=_help(name, default, flag, preset))  # fmt: skip
    old_spellings = parser.add_argument_group("deprecated spellings (still accepted)")
    for renamed in RENAMED:
        old_spellings.add_argument(
            flag_name(renamed.old), type=float, default=None, metavar=renamed.old_unit.upper(),
            help=f"{flag_name(renamed.new)} in {renamed.old_unit}",
        )  # fmt: skip


def config_from_args(args: argparse.Namespace, preset: Preset = NO_PRESET) -> EngineConfig:
    """The ``EngineConfig`` described by parsed ``add_engine_arguments`` flags under
    ``preset``: a flag left at its field's default counts as not given."""
    given: dict[str, Any] = {}
    for name, default, flag in flagged_fields():
        value = getattr(args, name)
        if value == default:
            continue
        if flag.max_field:
            given[name], high = value
            if high is not None:
                given[flag.max_field] = high
        else:
            given[name] = value
    for renamed in RENAMED:
        if getattr(args, renamed.old) is not None:
            given[renamed.old] = getattr(args, renamed.old)
    return make_config(given, preset, stacklevel=3)


def _kind(flag: Flag, hint: Any) -> dict[str, Any]:
    """argparse's ``type``/``action``, ``choices`` and ``metavar`` for a field's flag."""
    base = next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))
    if base is bool:
        return {"action": argparse.BooleanOptionalAction}
    if flag.choices:
        return {"choices": flag.choices}
    if flag.unit == BYTES:
        parse: Callable[[str], Any] = parse_size_range if flag.max_field else _size_or_zero
        return {"type": _argtype(parse), "metavar": "MIN[:MAX]" if flag.max_field else "SIZE"}
    if flag.unit == SECONDS:
        return {"type": _argtype(parse_duration), "metavar": "SECONDS"}
    if flag.unit == JSON:
        return {"type": json_config(base), "metavar": "JSON"}
    return {"type": base, "metavar": flag.unit.upper() or None}


def json_config(kind: Any) -> Callable[[str], Any]:
    """An argparse ``type`` reading a JSON object into ``kind`` (its ``from_value``)."""
    return _argtype(kind.from_value)


def _argtype(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` with its ValueError's message shown by argparse (not "invalid value")."""

    def checked(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    checked.__name__ = parse.__name__
    return checked


def _help(name: str, default: Any, flag: Flag, preset: Preset) -> str:
    """The flag's help, its unit and the default in force under ``preset``."""
    if flag.hidden:
        return argparse.SUPPRESS
    notes = [_unit_note(flag.unit)] if flag.unit else []
    if default is not None:
        notes.append(f"default {_shown(default, flag)}")
    notes += [f"{preset.name}: {_shown(d.value, flag)}" for d in preset.defaults if d.field == name]
    return f"{flag.help} [{'; '.join(notes)}]" if notes else flag.help


def _unit_note(unit: str) -> str:
    if unit == BYTES:
        return "bytes, or 4GiB, 512MiB"
    if unit == SECONDS:
        return "seconds, or 128ms"
    return unit


def _shown(value: Any, flag: Flag) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if flag.unit == BYTES and isinstance(value, int) and value and value % GIB == 0:
        return f"{value // GIB}GiB"
    if flag.unit == SECONDS and isinstance(value, float) and value < 1:
        return f"{value * 1000:g}ms"
    return f"{value:g}" if isinstance(value, float) else str(value)
