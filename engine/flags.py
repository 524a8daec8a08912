"""Command-line flags derived from EngineConfig's fields, and the config they give."""

from __future__ import annotations

import argparse
import os
import types
import typing
from typing import Any

from superinfer.engine.config import EngineConfig
from superinfer.engine.contract import API_KEY_ENV


def _flag_type(annotation: Any) -> tuple[type | None, tuple | None]:
    """(argparse type, choices) of a field annotation such as `int | None` or `Literal[...]`."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return type(args[0]), tuple(args)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return _flag_type(args[0])
    return annotation, None


SHORT_FLAGS = {"tensor_parallel_size": "-tp"}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    for name, field in EngineConfig.model_fields.items():
        flags = ["--" + name.replace("_", "-"), *([SHORT_FLAGS[name]] if name in SHORT_FLAGS else [])]
        kind, choices = _flag_type(field.annotation)
        help_text = f"{field.description or ''} (default: {field.default})".strip()
        if kind is bool:
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(*flags, dest=name, type=kind, choices=choices, default=None, help=help_text)


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    values = {k: v for k, v in vars(args).items() if k in EngineConfig.model_fields and v is not None}
    if "api_key" not in values and os.environ.get(API_KEY_ENV):
        values["api_key"] = os.environ[API_KEY_ENV]
    return EngineConfig(**{**overrides, **values})
