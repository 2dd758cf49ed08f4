"""A JAX workload of your own that sweeps K configurations as one program: an MLP on scikit-learn's digits.

    python -m raysys train digits_jax:WORKLOAD --preset quick
    python -m raysys.tune --space digits_jax_space.yaml --vectorize 4

Training is chunks of Adam steps; a chunk is one jitted ``lax.scan`` over an explicit state pytree.
The learning rate and weight decay are inputs of the compiled chunk (:class:`HParams`), not constants
in it, so configurations that differ only in them and the seed (:data:`MEMBER_KNOBS`) share one
program. ``train_population`` trains K of them through it with one compile, each member with its own
params, Adam state and PRNG stream, logging and checkpointing through its own session as ``train``
does alone: ``vmap``ped over members on a GPU or TPU, one after another on a CPU (``train.population``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np

from raysys.config import require
from raysys.train.config import JaxLaunchConfig
from raysys.train.jax_host import enable_compilation_cache, to_host
from raysys.workload import Population, Workload


@dataclass
class ModelConfig:
    hidden: int = 64
    """Width of the two hidden layers (a shape: members of one program share it)."""

    def validate(self) -> None:
        require(self.hidden >= 1, f"model.hidden must be >= 1, got {self.hidden}")


@dataclass
class TrainConfig:
    steps: int = 2000
    """Adam steps in all."""
    batch_size: int = 64
    """Images per step, drawn with replacement from the training split."""
    steps_per_chunk: int = 100
    """Steps per jitted chunk; metrics, the progress line and checkpoints come between chunks."""
    lr: float = 3e-3
    """Adam's learning rate."""
    weight_decay: float = 1e-4
    """Decoupled weight decay (AdamW)."""
    seed: int = 0
    """Seed of the initial params and of the minibatch draws."""
    test_fraction: float = 0.25
    """Share of the 1,797 images held out for eval/accuracy (split with a fixed seed)."""
    checkpoint_every_minutes: float = 5.0
    """Checkpoint when this much time has passed since the last one, on a stop (Ctrl-C) and at the end:
    an interrupted run or sweep resumes from there."""
    compilation_cache_dir: str = "~/.cache/raysys/jax"
    """Persistent JAX compilation cache ('' disables)."""
    population: Literal["auto", "vmap", "loop"] = "auto"
    """How --vectorize carries the members: one vmapped program, or this program member after member.
    auto: loop on a CPU, vmap on a GPU or TPU."""

    def validate(self) -> None:
        for name in ("steps", "batch_size", "steps_per_chunk"):
            require(getattr(self, name) >= 1, f"train.{name} must be >= 1, got {getattr(self, name)}")
        require(self.lr > 0 and self.weight_decay >= 0, "train.lr must be > 0 and train.weight_decay >= 0")
        require(self.checkpoint_every_minutes > 0, "train.checkpoint_every_minutes must be > 0")
        require(0.05 <= self.test_fraction <= 0.5, f"train.test_fraction must be in [0.05, 0.5], got {self.test_fraction}")


@dataclass
class DigitsJaxConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    launch: JaxLaunchConfig = field(default_factory=JaxLaunchConfig)


def quick() -> DigitsJaxConfig:
    """Seconds: 400 steps."""
    cfg = DigitsJaxConfig()
    cfg.train.steps = 400
    return cfg


# Shape-free: may differ between the members of one program.
MEMBER_KNOBS = ("train.lr", "train.weight_decay", "train.seed", "train.steps", "train.checkpoint_every_minutes",
                "train.compilation_cache_dir")


# ---------------------------------------------------------------- the model, as pure functions


class HParams(NamedTuple):
    lr: float
    weight_decay: float


class State(NamedTuple):
    params: list
    opt_state: tuple
    key: object
    step: object


def load_data(cfg: DigitsJaxConfig):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split((x / 16.0).astype(np.float32), y.astype(np.int32),
                                          test_size=cfg.train.test_fraction, random_state=0, stratify=y)
    return xtr, ytr, xte, yte


def _optimizer(hp: HParams):
    import optax

    return optax.adamw(hp.lr, weight_decay=hp.weight_decay)


