"""Typed dataclass configs that double as CLI flags and config files.

A config is a plain ``@dataclass`` whose fields carry their help text in ``metadata["help"]``::

    @dataclass
    class TrainConfig:
        lr: float = field(default=3e-4, metadata={"help": "peak learning rate"})

    add_dataclass_arguments(parser, TrainConfig)            # --lr 3e-4
    cfg = dataclass_from_args(TrainConfig, args, base=load_config(TrainConfig, "run.toml"))

Values come, by increasing priority, from the field defaults, a TOML/JSON config file, then the
flags the user actually typed. Nothing is ever ``exec``'d.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_UNSET = object()


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(inner type, is_optional) for `X | None` / `Optional[X]`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _flag(name: str, prefix: str) -> str:
    return "--" + (prefix + name).replace("_", "-")


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> None:
    """Add one flag per field of dataclass `cls`. Unset flags stay absent from the namespace
    (default SUPPRESS), so that a config file's values are only overridden by typed flags."""
    hints = _field_types(cls)
    group = parser.add_argument_group(f"{cls.__name__} options")
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get("cli") is False:
            continue
        tp, optional = _unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp):  # a grouped sub-config: its fields as --<name>-<field> flags
            add_dataclass_arguments(parser, tp, prefix=f"{prefix}{f.name}_")
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        )
        help_text = f.metadata.get("help", "")
        if not help_text:
            help_text = f"default: {default!r}"
        elif "default" not in help_text.lower() and not (default is None and "None" in help_text):
            help_text = f"{help_text} (default: {default!r})"  # said once: not where the help explains it
        kwargs: dict[str, Any] = {"dest": prefix + f.name, "default": argparse.SUPPRESS, "help": help_text}
        origin = typing.get_origin(tp)
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif origin is typing.Literal:
            choices = typing.get_args(tp)
            kwargs["choices"] = choices
            kwargs["type"] = type(choices[0])
        elif origin in (list, tuple):
            (inner, *_) = typing.get_args(tp) or (str,)
            kwargs["nargs"] = "*" if optional else "+"
            kwargs["type"] = inner
        elif tp in (int, float, str):
            kwargs["type"] = tp
            kwargs["metavar"] = tp.__name__.upper()
        elif tp is Path:
            kwargs["type"] = Path
            kwargs["metavar"] = "PATH"
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: unsupported config field type {tp!r}")
        if optional and tp in (int, float, Path):
            kwargs["type"] = _optional(tp)
        group.add_argument(_flag(f.name, prefix), **kwargs)


def _optional(tp: type):
    def parse(text: str):
        return None if text.lower() in ("none", "null", "") else tp(text)

    parse.__name__ = tp.__name__
    return parse


def _coerce(cls: type, name: str, tp: Any, value: Any) -> Any:
    inner, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise ValueError(f"{cls.__name__}.{name}: None is not allowed (expected {inner!r})")
    origin = typing.get_origin(inner)
    if origin is typing.Literal:
        choices = typing.get_args(inner)
        if value not in choices:
            raise ValueError(f"{cls.__name__}.{name}: {value!r} is not one of {list(choices)}")
        return value
    if inner is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{cls.__name__}.{name}: expected true/false, got {value!r}")
        return value
    if inner is float and isinstance(value, int):
        return float(value)
    if inner is Path:
        return Path(value)
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ValueError(f"{cls.__name__}.{name}: expected a list, got {value!r}")
        return list(value) if origin is list else tuple(value)
    if dataclasses.is_dataclass(inner) and isinstance(inner, type):
        if isinstance(value, inner):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{cls.__name__}.{name}: expected a table of {inner.__name__} fields, got {value!r}")
        return from_dict(inner, value, where=f"{cls.__name__}.{name}")
    if inner in (int, float, str) and not isinstance(value, inner):
        raise ValueError(f"{cls.__name__}.{name}: expected {inner.__name__}, got {value!r}")
    return value


def from_dict(cls: type[T], data: dict[str, Any], base: T | None = None, where: str = "") -> T:
    """Build `cls` from a mapping, on top of `base`; unknown keys and wrong types are errors."""
    hints = _field_types(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(
            f"{where or cls.__name__}: unknown option(s) {unknown}; expected some of {sorted(names)}"
        )
    values = {}
    for k, v in data.items():
        inner = _unwrap_optional(hints[k])[0]
        sub_base = getattr(base, k, None) if base is not None else None
        if dataclasses.is_dataclass(inner) and isinstance(v, dict) and sub_base is not None:
            values[k] = from_dict(inner, v, base=sub_base, where=f"{where or cls.__name__}.{k}")  # merged
        else:
            values[k] = _coerce(cls, k, hints[k], v)
    return dataclasses.replace(base, **values) if base is not None else cls(**values)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a TOML (``.toml``) or JSON (``.json``) config file; clear errors when missing or invalid."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    text = path.read_text(encoding="utf-8")
    try:
        return json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{path}: not a valid {'JSON' if path.suffix == '.json' else 'TOML'} file: {e}") from e


def load_config(cls: type[T], path: str | Path) -> T:
    """Read a TOML (``.toml``) or JSON (``.json``) config file into dataclass `cls`."""
    return from_dict(cls, read_config_file(path), where=str(path))


def dataclass_from_args(cls: type[T], args: argparse.Namespace, base: T | None = None, prefix: str = "") -> T:
    """The flags the user typed (see add_dataclass_arguments), applied on top of `base`."""
    return from_dict(cls, _typed_flags(cls, args, prefix), base=base)


def _typed_flags(cls: type, args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    """{field: value} of the flags the user typed; a grouped sub-config's as a nested dict."""
    hints = _field_types(cls)
    data: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = _unwrap_optional(hints[f.name])[0]
        if dataclasses.is_dataclass(tp):
            nested = _typed_flags(tp, args, f"{prefix}{f.name}_")
            if nested:
                data[f.name] = nested
            continue
        value = getattr(args, prefix + f.name, _UNSET)
        if value is not _UNSET:
            data[f.name] = value
    return data


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-ready dict of a config (Paths become strings)."""
    out = dataclasses.asdict(cfg)
    return {k: str(v) if isinstance(v, Path) else v for k, v in out.items()}


RECIPES_DIR = Path(__file__).resolve().parent / "recipes"  # package data (recipes/ at the repository root)


def recipe_names(folder: str = "") -> list[str]:
    """Names of the shipped recipes in `folder` ("" = training runs, "clusters", "clusters/models")."""
    where = RECIPES_DIR / folder
    return sorted(p.stem for p in where.glob("*.toml")) if where.is_dir() else []


def resolve_recipe(value: str | Path, folder: str = "", what: str = "config") -> Path:
    """`value` as a path if it exists, else the shipped recipe of that name (``tinystories`` ->
    ``scratchlm/recipes/tinystories.toml``), so recipes work from any folder and from an installed wheel.
    Raises FileNotFoundError listing the recipe names."""
    path = Path(value)
    if path.exists():
        return path
    name = str(value)
    if "/" not in name and "\\" not in name:
        candidate = RECIPES_DIR / folder / (name if name.endswith(".toml") else name + ".toml")
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{what} {value!r} not found: neither a file nor a shipped recipe (recipes: "
                            f"{', '.join(recipe_names(folder)) or 'none'})")
