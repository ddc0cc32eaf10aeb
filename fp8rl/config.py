"""One typed config per process: pydantic models loaded from YAML, overridden from the command line,
validated before anything starts.

Overrides are dotted paths (``trainer.lr=1e-5``); values are parsed as YAML scalars, so numbers, booleans
and lists read naturally. Every failure becomes a :class:`ConfigError` with one line per bad field, ready
to print before exiting with status 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

Config = TypeVar("Config", bound=BaseModel)


class ConfigError(ValueError):
    """An invalid configuration; the message names each offending field."""


def parse_override(text: str) -> tuple[str, Any]:
    """``"a.b=3"`` -> ``("a.b", 3)``; the value is read as YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} is not of the form key=value")
    try:
        return key.strip(), yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key.strip()}: cannot parse value {value!r}: {exc}") from exc


def set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    *parents, leaf = dotted.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
        node = child
    node[leaf] = value


def read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: invalid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping at the top level")
    return data


def load_config(
    cls: type[Config],
    yaml_path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    dotted: Iterable[str] = (),
) -> Config:
    """Build ``cls`` from an optional YAML file, then ``overrides`` (dotted key -> value; ``None``
    values are skipped, so unset CLI flags keep the file's or the default value), then ``key=value``
    strings. Raises :class:`ConfigError` naming every invalid field."""
    data = read_yaml(yaml_path) if yaml_path else {}
    for key, value in (overrides or {}).items():
        if value is not None:
            set_path(data, key, value)
    for text in dotted:
        set_path(data, *parse_override(text))
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "config"
        got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
        lines.append(f"{where}: {err['msg']}{got}")
    return "invalid config: " + "; ".join(lines)


def config_hash(config: BaseModel) -> str:
    """Stable hash of a config's values (field order and formatting do not matter)."""
    canonical = json.dumps(config.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def config_diff(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of the fields that differ between two dumped configs."""
    diffs = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            diffs += config_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            diffs.append(f"{prefix}{key}")
    return diffs


def field_info(cls: type[BaseModel], dotted: str) -> tuple[FieldInfo, Any]:
    """The pydantic field at a dotted path of ``cls`` (``optimizer.lr``) and its default as ``cls``
    sees it (a section's own default may differ from its fields' defaults)."""
    *sections, leaf = dotted.split(".")
    default: Any = None
    for name in sections:
        info = cls.model_fields[name]
        default = (
            getattr(default, name) if default is not None else info.get_default(call_default_factory=True)
        )
        assert isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel), (
            f"{name}: no section"
        )
        cls = info.annotation
    info = cls.model_fields[leaf]
    return info, getattr(default, leaf) if default is not None else info.get_default(
        call_default_factory=True
    )


def _flag_kind(annotation: Any) -> dict[str, Any] | None:
    """argparse keywords for a field's type; None for what only ``--set`` reaches (sections, mappings)."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, UnionType):  # X | None
        kinds = [a for a in get_args(annotation) if a is not type(None)]
        return _flag_kind(kinds[0]) if len(kinds) == 1 else None
    if get_origin(annotation) is Literal:
        choices = list(get_args(annotation))
        return {"type": type(choices[0]), "choices": choices}
    if get_origin(annotation) is list and get_args(annotation)[0] in (str, int, float):
        return {"type": get_args(annotation)[0], "action": "append"}
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if annotation in (int, float, str, Path):
        return {"type": annotation}
    return None


def add_config_flags(
    parser: argparse.ArgumentParser, cls: type[BaseModel], shortcuts: Mapping[str, str] | None = None
) -> dict[str, str]:
    """``--config FILE``, one flag per scalar field of ``cls`` (its type, choices and attribute docstring;
    a list field's flag repeats), a flag per ``shortcuts`` entry (flag name -> dotted field) and ``--set
    KEY=VALUE`` for everything else. Returns what :func:`config_from_cli` reads: argparse dest -> field."""
    parser.add_argument("--config", type=Path, help=f"YAML file with {cls.__name__} fields")
    shortcuts = dict(shortcuts or {})  # (one named as a field stands in its place, in shortcuts' order)
    fields = {name: name for name in cls.model_fields if name not in shortcuts} | shortcuts
    flags = {}
    for name, dotted in fields.items():
        info, default = field_info(cls, dotted)
        kind = _flag_kind(info.annotation)
        if kind is None:
            continue
        text = " ".join((info.description or "").split())
        if default not in (None, []) and kind.get("type") is not Path:
            text += f" Default: {default!r}."
        if kind.get("action") == "append":
            text += " Repeat the flag for more."
        text = text.strip().replace("%", "%%")
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None, help=text or None, **kind)
        flags[name] = dotted
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any config field")
    return flags


def config_from_cli(cls: type[Config], prog: str, args: Any, flags: Mapping[str, str]) -> Config:
    """The config of a process from its parsed command line (``--config FILE``, the ``flags`` from
    :func:`add_config_flags` and ``--set key=value``); on a bad value, print one line naming the field and
    exit with status 2."""
    try:
        overrides = {dotted: getattr(args, dest) for dest, dotted in flags.items()}
        return load_config(cls, args.config, overrides, args.set)
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