def init(cfg: DigitsJaxConfig, key) -> State:
    import jax
    import jax.numpy as jnp

    k_init, key = jax.random.split(key)
    sizes = [64, cfg.model.hidden, cfg.model.hidden, 10]
    params = []
    for k, (n_in, n_out) in zip(jax.random.split(k_init, len(sizes) - 1), zip(sizes, sizes[1:])):
        params.append((jax.random.normal(k, (n_in, n_out)) * jnp.sqrt(2.0 / n_in), jnp.zeros(n_out)))
    opt_state = _optimizer(HParams(1.0, 0.0)).init(params)  # Adam's moments: no hyper-parameter in them
    return State(params, opt_state, key, jnp.int32(0))


def logits(params, x):
    import jax

    for w, b in params[:-1]:
        x = jax.nn.relu(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def make_chunk(cfg: DigitsJaxConfig, data):
    """``chunk(state, hp) -> (state, stats)``: ``steps_per_chunk`` Adam steps, then test accuracy."""
    import jax
    import jax.numpy as jnp
    import optax

    xtr, ytr, xte, yte = (jnp.asarray(a) for a in data)

    def loss_fn(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y).mean()

    def adam_step(carry, _):
        state, hp = carry
        key, k_batch = jax.random.split(state.key)
        idx = jax.random.randint(k_batch, (cfg.train.batch_size,), 0, len(ytr))
        loss, grads = jax.value_and_grad(loss_fn)(state.params, xtr[idx], ytr[idx])
        updates, opt_state = _optimizer(hp).update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return (State(params, opt_state, key, state.step + 1), hp), loss

    def chunk(state: State, hp: HParams):
        (state, _), losses = jax.lax.scan(adam_step, (state, hp), None, cfg.train.steps_per_chunk)
        accuracy = (logits(state.params, xte).argmax(-1) == yte).mean()
        return state, {"loss": losses.mean(), "accuracy": accuracy}

    return chunk


# ---------------------------------------------------------------- raysys's side: one run, or K as one program


def _start(cfg: DigitsJaxConfig, session) -> State:
    """A fresh state, or the session's last checkpoint (the run continues bit-exact)."""
    import jax

    fresh = init(cfg, jax.random.PRNGKey(cfg.train.seed))
    ckpt = session.restore()
    if ckpt is None:
        return fresh
    leaves, tree = jax.tree.flatten(fresh)
    state = jax.tree.unflatten(tree, [np.asarray(t, x.dtype) for t, x in zip(ckpt["state"], leaves)])
    session.message(f"resumed at step {int(state.step)}")
    was = ckpt.get("seed")  # a resume with another train.seed: the restored key would otherwise ignore it
    if was is not None and int(was) != cfg.train.seed:
        state = state._replace(key=jax.random.fold_in(jax.random.PRNGKey(cfg.train.seed), int(state.step)))
        session.message(f"train.seed {int(was)} -> {cfg.train.seed}: the minibatches' random stream starts from "
                        "the new seed here; params and optimizer state go on")
    return state


def _save(session, state: State, seed: int) -> None:
    import jax

    leaves = [np.array(x) for x in jax.tree.leaves(to_host(state))]  # numpy: saved without torch
    session.checkpoint({"state": leaves, "seed": seed}, int(state.step))  # the seed: a resume may change it


def _metrics(stats: dict, samples_per_s: float) -> dict:
    return {"losses/train_loss": float(stats["loss"]), "eval/accuracy": float(stats["accuracy"]),
            "perf/samples_per_s": samples_per_s}


def train(cfg: DigitsJaxConfig, session) -> dict:
    enable_compilation_cache(cfg.train.compilation_cache_dir)
    import jax

    state = _start(cfg, session)
    hp = HParams(cfg.train.lr, cfg.train.weight_decay)
    step = jax.jit(make_chunk(cfg, load_data(cfg))).lower(state, hp).compile()
    per_chunk, final, saved = cfg.train.steps_per_chunk * cfg.train.batch_size, {}, time.monotonic()
    while int(state.step) < cfg.train.steps and not session.should_stop():
        t = time.perf_counter()
        state, stats = step(state, hp)
        final = _metrics(to_host(stats), per_chunk / (time.perf_counter() - t))
        session.log(final, int(state.step), progress=f"accuracy {final['eval/accuracy']:.3f}",
                    bar=(int(state.step), cfg.train.steps))
        if time.monotonic() - saved >= 60 * cfg.train.checkpoint_every_minutes:
            _save(session, state, cfg.train.seed)
            saved = time.monotonic()
    _save(session, state, cfg.train.seed)
    return final


def train_population(cfgs: list[DigitsJaxConfig], sessions: list) -> list[dict]:
    """K configurations of one shape: each member trains, logs and checkpoints as ``train`` would alone,
    and stops at its own ``train.steps``, or once the sweep halts it (unstable) or the run is stopped."""
    enable_compilation_cache(cfgs[0].train.compilation_cache_dir)
    from raysys.train.population import population_mode

    lead, k = cfgs[0], len(cfgs)
    states = [_start(c, s) for c, s in zip(cfgs, sessions)]
    hps = [HParams(c.train.lr, c.train.weight_decay) for c in cfgs]
    chunk = make_chunk(lead, load_data(lead))
    per_chunk = lead.train.steps_per_chunk * lead.train.batch_size
    carrier = _in_turn if population_mode(lead.train.population) == "loop" else _batched
    program = carrier(chunk, states, hps, per_chunk)
    finals, steps, saved = [{} for _ in cfgs], [int(s.step) for s in states], time.monotonic()
    while (live := np.array([steps[i] < cfgs[i].train.steps and not sessions[i].halted for i in range(k)])).any():
        for i, (stats, seconds) in program.step(live).items():
            steps[i] += lead.train.steps_per_chunk
            finals[i] = _metrics(stats, program.rate(per_chunk, seconds))
            sessions[i].log(finals[i], steps[i])
        if sessions[0].should_stop():
            break
        if time.monotonic() - saved >= 60 * lead.train.checkpoint_every_minutes:
            for i in np.flatnonzero(live):
                _save(sessions[i], program.state(i), cfgs[i].train.seed)
            saved = time.monotonic()
    for i in range(k):
        _save(sessions[i], program.state(i), cfgs[i].train.seed)
    return finals


def _in_turn(chunk, states: list, hps: list, per_chunk: int):
    """The lone run's program, member after member: one compile, each member timed on its own."""
    import jax

    from raysys.train.population import InTurn

    t = time.perf_counter()
    step = jax.jit(chunk).lower(states[0], hps[0]).compile()

    def run(i, state, _):
        state, stats = step(state, hps[i])
        return state, to_host(stats)

    return InTurn(states, run, time.perf_counter() - t)


def _batched(chunk, states: list, hps: list, per_chunk: int):
    """One ``vmap``ped program; a masked member keeps its state. A member's speed is the lone program's,
    timed on a throwaway copy of member 0 (the population's time is everyone's)."""
    import jax
    import jax.numpy as jnp

    from raysys.train.population import Batched, stack, time_alone

    def batched(states, hps, live):
        new, stats = jax.vmap(chunk)(states, hps)
        keep = lambda a, b: jnp.where(live.reshape(live.shape + (1,) * (a.ndim - 1)), a, b)  # noqa: E731
        return jax.tree.map(keep, new, states), stats

    stacked = stack(states)  # refuses members of different shapes, naming the knob
    hp_stack = HParams(*(jnp.asarray(v, jnp.float32) for v in zip(*hps)))
    t = time.perf_counter()
    step = jax.jit(batched).lower(stacked, hp_stack, np.ones(len(states), bool)).compile()
    compile_s = time.perf_counter() - t
    alone = time_alone(jax.jit(chunk).lower(states[0], hps[0]).compile(), states[0], hps[0], work=per_chunk)

    def run(states, live):
        states, stats = step(states, hp_stack, live)
        stats = to_host(stats)
        return states, {i: {key: v[i] for key, v in stats.items()} for i in np.flatnonzero(live)}

    return Batched(stacked, run, compile_s, alone)


WORKLOAD = Workload(
    name="digits_jax",
    description="JAX MLP on scikit-learn's 8x8 digits; --vectorize trains K configurations as one program",
    config_cls=DigitsJaxConfig,
    presets={"default": DigitsJaxConfig, "quick": quick},
    train_fn=train,
    population=Population(train_population, MEMBER_KNOBS),
    quality_metric="eval/accuracy",
    extra={"identity_sections": ("model",)},
)
