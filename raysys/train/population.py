"""How a JAX workload's population (``python -m raysys.tune --vectorize K``) carries its members.

A workload compiles its chunk program once and wraps it in one of two carriers; its own loop then
asks the carrier for a chunk of the live members, each member's speed and each member's state:

* :class:`Batched` (``vmap``): one call advances every member of a stacked state. The chunk's time
  is the whole population's, so a member's speed is a probe's: one member of the same shape timed
  alone, measured by the workload.
* :class:`InTurn` (``loop``): the lone run's program, called for each live member in turn, each call
  timed on its own. One compile, no probe, and each member is bit-identical to its lone run.

``train.population = auto`` (:func:`population_mode`) is ``loop`` on a CPU, where a batch of members
runs no faster than one, and ``vmap`` on a GPU or TPU, which one member leaves idle.

Members of one program must have states of one shape: a ``member_knobs`` entry that changes a shape
(a width, a batch size) is a workload's mistake that would otherwise run every member at one
member's shapes. :func:`check_shapes` refuses it, naming the knob: the carriers check the states they
are given (``InTurn``, and :func:`stack` for ``Batched``) and the states the members checkpoint through
their sessions, one :class:`SameShapes` per program (:func:`raysys.session.run_population`).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

_MEMBERS: contextvars.ContextVar[Optional["SameShapes"]] = contextvars.ContextVar("raysys_members", default=None)


def population_mode(setting: str) -> str:
    """A ``train.population`` setting with ``auto`` resolved for the devices JAX sees."""
    if setting != "auto":
        return setting
    import jax

    return "loop" if jax.devices()[0].platform == "cpu" else "vmap"


class SameShapes:
    """The one shape check of a program's members, from its configurations (to name the knob at fault):
    :meth:`active` makes it the check of the carriers (given states, not configurations), and
    :meth:`saw` checks the states the members checkpoint. raysys does not see a population's initial
    states; each member's first checkpoint is compared with the first of the others saved at the same
    step (a state may grow with its step: a replay buffer's filled part)."""

    def __init__(self, cfgs: list, member_knobs: Sequence[str]):
        self.cfgs, self.knobs = list(cfgs), tuple(member_knobs)
        self.first: dict[int, tuple[int, dict]] = {}  # member -> (step, leaf shapes)
        self.waiting: set[int] = set()  # steps whose members' shapes differ, the knob at fault not yet told

    @contextlib.contextmanager
    def active(self):
        token = _MEMBERS.set(self)
        try:
            yield self
        finally:
            _MEMBERS.reset(token)

    def saw(self, i: int, state: Any, step: int) -> None:
        if i in self.first:
            return
        self.first[i] = (step, leaf_shapes(state))
        # a mismatch that several knobs explain waits for members still to come (they tell which knob follows
        # the shapes); once every member has saved, it is said whatever they told
        for at in sorted({step} | self.waiting):
            peers = [j for j, (a, _) in self.first.items() if a == at]
            sigs, cfgs = [self.first[j][1] for j in peers], [self.cfgs[j] for j in peers]
            if (len(self.first) < len(self.cfgs) and any(s != sigs[0] for s in sigs)
                    and len(_knobs_at_fault(sigs, cfgs, self.knobs)) > 1):
                self.waiting.add(at)
                continue
            self.waiting.discard(at)
            check_signatures(sigs, cfgs, self.knobs)


def leaf_shapes(state: Any) -> dict[str, tuple]:
    """{path: (shape, dtype)} of a state's array leaves (numpy, JAX, torch): what a compiled program's
    shapes are made of. Python scalars are left out: they change no shape."""
    pairs = None
    if "jax" in sys.modules:  # any pytree, a JAX workload's NamedTuples and optax states included
        jax = sys.modules["jax"]
        try:
            pairs = [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]]
        except (TypeError, ValueError):  # a dict whose keys JAX cannot sort (str with int or None), which a
            pass                         # checkpoint takes: walked as plain containers
    if pairs is None:
        pairs = list(_walk(state, ""))
    return {p: (tuple(x.shape), str(x.dtype)) for p, x in pairs if hasattr(x, "shape") and hasattr(x, "dtype")}


