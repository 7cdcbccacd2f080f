"""Dataclass configs as command-line options, and text -> a config field's value.

``add_config_args`` adds one option per field of a config (``max_new_tokens`` -> ``--max-new-tokens``, its
``metadata["help"]`` as the option's help, in a group named after the config); ``config_from_args`` reads the
parsed options back as the config. Several configs share one subcommand's flat namespace: each option's
``dest`` is ``"<Class>.<field>"``, so two configs may have a field of the same name as long as only one of them
gives it an option there. ``parse_field`` converts one setting's text (a bench method spec's ``gamma=none``,
an option's value) by the field's resolved type; the options use the same conversion.

Why argparse and not tyro, jsonargparse or pydantic-settings: none of them keeps the existing options as they
are. tyro prefixes each config's options (``--a.max-new-tokens``) unless told not to, takes a list as
space-separated values (``--block-sizes 1,2,4`` is refused, a repeat replaces the earlier values) and ignores
the ``choices`` metadata; jsonargparse spells options with underscores (``--max_new_tokens``), wants
``--flag true`` and JSON lists (``[1,2,4]``) and does not show ``metadata["help"]``; pydantic-settings needs a
BaseSettings class per config, does not expand dataclass fields of one into options and shows neither the help
nor the choices. The conversion itself is pydantic's (``TypeAdapter.validate_strings``), already a dependency.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from functools import cache, partial
from typing import Any

from pydantic import TypeAdapter, ValidationError

from selfspec.errors import InvalidConfigError

NONE_WORDS = ("none", "null")  # the text of None, for a field that may be None
BOOL_WORDS = "true/false, yes/no, on/off, 1/0"


@dataclass(frozen=True)
class FieldType:
    """What text a config field takes, from its resolved annotation (``typing.get_type_hints``) and metadata."""

    name: str
    item: Any  # the value's type, or a list's item type: int, float, bool, str, ...
    is_list: bool
    optional: bool  # None is a value ("none" / "null")
    choices: tuple[Any, ...] | None  # metadata["choices"]
    comma_separated: bool  # a list's text may hold several items, comma-separated (metadata, default True)

    @property
    def type_name(self) -> str:
        return getattr(self.item, "__name__", str(self.item))


def _split_optional(hint: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (hint, False)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(args) < len(typing.get_args(hint)):
            return args[0], True
    return hint, False


@cache
def field_types(cls: type) -> dict[str, FieldType]:
    """Field name -> FieldType of every field of the dataclass ``cls`` (its annotations resolved, also when they
    are strings under ``from __future__ import annotations``)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in fields(cls):
        hint, optional = _split_optional(hints[f.name])
        is_list = typing.get_origin(hint) is list or hint is list
        item = (typing.get_args(hint) or (str,))[0] if is_list else hint
        choices = f.metadata.get("choices")
        out[f.name] = FieldType(f.name, item, is_list, optional, tuple(choices) if choices is not None else None,
                                bool(f.metadata.get("comma_separated", True)))
    return out


@cache
def _adapter(item: Any) -> TypeAdapter:
    return TypeAdapter(item)


def _one(ft: FieldType, text: str, whole: str) -> Any:
    """One value (a list's item) of type ``ft.item``; ``whole`` is the text named in the error."""
    if ft.item is str:
        return text
    try:
        return _adapter(ft.item).validate_strings(text.strip())
    except ValidationError as e:
        hint = f" ({BOOL_WORDS})" if ft.item is bool else ""
        raise InvalidConfigError(f"invalid {ft.type_name} value: {whole!r}{hint}") from e


def _check_choice(ft: FieldType, value: Any) -> None:
    if ft.choices is not None and value not in ft.choices:
        raise InvalidConfigError(f"invalid choice: {value!r} (choose from {', '.join(map(str, ft.choices))})")


def _items(ft: FieldType, text: str) -> list[Any]:
    """A list field's items in ``text``: comma-separated (empty parts dropped) unless the field says not."""
    parts = [p.strip() for p in text.split(",") if p.strip()] if ft.comma_separated else [text]
    values = [_one(ft, p, text) for p in parts]
    for v in values:
        _check_choice(ft, v)
    return values


