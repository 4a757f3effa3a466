"""``wsi-pipeline run``'s settings flags, made from the fields of :class:`~wsi_pipeline.config.RunConfig`.

Each field with a :class:`~wsi_pipeline.config.CliOption` is one flag: its name, help, choices and
type come from the field, so a setting is declared once and every flag reaches the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from ..config import CliOption, RunConfig


def setting_fields() -> list[tuple[dataclasses.Field, CliOption]]:
    """The settings that are flags, in RunConfig's order, with their command-line form."""
    return [(f, f.metadata["cli"]) for f in dataclasses.fields(RunConfig) if f.metadata.get("cli")]


def flag_name(f: dataclasses.Field, cli: CliOption) -> str:
    return cli.flag or "--" + f.name.replace("_", "-")


def _value_type(hint: Any) -> type | None:
    """What argparse converts a flag's text to: int or float, else the text as it is."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint
    return base if base in (int, float) else None


def add_setting_flags(p: argparse.ArgumentParser, section: str) -> None:
    """The flags of the settings of ``section``, in RunConfig's order; those of one ``exclusive``
    name in a mutually exclusive group."""
    hints = typing.get_type_hints(RunConfig)
    groups: dict[str, Any] = {}
    for f, cli in setting_fields():
        if cli.section != section:
            continue
        target = p
        if cli.exclusive is not None:
            if cli.exclusive not in groups:
                groups[cli.exclusive] = p.add_mutually_exclusive_group()
            target = groups[cli.exclusive]
        kwargs: dict[str, Any] = {"help": cli.help() if callable(cli.help) else cli.help}
        if cli.metavar is not None:
            kwargs["metavar"] = cli.metavar
        if f.metadata.get("choices") is not None:
            kwargs["choices"] = f.metadata["choices"]
        if cli.append:
            kwargs.update(action="append", dest=f.name)
        elif (value_type := _value_type(hints[f.name])) is not None:
            kwargs["type"] = value_type
        target.add_argument(flag_name(f, cli), **kwargs)


def apply_flags(values: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """``values`` (a config's settings) with the flags given in ``args`` applied: a flag replaces
    the setting, a repeatable one adds to it, and one of an exclusive group clears the others."""
    values = dict(values)
    fields = setting_fields()
    for f, cli in fields:
        given = getattr(args, f.name, None)
        if given is None:
            continue
        if cli.append:
            values[f.name] = [*values.get(f.name, ()), *given]
            continue
        for other, other_cli in fields:
            if cli.exclusive is not None and other_cli.exclusive == cli.exclusive and other is not f:
                values[other.name] = None
        values[f.name] = given
    return values
