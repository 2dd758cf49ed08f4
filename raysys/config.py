"""Typed configuration: nested dataclasses, YAML files and dotted ``--set`` overrides.

Every workload's config is a tree of dataclasses. Users change it three ways, applied in order:
a preset (Python function), a YAML file, and ``--set key.path=value`` overrides. Whatever the
source, a key that does not exist or a value of the wrong type fails *before anything starts*,
with a message naming the key and the allowed ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, Union

import yaml


class ConfigError(ValueError):
    """A configuration problem the user can fix (unknown key, wrong type, bad YAML)."""


def to_dict(cfg: Any) -> dict:
    """Nested plain dict of a dataclass config (JSON/YAML-safe)."""
    return dataclasses.asdict(cfg)


def flatten(d: Mapping, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}. A key written both ways ({'a.b': 1, 'a': {'b': 2}}) is a ConfigError,
    not the last one silently."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        put_once(out, flatten(v, key + ".") if isinstance(v, Mapping) and v else {key: v})
    return out


def put_once(out: dict, new: Mapping) -> None:
    """``out.update(new)`` of flattened keys, refusing one already there (written dotted and in its section)."""
    for key, v in new.items():
        if key in out:
            raise ConfigError(f"'{key}' is given twice (as a dotted key and inside its section)")
        out[key] = v


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def allowed_keys(cfg_or_cls: Any, prefix: str = "") -> list[str]:
    """Every dotted leaf path of a config class, for error messages and tune-space validation."""
    cls = cfg_or_cls if isinstance(cfg_or_cls, type) else type(cfg_or_cls)
    keys = []
    for name, tp in _field_types(cls).items():
        if dataclasses.is_dataclass(tp):
            keys += allowed_keys(tp, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert ``value`` (often a string from the command line) to type ``tp`` or raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in ("none", "null", ""))):
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: {value!r} matches none of {tp}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        for a in allowed:
            if value == a or (isinstance(value, str) and str(a) == value):
                return a
        raise ConfigError(f"{key}: {value!r} is not one of {list(allowed)}")
    if origin is dict or tp is dict:  # free-form keyword arguments (a task's constructor): YAML in a string
        if isinstance(value, str):
            value = _yaml_value(value) if value.strip() else {}
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key}: expected a mapping of names to values such as {{dt: 20}}, got {value!r}")
        return dict(value)
    if origin in (list, tuple):
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        if isinstance(value, str):
            value = [v for v in value.strip("[]").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        items = [coerce(v.strip() if isinstance(v, str) else v, item_tp, key) for v in value]
        return tuple(items) if origin is tuple else items
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(str(value).replace("_", ""))
        except ValueError:
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{key}: unsupported config type {tp}")


def apply_overrides(cfg: Any, overrides: Mapping[str, Any]) -> Any:
    """Return a copy of ``cfg`` with dotted-path ``overrides`` applied and type-checked."""
    cfg = _deepcopy(cfg)
    for key, value in overrides.items():
        node, parts = cfg, key.split(".")
        for i, part in enumerate(parts):
            types_here = _field_types(type(node))
            if part not in types_here:
                where = ".".join(parts[:i]) or "the top level"
                allowed = sorted(types_here)
                raise ConfigError(
                    f"unknown config key '{key}' ('{part}' is not a field of {where}); "
                    f"allowed there: {', '.join(allowed)}"
                )
            tp = types_here[part]
            if i < len(parts) - 1 and _is_mapping_type(tp):  # key.name=value sets one entry (nested: key.a.b)
                setattr(node, part, _with_entry(getattr(node, part) or {}, parts[i + 1:], value))
                break
            if i < len(parts) - 1:
                if not dataclasses.is_dataclass(tp):
                    raise ConfigError(f"unknown config key '{key}': '{'.'.join(parts[:i + 1])}' is a value, not a section")
                node = getattr(node, part)
            elif dataclasses.is_dataclass(tp):
                if not isinstance(value, Mapping):
                    raise ConfigError(f"config key '{key}' is a section; set its fields, e.g. {key}.{allowed_keys(tp)[0].split('.')[0]}=...")
                apply_in_place(getattr(node, part), flatten(value))
            else:
                setattr(node, part, coerce(value, tp, key))
    _validate(cfg)
    return cfg


def _is_mapping_type(tp: Any) -> bool:
    return tp is dict or typing.get_origin(tp) is dict


def _yaml_value(v: Any) -> Any:
    """A mapping entry given on the command line is a string: read it as YAML (``20`` is a number, ``[1, 2]``
    a list); anything else, or a string YAML cannot read, stays as it is."""
    if not isinstance(v, str):
        return v
    try:
        out = yaml.safe_load(v)
    except yaml.YAMLError:
        return v
    if isinstance(out, str) and _SCIENTIFIC.fullmatch(out.strip()):
        return float(out)  # YAML 1.1 reads 1e-3 (no dot) as a string
    return out


_SCIENTIFIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _with_entry(d: Mapping, path: list[str], value: Any) -> dict:
    """A copy of ``d`` with ``d[path[0]][path[1]]... = value`` (a flattened mapping's dotted keys, rebuilt)."""
    out = dict(d)
    head, rest = path[0], path[1:]
    out[head] = _with_entry(out.get(head) if isinstance(out.get(head), Mapping) else {}, rest, value) if rest \
        else _yaml_value(value)
    return out


def apply_in_place(node: Any, overrides: Mapping[str, Any]) -> None:
    new = apply_overrides(node, overrides)
    for f in dataclasses.fields(node):
        setattr(node, f.name, getattr(new, f.name))


def _deepcopy(cfg: Any) -> Any:
    import copy

    return copy.deepcopy(cfg)


def _validate(cfg: Any, prefix: str = "") -> None:
    """Run ``validate()`` hooks bottom-up so sections can check cross-field constraints. NaN and infinity are
    never a meaningful value of a setting (an infinite learning rate passes a "> 0" rule and trains on NaN;
    "off" is 0 or null where a field has it), so they fail everywhere, in lists too."""
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            _validate(v, f"{prefix}{f.name}.")
            continue
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(x, float) and not math.isfinite(x):
                raise ConfigError(f"{prefix}{f.name}: {x} is not a valid value (a setting is a finite number"
                                  + ("; 0 or null turns it off where the field allows" if x > 0 else "") + ")")
            if isinstance(x, int) and not isinstance(x, bool) and abs(x) > 2**63 - 1:
                raise ConfigError(f"{prefix}{f.name}: {x} is beyond any count a run can hold (at most 2**63 - 1)")
    hook = getattr(cfg, "validate", None)
    if callable(hook):
        hook()


def require(cond: bool, message: str) -> None:
    """One range/shape rule of a ``validate()`` hook: a ConfigError with ``message`` when ``cond`` fails."""
    if not cond:
        raise ConfigError(message)


def at_least(section: Any, prefix: str, minimum: float, *names: str) -> None:
    """``prefix.name >= minimum`` for each (None, meaning 'off', passes)."""
    for name in names:
        v = getattr(section, name)
        values = v if isinstance(v, (list, tuple)) else [v]
        if v is not None and (not values or any(x < minimum for x in values)):
            raise ConfigError(f"{prefix}{name} must be >= {minimum:g}, got {v!r}")


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (plain YAML keeps the last, silently: a knob
    listed twice in a space would sweep only its second domain)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path, what: str = "config file") -> Any:
    """Parse a YAML file; a missing file, bad YAML or a key given twice is one ConfigError saying where."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} not found: {path}" if not path.exists() else f"{what} {path} is not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:  # a binary file, or another encoding
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r}); "
                          "YAML files are UTF-8") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"bad YAML in {path}{where}: {getattr(e, 'problem', e)}") from None


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into dotted overrides; a clear ConfigError on any problem."""
    data = read_yaml(path)
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: the top level must be a mapping of config keys, got {type(data).__name__}")
    return flatten(data)