def parse_value(ft: FieldType, text: str) -> Any:
    """``text`` as a value of the field ``ft``: None for "none" / "null" where the field may be None, a list's
    items comma-separated, bools as true/false, yes/no, on/off or 1/0, and the field's choices enforced.
    Raises InvalidConfigError naming the problem (``invalid int value: 'x'``, ``invalid choice: ...``)."""
    if ft.optional and text.strip().lower() in NONE_WORDS:
        return None
    if ft.is_list:
        return _items(ft, text)
    value = _one(ft, text, text)
    _check_choice(ft, value)
    return value


def parse_field(cls: type, name: str, text: str) -> Any:
    """The value of field ``name`` of the dataclass ``cls`` that ``text`` spells (see ``parse_value``), e.g.
    ``parse_field(DraftConfig, "gamma", "none")`` -> None. Raises InvalidConfigError for an unknown field or a
    bad value, naming the field."""
    by_name = field_types(cls)
    if name not in by_name:
        raise InvalidConfigError(f"unknown {cls.__name__} field '{name}' (known: {', '.join(by_name)})")
    try:
        return parse_value(by_name[name], text)
    except InvalidConfigError as e:
        raise InvalidConfigError(f"{cls.__name__}.{name}: {e}") from e


def _option_type(parse: Callable[[str], Any], type_name: str) -> Callable[[str], Any]:
    """An argparse ``type``: a bad value is a usage error with the converter's message."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except InvalidConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from e

    convert.__name__ = type_name
    return convert


def add_command(sub: Any, name: str, configs: tuple[type, ...], func: Callable[[argparse.Namespace], int],
                help: str, skip: dict[type, tuple[str, ...]] | None = None) -> argparse.ArgumentParser:
    """The subcommand ``name`` on ``sub`` (the CLI's subparsers): one option per field of each dataclass in
    ``configs`` (``add_config_args``, in that order), run by ``func``; returns its parser for any further options.
    ``skip``: fields of a config left out (they keep their defaults), e.g. where two configs name a field alike."""
    p = sub.add_parser(name, help=help)
    for cls in configs:
        add_config_args(p, cls, (skip or {}).get(cls, ()))
    p.set_defaults(func=func)
    return p


def add_config_args(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one option per field of the dataclass ``cls`` (``max_new_tokens`` -> ``--max-new-tokens``), in
    an argument group named after it; the field's ``help`` and ``choices`` metadata become the option's.
    A bool field is a ``--flag`` / ``--no-flag`` pair. A field that may be None takes "none". A list field's
    option may be repeated and each value may list several, comma-separated (``--block-sizes 1,2,4`` =
    ``--block-sizes 1 --block-sizes 2 --block-sizes 4``), unless the field's metadata says
    ``comma_separated=False``: then one value per occurrence. An option not given is left out of the parsed
    namespace (``config_from_args`` then keeps the field's default)."""
    group = parser.add_argument_group(cls.__name__, cls.__doc__)
    by_name = field_types(cls)
    for f in fields(cls):
        if f.name in skip:
            continue
        ft = by_name[f.name]
        flag = "--" + f.name.replace("_", "-")
        kw: dict[str, Any] = {"dest": f"{cls.__name__}.{f.name}", "help": f.metadata.get("help", "")}
        if ft.item is bool and not ft.is_list:
            group.add_argument(flag, action=argparse.BooleanOptionalAction,
                               default=f.default if f.default is not MISSING else argparse.SUPPRESS, **kw)
            continue
        kw["default"] = argparse.SUPPRESS
        if ft.is_list and ft.comma_separated:
            group.add_argument(flag, type=_option_type(partial(_items, ft), ft.type_name),
                               action="extend", **kw)
            continue
        # one value per occurrence: argparse checks the choices (its usage line shows them)
        one = FieldType(ft.name, ft.item, False, ft.optional and not ft.is_list, None, False)
        group.add_argument(flag, type=_option_type(partial(parse_value, one), ft.type_name),
                           action="append" if ft.is_list else "store", choices=ft.choices, **kw)


def config_from_args(args: argparse.Namespace, cls: type, **extra: Any) -> Any:
    """The ``cls`` config of parsed options (added by ``add_config_args``): options not given keep the
    field's default; ``extra`` overrides."""
    kw = {}
    for f in fields(cls):
        key = f"{cls.__name__}.{f.name}"
        if hasattr(args, key):
            kw[f.name] = getattr(args, key)
    kw.update(extra)
    return cls(**kw)
