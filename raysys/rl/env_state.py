"""The state of a running gymnasium env as plain data, for checkpoints that resume exactly.

Gymnasium has no get/set-state API, and pickling an env would make every checkpoint an unsafe
unpickle. Instead :func:`capture` walks the env object (wrappers, the task, the objects it holds
such as NeuroGym's timing distributions) and keeps what is *data*: numbers, strings, numpy arrays
and scalars, tensors, ``RandomState`` / ``Generator`` states, and containers of those. Everything
else (spaces, specs, callables, handles) is configuration the env was built with and is rebuilt
by its factory. The result holds only what ``torch.load(weights_only=True)`` accepts.

:func:`apply` writes such a state back into a freshly built env of the same kind, in place (random
generators are re-seeded to their saved state, not replaced). A state that does not fit the env
raises :class:`EnvStateMismatch`; callers then fall back to fresh episodes.

Encoded values: Python scalars and ``None`` as themselves; everything else as a tagged tuple,
``("nd", dtype, shape, uint8 tensor)``, ``("np", dtype, uint8 tensor)`` (a numpy scalar),
``("t", tensor)``, ``("rs", state)``, ``("gen", state)``, ``("obj", {attr: value})``,
``("dict", [(key, value)])``, ``("list", [...])``, ``("tuple", [...])``.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import numpy as np
import torch

MAX_DEPTH = 16
_PLAIN = (bool, int, float, str, type(None))


class EnvStateMismatch(ValueError):
    """A saved env state that does not fit the env it is applied to."""


class _Skip(Exception):
    """A value that is not data (kept out of the state: the factory rebuilds it)."""


def _is_config(v: Any) -> bool:
    import gymnasium as gym

    return isinstance(v, (gym.spaces.Space, gym.envs.registration.EnvSpec, type, types.ModuleType,
                          types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial))


def encode(v: Any, seen: dict[int, Any] | None = None, depth: int = 0) -> Any:
    """``v`` as plain data (raises ``_Skip`` for what is not data). ``seen`` holds the containers
    on the way (by id, and the object itself so that no id is reused while we walk)."""
    seen = {} if seen is None else seen
    if isinstance(v, _PLAIN) and not isinstance(v, np.generic):  # np.float64 is a float too
        return v
    if depth > MAX_DEPTH or _is_config(v):
        raise _Skip
    if isinstance(v, np.ndarray):
        if v.dtype.hasobject:
            raise _Skip
        a = np.ascontiguousarray(v)
        return ("nd", a.dtype.str, list(a.shape), torch.from_numpy(a.reshape(-1).view(np.uint8).copy()))
    if isinstance(v, np.generic):
        a = np.asarray(v)
        if a.dtype.hasobject:
            raise _Skip
        return ("np", a.dtype.str, torch.from_numpy(a.reshape(1).view(np.uint8).copy()))
    if isinstance(v, torch.Tensor):
        return ("t", v.detach().clone())
    if isinstance(v, np.random.RandomState):
        return ("rs", encode(v.get_state(), seen, depth + 1))
    if isinstance(v, np.random.Generator):
        return ("gen", encode(v.bit_generator.state, seen, depth + 1))
    if id(v) in seen:  # a cycle (e.g. NeuroGym's ``_top`` is the env itself)
        raise _Skip
    seen[id(v)] = v
    if isinstance(v, dict):
        return ("dict", [(encode(k, seen, depth + 1), encode(x, seen, depth + 1)) for k, x in v.items()])
    if isinstance(v, (list, tuple)):
        return ("list" if isinstance(v, list) else "tuple", [encode(x, seen, depth + 1) for x in v])
    if hasattr(v, "__dict__") and not isinstance(v, torch.nn.Module):
        return ("obj", _attrs(v, seen, depth + 1))
    raise _Skip


def _attrs(obj: Any, seen: dict[int, Any], depth: int) -> dict[str, Any]:
    out = {}
    for name, value in vars(obj).items():
        try:
            out[name] = encode(value, seen, depth)
        except _Skip:
            pass
    return out


def capture(env: Any) -> dict[str, Any]:
    """The data of ``env`` (a gymnasium env with all its wrappers), as ``{attr: encoded}``."""
    return _attrs(env, {id(env): env}, 0)


def decode(enc: Any, current: Any = None) -> Any:
    """The value ``enc`` stands for; random generators and objects are restored into ``current``."""
    if not isinstance(enc, tuple):
        return enc
    tag = enc[0]
    if tag == "nd":
        _, dtype, shape, raw = enc
        return raw.numpy().view(np.dtype(dtype)).reshape(shape).copy()
    if tag == "np":
        _, dtype, raw = enc
        return raw.numpy().view(np.dtype(dtype))[0]
    if tag == "t":
        return enc[1].clone()
    if tag == "rs":
        if not isinstance(current, np.random.RandomState):
            raise EnvStateMismatch("saved RandomState has no RandomState to restore into")
        current.set_state(decode(enc[1]))
        return current
    if tag == "gen":
        if not isinstance(current, np.random.Generator):
            raise EnvStateMismatch("saved Generator has no Generator to restore into")
        current.bit_generator.state = decode(enc[1])
        return current
    if tag == "obj":
        if current is None or not hasattr(current, "__dict__"):
            raise EnvStateMismatch(f"saved object has nothing to restore into ({type(current).__name__})")
        apply(current, enc[1])
        return current
    if tag == "dict":
        cur = current if isinstance(current, dict) else {}
        return {decode(k): decode(v, cur.get(decode(k))) for k, v in enc[1]}
    if tag in ("list", "tuple"):
        cur = current if isinstance(current, (list, tuple)) and len(current) == len(enc[1]) else [None] * len(enc[1])
        items = [decode(v, c) for v, c in zip(enc[1], cur)]
        return items if tag == "list" else tuple(items)
    raise EnvStateMismatch(f"unknown state tag {tag!r}")


def _check(enc: Any, current: Any, where: str) -> None:
    """Raise EnvStateMismatch if ``enc`` cannot be restored into ``current`` (nothing is changed)."""
    if not isinstance(enc, tuple):
        return
    tag = enc[0]
    kinds = {"rs": np.random.RandomState, "gen": np.random.Generator}
    if tag in kinds and not isinstance(current, kinds[tag]):
        raise EnvStateMismatch(f"{where}: saved a {kinds[tag].__name__}, the env has {type(current).__name__}")
    if tag == "obj":
        if current is None or not hasattr(current, "__dict__"):
            raise EnvStateMismatch(f"{where}: saved an object, the env has {type(current).__name__}")
        for name, v in enc[1].items():
            _check(v, getattr(current, name, None), f"{where}.{name}")
    elif tag == "dict" and isinstance(current, dict):
        for k, v in enc[1]:
            _check(v, current.get(decode(k)), f"{where}[{decode(k)!r}]")
    elif tag in ("list", "tuple") and isinstance(current, (list, tuple)) and len(current) == len(enc[1]):
        for i, (v, c) in enumerate(zip(enc[1], current)):
            _check(v, c, f"{where}[{i}]")


def apply(env: Any, state: dict[str, Any]) -> None:
    """Write ``state`` (from :func:`capture`) back into ``env``, in place. A state that does not fit
    raises :class:`EnvStateMismatch` before anything is changed."""
    for name, enc in state.items():
        _check(enc, getattr(env, name, None), name)
    for name, enc in state.items():
        setattr(env, name, decode(enc, getattr(env, name, None)))