def _walk(node: Any, path: str):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, f"{path}[{k!r}]")
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")
    else:
        yield path, node


def check_shapes(states: Sequence, cfgs: Optional[list] = None, member_knobs: Sequence[str] = ()) -> None:
    """Raise a ConfigError when members' states differ in a shape or dtype. ``cfgs``/``member_knobs``
    (default: those of the active :class:`SameShapes`) name the knob whose values split the members as their shapes do."""
    check_signatures([leaf_shapes(s) for s in states], cfgs, member_knobs)


def check_signatures(sigs: list[dict], cfgs: Optional[list] = None, member_knobs: Sequence[str] = ()) -> None:
    """:func:`check_shapes` of states already reduced to their :func:`leaf_shapes`."""
    odd = next((i for i, s in enumerate(sigs) if s != sigs[0]), None)
    if odd is None:
        return
    from raysys.config import ConfigError

    if cfgs is None and _MEMBERS.get() is not None:
        cfgs, member_knobs = _MEMBERS.get().cfgs, _MEMBERS.get().knobs
    knobs = _knobs_at_fault(sigs, cfgs, member_knobs) if cfgs is not None and len(cfgs) == len(sigs) else []
    path = next((p for p in {**sigs[0], **sigs[odd]} if sigs[0].get(p) != sigs[odd].get(p)), "?")
    seen = f"{path or 'state'}: {_fmt(sigs[0].get(path))} vs {_fmt(sigs[odd].get(path))}"
    # what to do first: the console cuts a long line, and a state's path can be long
    if len(knobs) == 1:
        what = f"{knobs[0]} differs between them: remove it from Population.member_knobs"
    else:
        what = (f"one of {', '.join(knobs)} differs between them and changes a shape: remove that one from "
                "Population.member_knobs" if knobs else "remove the knob that changes a shape from Population.member_knobs")
    raise ConfigError(f"members of one program have states of different shapes: {what} (a knob that changes a shape "
                      f"cannot differ inside one program; configurations that differ in it then train as separate "
                      f"programs) [{seen}]")


def _fmt(sig: Optional[tuple]) -> str:
    return "absent" if sig is None else f"{sig[1]}{list(sig[0])}"


def _knobs_at_fault(sigs: list, cfgs: list, member_knobs: Sequence[str]) -> list[str]:
    """The member knobs whose values differ between the members: those constant within each group of one
    shape first (the width that splits them, not the learning rate that also differs), else all."""
    from raysys.config import flatten, to_dict

    values = [flatten(to_dict(c)) for c in cfgs]
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(sigs):
        groups.setdefault(repr(sorted(s.items())), []).append(i)
    differ = [k for k in member_knobs if len({repr(v.get(k)) for v in values}) > 1]
    follow = [k for k in differ if all(len({repr(values[i].get(k)) for i in g}) == 1 for g in groups.values())]
    named = follow or differ
    return [f"{k} ({', '.join(dict.fromkeys(repr(v.get(k)) for v in values))})" for k in named]


def stack(states: Sequence) -> Any:
    """The members' states stacked on a new leading axis (a :class:`Batched` state), after
    :func:`check_shapes`: a shape knob among the member knobs is named, not a broadcasting error."""
    import jax
    import jax.numpy as jnp

    check_shapes(states)
    return jax.tree.map(lambda *xs: jnp.stack(xs), *states)


def time_alone(step: Callable, state: Any, *args, work: float, chunks: int = 2) -> float:
    """A :class:`Batched` member's speed: ``work`` units per chunk over the seconds of one member through
    the lone program ``step(state, *args) -> (state, out)``, on a throwaway state (one warm-up chunk,
    then ``chunks`` timed; compile excluded)."""
    import jax

    state, out = step(state, *args)
    jax.block_until_ready(out)
    t = time.perf_counter()
    for _ in range(chunks):
        state, out = step(state, *args)
    jax.block_until_ready(out)
    return chunks * work / (time.perf_counter() - t)


