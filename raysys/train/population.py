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
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np


def population_mode(setting: str) -> str:
    """A ``train.population`` setting with ``auto`` resolved for the devices JAX sees."""
    if setting != "auto":
        return setting
    import jax

    return "loop" if jax.devices()[0].platform == "cpu" else "vmap"


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
    """``run(states, todo) -> (states, {member: host output})`` advances every member at once."""

    what = "one batched program (train.population=vmap)"

    def __init__(self, states: Any, run: Callable, compile_s: float, alone: float):
        self.states, self.run, self.compile_s, self.alone = states, run, compile_s, alone
        self.alone_note = f"; one member alone: {alone:.0f}"

    def step(self, todo: np.ndarray) -> dict[int, tuple[Any, float]]:
        """Members with a true ``todo`` entry advance one chunk -> {member: (host output, seconds)}."""
        t = time.perf_counter()
        self.states, out = self.run(self.states, todo)
        dt = time.perf_counter() - t
        return {i: (o, dt) for i, o in out.items()}

    def rate(self, steps: float, seconds: float) -> float:
        return self.alone  # the time is the whole population's

    def state(self, i: int) -> Any:
        import jax

        return jax.tree.map(lambda x: x[i], self.states)


class InTurn:
    """``run(i, state, todo_i) -> (state, host output)`` advances member i alone."""

    what = "members in turn through one program (train.population=loop)"
    alone_note = ""

    def __init__(self, states: list, run: Callable, compile_s: float):
        self.states, self.run, self.compile_s = list(states), run, compile_s

    def step(self, todo: np.ndarray) -> dict[int, tuple[Any, float]]:
        out = {}
        for i in np.flatnonzero(todo):
            t = time.perf_counter()
            self.states[i], o = self.run(i, self.states[i], todo[i])  # o on the host: the member's sync
            out[i] = (o, time.perf_counter() - t)
        return out

    def rate(self, steps: float, seconds: float) -> float:
        return steps / seconds if seconds else 0.0

    def state(self, i: int) -> Any:
        return self.states[i]
