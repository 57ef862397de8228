"""ClusterConfig as `pdserve serve` flags: one flag per field, generated from the fields
(add_config_flags), so the flags and the YAML keys (deploy/config.py) can't drift apart; and the flags
given on a command line as the overrides ClusterConfig.load applies over the YAML file
(overrides_from_args). Defaults are suppressed, so only a flag that is given overrides anything.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from typing import Any, Literal

from deploy.config import ClusterConfig

_FLAGLESS = {"model"}  # the positional MODEL_DIR
_TEXT_FLAGS = {"max_model_len"}  # parsed by the field's validator (8k), not by argparse


def _flag_type(annotation) -> tuple[Any, dict]:
    """argparse kwargs for a field's annotation."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _flag_type(args[0])
    if annotation is bool:
        return None, {"action": argparse.BooleanOptionalAction}
    if origin is Literal:
        return None, {"choices": list(typing.get_args(annotation))}
    if origin in (typing.Union, types.UnionType):  # e.g. str | tuple[int, ...]: the validator parses text
        return None, {"type": str}
    if annotation in (int, float, str):
        return None, {"type": annotation}
    return None, {"type": str}


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ClusterConfig field; defaults are suppressed so only given flags override."""
    for name, field in ClusterConfig.model_fields.items():
        if name in _FLAGLESS:
            continue
        _, kwargs = _flag_type(field.annotation)
        if name in _TEXT_FLAGS:
            kwargs = {"type": str}
        default = field.get_default(call_default_factory=True)
        shown = json.dumps(default) if isinstance(default, dict) else repr(default)
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, default=argparse.SUPPRESS,
                            help=(field.description or "").replace("%", "%%") + f" (default: {shown})", **kwargs)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    d = {k: v for k, v in vars(args).items() if k in ClusterConfig.model_fields}
    if getattr(args, "model_dir", None):
        d["model"] = args.model_dir
    return d
