"""Codec registry: names to codec classes, as in numcodecs' ``registry.py``.

A codec class registers itself with :func:`register_codec`; :func:`get_codec` builds
one from a config dict (``{"id": "topk", "ratio": 0.01}``). Registering a second class
under an existing id is refused, as Opacus' accountant registry does, so a plugin can
never silently replace a codec that payloads already name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from fedcomp.codecs.base import Codec
from fedcomp.errors import SpecError

__all__ = ["available_codecs", "codec_class", "get_codec", "register_codec"]

_REGISTRY: dict[str, type[Codec]] = {}

C = TypeVar("C", bound=type[Codec])


def register_codec(cls: C) -> C:
    """Class decorator: register ``cls`` under ``cls.codec_id``.

    Raises
    ------
    ValueError
        If another class already uses that id.
    """
    codec_id = cls.codec_id
    existing = _REGISTRY.get(codec_id)
    if existing is not None and existing is not cls:
        raise ValueError(
            f"codec id {codec_id!r} is already registered by "
            f"{existing.__module__}.{existing.__qualname__}"
        )
    _REGISTRY[codec_id] = cls
    return cls


def available_codecs() -> list[str]:
    """Sorted ids of all registered codecs."""
    _ensure_builtin()
    return sorted(_REGISTRY)


def codec_class(codec_id: str) -> type[Codec]:
    """The class registered under ``codec_id``; :class:`SpecError` if unknown."""
    _ensure_builtin()
    try:
        return _REGISTRY[codec_id]
    except KeyError:
        raise SpecError(
            f"unknown codec {codec_id!r}; available: {', '.join(sorted(_REGISTRY))}"
        ) from None


def get_codec(config: Mapping[str, Any]) -> Codec:
    """Build a codec from a config dict with an ``"id"`` key."""
    if "id" not in config:
        raise SpecError(f"codec config has no 'id': {dict(config)!r}")
    return codec_class(config["id"]).from_config(config)


def _ensure_builtin() -> None:
    # Importing the codec families registers them; done lazily to avoid import cycles.
    import fedcomp.codecs  # noqa: F401
