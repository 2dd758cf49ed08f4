"""A tiny workload with its own loop (``train_fn=``) and a population, in numpy alone, for tests that
need a real run in a second: least squares by gradient descent on a fixed random problem, whose
weight vector has ``model.width`` entries (a shape). Members of a population train in turn, each
from its own config, checkpointing through its own session."""

import dataclasses
import os
import signal
import time
from dataclasses import dataclass, field

import numpy as np

from raysys.train.config import LaunchConfig
from raysys.workload import Population, Workload


@dataclass
class ModelConfig:
    width: int = 4
    """Entries of the weight vector (changes an array's shape)."""


@dataclass
class OptConfig:
    lr: float = 0.1
    """Gradient descent's step size."""


@dataclass
class TrainConfig:
    steps: int = 10
    """Gradient steps in all."""
    checkpoint_every: int = 5
    """Checkpoint every this many steps."""
    omit_quality: bool = False
    """Leave eval/quality (the workload's quality metric) out of what is reported."""
    number: str = "float"
    """What the metrics are: float, numpy (np.float32), jax (0-d arrays) or str (a mistake)."""
    nan_after: int = 0
    """From this step on the loss is NaN (0: never)."""
    signal_at: int = 0
    """At this step the process sends itself SIGINT, as Ctrl-C would (0: never)."""
    signal_pid: int = 0
    """The process signal_at signals: the driver's, from a Ray worker (0: this process)."""
    signal_again_at: int = 0
    """At this step the process sends itself SIGTERM, a second stop request (0: never)."""
    ask_stop: bool = True
    """Ask session.should_stop() at each step boundary (False: the loop runs to its end regardless)."""
    end_checkpoint: bool = False
    """Also checkpoint after the loop, whatever it trained (as loops that save their end state do)."""


@dataclass
class TinyConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    opt: OptConfig = field(default_factory=OptConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    launch: LaunchConfig = field(default_factory=lambda: LaunchConfig(workers=0))


def _member(cfg: TinyConfig, session) -> dict:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, cfg.model.width))
    y = x @ np.linspace(-1.0, 1.0, cfg.model.width)
    state = session.restore() or {"w": np.zeros(cfg.model.width), "step": 0}
    w, step, final = np.asarray(state["w"]), int(state["step"]), {}
    tc = cfg.train
    while step < tc.steps and not (tc.ask_stop and session.should_stop()):
        w = w - cfg.opt.lr * 2 * x.T @ (x @ w - y) / len(y)
        step += 1
        loss = float(np.mean((x @ w - y) ** 2))
        final = {"train/loss": float("nan") if 0 < tc.nan_after <= step else loss, "perf/samples_per_s": 1.0}
        if not tc.omit_quality:
            final["eval/quality"] = -loss
        final = {k: _as(tc.number, v) for k, v in final.items()}
        session.log(final, step)
        if step == tc.signal_at:
            os.kill(tc.signal_pid or os.getpid(), signal.SIGINT)
            while not tc.ask_stop and session._stop() is None:  # until the request reached this run, unasked
                time.sleep(0.05)
        if step == tc.signal_again_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if step % cfg.train.checkpoint_every == 0:
            session.checkpoint({"w": w, "step": step}, step)
    if tc.end_checkpoint:
        session.checkpoint({"w": w, "step": step}, step)
    return final


def _as(kind: str, v: float):
    if kind == "numpy":
        return np.float32(v)
    if kind == "jax":
        import jax.numpy as jnp

        return jnp.asarray(v)
    return str(v) if kind == "str" else v


def train(cfg: TinyConfig, session) -> dict:
    return _member(cfg, session)


def train_population(cfgs: list, sessions: list) -> list:
    return [_member(c, s) for c, s in zip(cfgs, sessions)]


WORKLOAD = Workload(name="tiny", description="least squares in numpy (tests)", config_cls=TinyConfig,
                    presets={"default": TinyConfig}, train_fn=train, quality_metric="eval/quality",
                    population=Population(train_population, ("opt.lr",)))

# The same, its quality metric left to raysys's default (it declares none).
UNDECLARED = dataclasses.replace(WORKLOAD, name="tiny_undeclared", quality_metric=None)

# The same loop on Ray Train workers (each its own process; rank 0 logs and checkpoints).
DISTRIBUTED = dataclasses.replace(WORKLOAD, name="tiny_distributed", extra={"distributed": "torch"})

# A population that wrongly declares a shape knob as a member knob.
WIDTH_AS_MEMBER = dataclasses.replace(WORKLOAD, name="tiny_width",
                                      population=Population(train_population, ("opt.lr", "model.width")))

# A member knob that is no key of the config.
TYPO = dataclasses.replace(WORKLOAD, name="tiny_typo", population=Population(train_population, ("opt.lr", "opt.lrr")))


def train_pbt_population(cfgs: list, sessions: list) -> list:
    """The members in turn through raysys's ``InTurn`` carrier, one gradient step a chunk, with the PBT
    rounds of a sweep that runs them (raysys/train/pbt.py); the weights are logged (``w/<j>``) so a test
    can follow what a member took from another."""
    from raysys.train import pbt as rounds
    from raysys.train.population import InTurn

    width = cfgs[0].model.width
    x = np.random.default_rng(0).normal(size=(32, width))
    y = x @ np.linspace(-1.0, 1.0, width)
    pbt = rounds.of(sessions)
    states = [s.restore() or {"w": np.zeros(width), "step": 0} for s in sessions]
    cfgs = pbt.resume(cfgs) if pbt is not None else list(cfgs)
    lrs = [c.opt.lr for c in cfgs]

    def run(i, state, _):
        w = state["w"] - lrs[i] * 2 * x.T @ (x @ state["w"] - y) / len(y)
        return {"w": w, "step": state["step"] + 1}, float(np.mean((x @ w - y) ** 2))

    def retune(new):
        lrs[:] = [c.opt.lr for c in new]

    program, finals = InTurn(states, run, 0.0, retune), [{} for _ in cfgs]
    while True:
        live = np.array([program.states[i]["step"] < c.train.steps and not s.halted
                         for i, (c, s) in enumerate(zip(cfgs, sessions))])
        if not live.any() or sessions[0].should_stop():
            break
        for i, (loss, _) in program.step(live).items():
            step = program.states[i]["step"]
            finals[i] = {"train/loss": loss, "eval/quality": -loss, "perf/samples_per_s": 1.0}
            sessions[i].log({**finals[i], **{f"w/{j}": float(v) for j, v in enumerate(program.states[i]["w"])}}, step)
            if step % cfgs[i].train.checkpoint_every == 0:
                sessions[i].checkpoint(program.states[i], step)
        if pbt is not None:
            pbt.after_chunk(program, cfgs, [i for i in np.flatnonzero(live) if program.states[i]["step"] < cfgs[i].train.steps],
                            inherit=lambda mine, theirs: {"w": theirs["w"], "step": mine["step"]})
    for i, s in enumerate(sessions):
        s.checkpoint(program.states[i], program.states[i]["step"])
    return finals


# Members through the InTurn carrier, PBT may perturb the learning rate.
PBT = dataclasses.replace(WORKLOAD, name="tiny_pbt", population=Population(train_pbt_population, ("opt.lr",), ("opt.lr",)))
