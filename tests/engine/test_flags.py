"""The engine's flags are generated from ``EngineConfig``'s fields: one default per knob
(the field's), every flag's unit in ``--help``, and parse -> config round trips."""

from __future__ import annotations

import argparse
import re
import shlex
import warnings
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from pagedllm.cli import main
from pagedllm.engine import cli_generate
from pagedllm.engine.args import config_from_args, parse_duration
from pagedllm.engine.config import (
    BYTES,
    GENERATE,
    GIB,
    JSON,
    OFFLINE,
    RENAMED,
    SECONDS,
    SERVE,
    EngineConfig,
    Preset,
    field_default,
    flag_name,
    flagged_fields,
    make_config,
)
from pagedllm.server import cli as server_cli
from pagedllm.server.data_parallel import replica_argv
from pagedllm.spec_decode.config import SpeculativeConfig

README = Path(__file__).resolve().parents[2] / "README.md"
# Flags whose sample value is only valid beside others (a second machine needs a rendezvous):
# the flags, and the fields they give.
RENDEZVOUS = (
    ["-tp", "2", "--master-port", "29500"],
    {"tensor_parallel_size": 2, "master_port": 29500},
)
CONTEXT = {
    "nnodes": RENDEZVOUS,
    "node_rank": (["--nnodes", "2", *RENDEZVOUS[0]], {"nnodes": 2, **RENDEZVOUS[1]}),
}


def _parser(add_arguments: Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings}


@pytest.mark.parametrize("add_arguments", [server_cli.add_arguments, cli_generate.add_arguments])
def test_every_flag_takes_its_default_from_its_field(add_arguments: Any) -> None:
    actions = _actions(_parser(add_arguments))
    for name, default, _ in flagged_fields():
        action = actions[name]
        assert action.default is default, name
        assert action.option_strings[0] == flag_name(name)
    for renamed in RENAMED:
        assert actions[renamed.old].default is None  # unset: the new field's default rules


def test_the_only_defaults_besides_the_fields_are_the_named_presets() -> None:
    names = {f.name for f in fields(EngineConfig)}
    for preset in (SERVE, OFFLINE, GENERATE):
        for default in preset.defaults:
            assert default.field in names and set(default.unless) <= names
            assert default.value != field_default(default.field), (preset.name, default.field)
    # Units: sizes are bytes (ints), durations seconds (a field in seconds ends in _s).
    for name, default, flag in flagged_fields():
        assert (flag.unit == SECONDS) == name.endswith("_s"), name
        if flag.unit == BYTES:
            assert default is None or isinstance(default, int), name


