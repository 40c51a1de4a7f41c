"""Spec strings that people type: ``"topk:ratio=0.01|quant:bits=4|zstd:level=3"``.

Grammar::

    spec   := stage ("|" stage)*
    stage  := name [":" param ("," param)*]
    param  := key "=" value        value: true | false | integer | float | word

A spec parses to a list of codec configs (``{"id": "topk", "ratio": 0.01}``) and
prints back canonically: parameters at their default are left out, the rest appear
in the codec's declaration order, so ``format_spec(parse_spec(s)) == s`` for every
canonical ``s`` and ``parse_spec(format_spec(c)) == c`` for every config list ``c``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from fedcomp.errors import SpecError

__all__ = ["MAX_SPEC_LENGTH", "MAX_STAGES", "format_spec", "parse_spec"]

MAX_SPEC_LENGTH = 512
MAX_STAGES = 8

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_INT = re.compile(r"^[+-]?\d+$")
_FLOAT = re.compile(r"^[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?$")
_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


def _parse_value(text: str, where: str) -> bool | int | float | str:
    if text == "true":
        return True
    if text == "false":
        return False
    if _INT.match(text):
        return int(text)
    if _FLOAT.match(text):
        return float(text)
    if _WORD.match(text):
        return text
    raise SpecError(f"{where}: cannot read value {text!r}")


def parse_spec(spec: str) -> list[dict[str, Any]]:
    """Parse a spec string into codec configs (ids are not checked against the registry)."""
    if not isinstance(spec, str):
        raise SpecError(f"a codec spec must be a string, got {type(spec).__name__}")
    if len(spec) > MAX_SPEC_LENGTH:
        raise SpecError(f"codec spec longer than {MAX_SPEC_LENGTH} characters")
    text = spec.strip()
    if not text:
        raise SpecError("empty codec spec (use 'none' for no compression)")
    stages = text.split("|")
    if len(stages) > MAX_STAGES:
        raise SpecError(f"codec spec has {len(stages)} stages; at most {MAX_STAGES}")
    configs = []
    for raw_stage in stages:
        stage = raw_stage.strip()
        name, _, params_text = stage.partition(":")
        name = name.strip()
        if not _NAME.match(name):
            raise SpecError(f"bad stage name {name!r} in codec spec {spec!r}")
        config: dict[str, Any] = {"id": name}
        if params_text.strip():
            for item in params_text.split(","):
                key, eq, value = item.partition("=")
                key = key.strip()
                if not eq or not _NAME.match(key):
                    raise SpecError(
                        f"bad parameter {item.strip()!r} in stage {name!r}; write key=value"
                    )
                if key in config:
                    raise SpecError(f"parameter {key!r} given twice in stage {name!r}")
                config[key] = _parse_value(value.strip(), f"stage {name!r}, {key}")
        elif ":" in stage:
            raise SpecError(f"stage {name!r} has ':' but no parameters")
        configs.append(config)
    return configs


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def format_spec(
    configs: Sequence[Mapping[str, Any]],
    defaults: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """Print configs as a spec string, leaving out parameters equal to ``defaults``."""
    stages = []
    for i, config in enumerate(configs):
        default = defaults[i] if defaults is not None else {}
        params = [
            f"{key}={_format_value(value)}"
            for key, value in config.items()
            if key != "id" and not (key in default and default[key] == value
                                    and type(default[key]) is type(value))
        ]
        stages.append(config["id"] + (":" + ",".join(params) if params else ""))
    return "|".join(stages)