def parse_set_args(items: list[str] | None) -> dict[str, str]:
    """['train.lr=1e-3', ...] -> {'train.lr': '1e-3'}; values stay strings until coerced."""
    out: dict[str, str] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set expects key.path=value, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()  # typed later by coerce(), against the field's annotation
    return out


def from_dict(cls: type, data: Mapping[str, Any]) -> Any:
    """Rebuild a config from ``to_dict`` output (e.g. inside a Ray worker or from a checkpoint)."""
    return apply_overrides(cls(), _flatten_sections(cls, data))


def _flatten_sections(cls: type, d: Mapping, prefix: str = "") -> dict[str, Any]:
    """``flatten`` down to the config's fields only: a mapping field's value stays whole, as it was typed."""
    types_here = _field_types(cls)
    out: dict[str, Any] = {}
    for k, v in d.items():
        tp = types_here.get(k)
        if tp is not None and dataclasses.is_dataclass(tp) and isinstance(v, Mapping):
            out.update(_flatten_sections(tp, v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def fingerprint(d: Mapping[str, Any]) -> str:
    """Short stable hash of a (sub)config, stored in checkpoints to refuse mismatched resumes."""
    blob = json.dumps(d, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (CleanRL's Args convention), read from source;
    a subclass inherits its bases' field docs and may override them."""
    import ast
    import inspect
    import textwrap

    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__[1:]):
        if dataclasses.is_dataclass(base):
            docs.update(field_docs(base))
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return docs
    body = tree.body[0].body
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr) \
                and isinstance(getattr(nxt, "value", None), ast.Constant) and isinstance(nxt.value.value, str):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe(cfg: Any, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, current value, doc) for every leaf of a config, for `raysys show --keys`."""
    rows = []
    docs = field_docs(type(cfg))
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            rows += describe(v, f"{prefix}{f.name}.")
        else:
            rows.append((f"{prefix}{f.name}", v, docs.get(f.name, "")))
    return rows