def test_serve_help_lists_every_flag_with_its_unit(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps at hyphens too
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    entries = _help_entries(capsys.readouterr().out)
    for name, default, flag in flagged_fields():
        if flag.hidden:
            continue
        entry = entries[flag_name(name)]
        if flag.unit:
            assert f"[{flag.unit}" in entry, (name, entry)
        if default is not None:
            assert "default " in entry, (name, entry)
    # The server's preset is shown where it sets a value.
    assert "serve: 512]" in entries["--max-num-batched-tokens"]
    assert "serve: 128ms]" in entries["--max-prefill-time-while-decoding"]


def _help_entries(text: str) -> dict[str, str]:
    """``--flag`` -> its option line and help, joined into one line."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        match = re.match(r"^  (--[a-z0-9-]+)", line)
        if match:
            current = match.group(1)
            entries[current] = line
        elif current and line.startswith("      "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


@pytest.mark.parametrize("name", [name for name, _, _ in flagged_fields()])
def test_every_flag_round_trips_to_its_field(name: str) -> None:
    parser = _parser(server_cli.add_arguments)
    text, value = _sample(name)
    context_argv, context_fields = CONTEXT.get(name, ([], {}))
    config = config_from_args(parser.parse_args([*context_argv, *text]), GENERATE)
    assert getattr(config, name) == value
    assert config == EngineConfig(**{name: value, **context_fields})


def _sample(name: str) -> tuple[list[str], Any]:
    """Flag text and the field value it must give: never the field's default."""
    field = EngineConfig.__dataclass_fields__[name]
    flag = field.metadata["flag"]
    option, default = flag_name(name), field.default
    if flag.choices:
        choice = next(c for c in flag.choices if c != default)
        return [option, choice], choice
    if flag.unit == BYTES:
        return [option, "3GiB"], 3 * GIB
    if flag.unit == SECONDS:
        return [option, "250ms"], 0.25
    if flag.unit == JSON:
        text = '{"method": "suffix", "num_speculative_tokens": 3}'
        return [option, text], SpeculativeConfig(method="suffix", num_speculative_tokens=3)
    if isinstance(default, bool) or field.type == "bool | None":
        on = default is False  # None (a quantized cache's first block) -> off: always valid
        return [option if on else "--no-" + option[2:]], on
    if "float" in str(field.type):
        return [option, "0.5"], 0.5
    if "int" in str(field.type):
        number = 2 if default is None else default + 1
        return [option, str(number)], number
    return [option, "x"], "x"


@pytest.mark.parametrize("name", [name for name, _, _ in flagged_fields()])
def test_a_data_parallel_replica_gets_the_same_config(name: str) -> None:
    """``serve --data-parallel-size N`` repeats its flags on each replica's command line."""
    parser = _parser(server_cli.add_arguments)
    text, _ = _sample(name)
    context_argv, _ = CONTEXT.get(name, ([], {}))
    args = parser.parse_args([*context_argv, *text, "--data-parallel-size", "2"])
    replica = parser.parse_args(replica_argv(parser, args, 8001, args.master_port))
    assert config_from_args(replica, SERVE) == config_from_args(args, SERVE)


def test_the_kv_cache_range_sets_min_and_max() -> None:
    parser = _parser(server_cli.add_arguments)
    args = parser.parse_args(["--kv-cache-memory", "512MiB:4GiB"])
    config = config_from_args(args)
    assert (config.kv_cache_memory, config.kv_cache_memory_max) == (512 << 20, 4 * GIB)
    assert config_from_args(parser.parse_args(replica_argv(parser, args, 8001, None))) == config


@pytest.mark.parametrize(
    ("old_argv", "new_argv"),
    [
        (["--swap-space", "2"], ["--swap-memory", "2GiB"]),
        (["--swap-space", "0.5"], ["--swap-memory", "512MiB"]),
        (["--kv-offload-space", "16"], ["--kv-offload-size", "16GiB"]),
        (["--max-prefill-ms-while-decoding", "50"], ["--max-prefill-time-while-decoding", "50ms"]),
    ],
)
def test_old_spellings_still_work_with_a_warning(old_argv: list[str], new_argv: list[str]) -> None:
    parser = _parser(server_cli.add_arguments)
    with pytest.warns(FutureWarning, match="deprecated"):
        old = config_from_args(parser.parse_args(old_argv), SERVE)
    assert old == config_from_args(parser.parse_args(new_argv), SERVE)


def test_old_keywords_still_work_with_a_warning() -> None:
    with pytest.warns(FutureWarning, match="swap_memory"):
        assert make_config({"swap_space": 1.5}).swap_memory == int(1.5 * GIB)
    with pytest.warns(FutureWarning, match="kv_offload_size"):
        assert make_config({"kv_offload_space": 16}) == EngineConfig()
    with pytest.raises(ValueError, match="not both"):
        make_config({"swap_space": 1, "swap_memory": GIB})


def test_presets_fill_only_what_the_caller_left_open() -> None:
    assert make_config({}, OFFLINE).num_scheduler_steps == 8
    assert make_config({"num_scheduler_steps": 1}, OFFLINE).num_scheduler_steps == 1
    assert make_config({}, GENERATE) == EngineConfig()
    served = make_config({}, SERVE)
    assert (served.max_num_batched_tokens, served.max_prefill_tokens_while_decoding) == (512, 256)
    assert served.max_prefill_time_while_decoding_s == 0.128
    assert make_config({"enable_chunked_prefill": False}, SERVE) == EngineConfig(
        enable_chunked_prefill=False
    )
    assert Preset("empty").apply({"seed": 3}) == {"seed": 3}


@pytest.mark.parametrize(("text", "seconds"), [("30", 30.0), ("30s", 30.0), ("128ms", 0.128)])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_a_zero_size_is_left_to_the_config_to_judge() -> None:
    parser = _parser(server_cli.add_arguments)
    assert config_from_args(parser.parse_args(["--swap-memory", "0"])).swap_memory == 0
    with pytest.raises(ValueError, match="kv_offload_size must be a positive"):
        config_from_args(parser.parse_args(["--kv-offload-size", "0"]))


def test_bad_values_are_refused_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    parser = _parser(server_cli.add_arguments)
    for argv in (["--swap-memory", "lots"], ["--elastic-idle", "soon"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
        assert repr(argv[1]) in capsys.readouterr().err


def _readme_commands(command: str) -> list[list[str]]:
    """The README's ``pagedllm COMMAND ...`` lines (continuations joined), as argv."""
    text = README.read_text().replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        match = re.search(rf"pagedllm {command} (.*)", line)
        if match and "`" not in match.group(1):
            found.append(shlex.split(match.group(1), comments=True))
    return found


@pytest.mark.parametrize(
    ("command", "add_arguments"),
    [("serve", server_cli.add_arguments), ("generate", cli_generate.add_arguments)],
)
def test_every_readme_command_line_parses(command: str, add_arguments: Any) -> None:
    commands = _readme_commands(command)
    assert commands
    parser = _parser(add_arguments)
    for argv in commands:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the README shows no deprecated spelling
            config_from_args(parser.parse_args(argv))