class Batched:
    """``run(states, todo) -> (states, {member: host output})`` advances every member at once; ``states``
    stacked by :func:`stack`, which refuses members of different shapes."""

    what = "one batched program (train.population=vmap)"

    def __init__(self, states: Any, run: Callable, compile_s: float, alone: float,
                 retune: Optional[Callable[[list], None]] = None):
        self.states, self.run, self.compile_s, self.alone = states, run, compile_s, alone
        self.alone_note = f"; one member alone: {alone:.0f}"
        self._retune = retune
        self._last: Optional[float] = None  # the last chunk's seconds: when a signal's stop will come

    def step(self, todo: np.ndarray) -> dict[int, tuple[Any, float]]:
        """Members with a true ``todo`` entry advance one chunk -> {member: (host output, seconds)}."""
        from raysys import lifecycle

        t = time.perf_counter()
        with lifecycle.uncut(self._last):  # one program: a second signal waits for it (lifecycle.uncut)
            self.states, out = self.run(self.states, todo)
        dt = self._last = time.perf_counter() - t
        return {i: (o, dt) for i, o in out.items()}

    def rate(self, steps: float, seconds: float) -> float:
        return self.alone  # the time is the whole population's

    def state(self, i: int) -> Any:
        import jax

        return jax.tree.map(lambda x: x[i], self.states)

    def put(self, i: int, state: Any) -> None:
        """Member i's state replaced (PBT's exploit: another member's weights)."""
        import jax

        self.states = jax.tree.map(lambda xs, x: xs.at[i].set(x), self.states, state)

    def retune(self, cfgs: list) -> None:
        """The members' shape-free hyper-parameters are now those of ``cfgs`` (PBT's explore)."""
        _retune(self._retune, cfgs)


class InTurn:
    """``run(i, state, todo_i) -> (state, host output)`` advances member i alone."""

    what = "members in turn through one program (train.population=loop)"
    alone_note = ""

    def __init__(self, states: list, run: Callable, compile_s: float, retune: Optional[Callable[[list], None]] = None):
        check_shapes(states)  # the lone program compiled for member 0's shapes runs every member
        self.states, self.run, self.compile_s = list(states), run, compile_s
        self._retune = retune
        self._last: Optional[float] = None  # the last member's chunk seconds: when a signal's stop will come

    def step(self, todo: np.ndarray) -> dict[int, tuple[Any, float]]:
        from raysys import lifecycle

        out = {}
        for i in np.flatnonzero(todo):
            t = time.perf_counter()
            with lifecycle.uncut(self._last):  # one program: a second signal waits for it (lifecycle.uncut)
                self.states[i], o = self.run(i, self.states[i], todo[i])  # o on the host: the member's sync
            out[i] = (o, time.perf_counter() - t)
            self._last = out[i][1]
        return out

    def rate(self, steps: float, seconds: float) -> float:
        return steps / seconds if seconds else 0.0

    def state(self, i: int) -> Any:
        return self.states[i]

    def put(self, i: int, state: Any) -> None:
        """Member i's state replaced (PBT's exploit: another member's weights)."""
        check_shapes([self.states[i], state])
        self.states[i] = _copied(state)  # its own buffers: a program that donates its input frees the other's

    def retune(self, cfgs: list) -> None:
        """The members' shape-free hyper-parameters are now those of ``cfgs`` (PBT's explore)."""
        _retune(self._retune, cfgs)


def _copied(state: Any) -> Any:
    """``state`` with each array leaf copied (numpy, JAX, torch), the rest as it is."""
    def leaf(x):
        if not hasattr(x, "shape"):
            return x
        return x.copy() if hasattr(x, "copy") else x.clone() if hasattr(x, "clone") else x  # a JAX clone is no copy

    if "jax" in sys.modules:
        return sys.modules["jax"].tree.map(leaf, state)
    if isinstance(state, dict):
        return {k: _copied(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)) and not hasattr(state, "_fields"):
        return type(state)(_copied(v) for v in state)
    return leaf(state)


def _retune(fn: Optional[Callable[[list], None]], cfgs: list) -> None:
    if fn is None:  # the workload's code, as it stands: a restart would meet it again
        from raysys.config import ConfigError

        raise ConfigError("this program was built without retune=: it cannot take new hyper-parameters (PBT); "
                          "pass the carrier a retune(cfgs) that rebuilds them")
    fn(cfgs)
