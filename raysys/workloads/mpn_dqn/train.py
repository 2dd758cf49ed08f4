"""The MPN-DQN learner: collect, replay sequences, double-DQN updates. One flat loop (CleanRL style).

Each iteration collects ``steps_per_call`` vector steps (in this process, or from Ray rollout
actors while the learner trains on the previous batch), stores them in the sequence replay, and
runs the gradient updates those transitions pay for (one per ``train_freq`` transitions, as the
seed's ``--train-freq``). Tracking, checkpoints and Ray come from the shared layer: the
:class:`raysys.session.Session` and :mod:`raysys.rl.rollout`.
"""

from __future__ import annotations

import copy
import functools
import math
import time
from collections import deque
from typing import Any, Callable, Optional

import numpy as np
import torch

from raysys.config import ConfigError
from raysys.metrics import StabilityMonitor
from raysys.rl import env_state
from raysys.workloads.mpn_dqn.env import env_spaces, make_env
from raysys.workloads.mpn_dqn.loss import td_loss_naive, td_loss_optimized
from raysys.workloads.mpn_dqn.model import MPNDQN
from raysys.workloads.mpn_dqn.replay import SequenceReplay, as_tensors
from raysys.workloads.mpn_dqn.workload import MPNDQNConfig

SYNCS_PER_RUN = 50  # target syncs when target_sync_every=0 (auto)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name} but CUDA is not available on this machine")
    return dev


def all_sum(values: list[float], world: int, device: torch.device) -> list[float]:
    """Sum small per-rank counters over the data-parallel learners (identity for one learner)."""
    if world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return t.tolist()


def average_gradients(params: list[torch.nn.Parameter], world: int) -> None:
    """Data-parallel learners: one all-reduce of every gradient, flattened, then the mean."""
    if world == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat)
    flat /= world
    torch.nn.utils.vector_to_parameters(flat, grads)  # copies the slices back into each grad


def policy_factory(cfg: MPNDQNConfig):
    """A picklable constructor of the Q-network, for rollout actors."""
    obs_dim, n_actions = env_spaces(cfg.task, **cfg.task_kwargs)
    return functools.partial(MPNDQN, obs_dim, n_actions, cfg.hidden, cfg.eta, cfg.lam, cfg.freeze_plasticity)


def env_factory(cfg: MPNDQNConfig):
    return functools.partial(make_env, cfg.task, cfg.max_episode_steps, **cfg.task_kwargs)


def epsilon_at(cfg: MPNDQNConfig, episodes: int) -> float:
    """Linear decay over the first ``epsilon_fraction`` of the episodes, then constant."""
    frac = min(1.0, episodes / max(1.0, cfg.epsilon_fraction * cfg.num_episodes))
    return cfg.epsilon_start + frac * (cfg.epsilon_end - cfg.epsilon_start)


def sync_period(cfg: MPNDQNConfig, world: int = 1) -> int:
    if cfg.target_sync_every > 0:
        return cfg.target_sync_every
    # each update consumes train_freq transitions of every data-parallel learner
    updates = (cfg.num_episodes * cfg.max_episode_steps - cfg.learning_starts * world) / (cfg.train_freq * world)
    return max(1, int(updates // SYNCS_PER_RUN))


class Collector:
    """Rollouts in this process (``num_actors=0``) or from a Ray :class:`RolloutPool`; the same
    worker class either way. ``start`` begins a sample, ``finish`` returns its per-actor batches."""

    def __init__(self, cfg: MPNDQNConfig, rank: int = 0):
        from raysys.rl.rollout import RolloutPool, RolloutWorker

        # each data-parallel learner steps its own envs, on its own seeds
        kw = dict(envs_per_actor=cfg.envs_per_actor, vector_mode=cfg.vector_mode,
                  state_dtype="float16" if cfg.stored_state else None, seed=cfg.seed + 1_000_003 * rank)
        self.steps = cfg.steps_per_call
        if cfg.num_actors == 0:
            threads = torch.get_num_threads()  # the worker pins 1 thread for its tiny batches...
            self.pool, self.worker = None, RolloutWorker(env_factory(cfg), policy_factory(cfg), **kw)
            torch.set_num_threads(threads)  # ...which must not throttle the learner sharing this process
        else:
            from raysys.train.runtime import init_ray

            init_ray(cfg.launch.address)
            self.worker = None
            self.pool = RolloutPool(env_factory(cfg), policy_factory(cfg), num_actors=cfg.num_actors,
                                    steps_per_call=cfg.steps_per_call, **kw)
        self._pending = None

    @property
    def restarts(self) -> int:
        return self.pool.num_restarts if self.pool else 0

    def set_weights(self, model: torch.nn.Module | dict) -> None:
        sd = model if isinstance(model, dict) else model.state_dict()
        sd = {k: v.detach().cpu() for k, v in sd.items()}
        if self.pool:
            self.pool.set_weights(sd)
        else:
            self.worker.set_weights({k: v.numpy() for k, v in sd.items()})

    def start(self, epsilon: float) -> None:
        if self.pool:  # actors step their envs while the learner trains
            self._pending = self.pool.sample_async(self.steps, epsilon)
        else:
            self._pending = lambda: [self.worker.sample(self.steps, epsilon)]

    def finish(self) -> list[dict]:
        out, self._pending = self._pending(), None
        return out

    def get_state(self) -> list[dict]:
        """The rollout workers' state (envs mid-episode, recurrent state, generators); idle only."""
        return self.pool.get_state() if self.pool else [self.worker.get_state()]

    def set_state(self, states: list[dict]) -> None:
        if self.pool:
            self.pool.set_state(states)
        elif len(states) != 1:
            raise env_state.EnvStateMismatch(f"saved {len(states)} rollout actors, this run has none")
        else:
            self.worker.set_state(states[0])

    def close(self) -> None:
        if self.pool:
            self.pool.shutdown()
        else:
            self.worker.close()


@torch.no_grad()
def evaluate(model: MPNDQN, cfg: MPNDQNConfig, trials: int, epsilon: float = 0.0, seed: int = 12345,
             stop: Optional[Callable[[], bool]] = None) -> Optional[dict]:
    """Reward per NeuroGym trial of the ε-greedy policy (ε=0: greedy; ε=1: uniformly random) on
    fresh episodes of the task, on CPU. A trial ends where the env's info says ``new_trial`` (correct as
    NeuroGym's ``performance`` says, else if that step's reward is positive); in an env that never says it
    (any other gymnasium task) a trial is an episode, correct if its return is positive, and so is an
    episode cut (by ``max_episode_steps``) before any trial of it ended: else a limit shorter than one trial
    never ends. None where ``stop()`` turned true (checked between episodes)."""
    model = copy.deepcopy(model).cpu()
    env = make_env(cfg.task, cfg.max_episode_steps, **cfg.task_kwargs)
    gen = torch.Generator().manual_seed(seed)
    total, done_trials, correct, episode = 0.0, 0, 0, 0
    while done_trials < trials:
        if stop is not None and stop():
            env.close()
            return None
        obs, _ = env.reset(seed=seed + episode)
        episode += 1
        episode_return = 0.0
        M, start = model.init_state(1, "cpu"), torch.ones(1, dtype=torch.bool)
        trials_before = done_trials
        while done_trials < trials:
            a, M = model.act(torch.as_tensor(obs, dtype=torch.float32)[None], M, start, epsilon, gen)
            start = torch.zeros(1, dtype=torch.bool)
            obs, r, term, trunc, info = env.step(int(a))
            total += float(r)
            episode_return += float(r)
            if "new_trial" in info:
                if info["new_trial"]:
                    done_trials += 1
                    # NeuroGym's own verdict on the trial: a withheld no-go (GoNogo) is right at reward 0
                    correct += float(info.get("performance", float(r) > 0))
            if (term or trunc) and done_trials == trials_before:  # no trial ended in it: the episode is one
                done_trials += 1
                correct += episode_return > 0
            if term or trunc:
                break
    env.close()
    return {"reward_per_trial": total / max(done_trials, 1), "correct_rate": correct / max(done_trials, 1)}


def train(cfg: MPNDQNConfig, session) -> dict:
    device = resolve_device(cfg.device)
    if cfg.learner_threads:
        torch.set_num_threads(cfg.learner_threads)
    if cfg.precision == "fp16" and device.type != "cuda":
        raise ConfigError("precision=fp16 needs a CUDA device (use bf16 on CPU)")
    rank, world = getattr(session, "rank", 0), getattr(session, "world_size", 1)
    torch.manual_seed(cfg.seed)  # the same initial weights on every learner
    rng = np.random.default_rng([cfg.seed, rank])
    build = policy_factory(cfg)
    online, target = build().to(device), build().to(device)
    target.load_state_dict(online.state_dict())
    target.requires_grad_(False)
    params = list(online.parameters())
    if cfg.cuda_graph and device.type != "cuda":
        raise ConfigError(f"cuda_graph needs a CUDA learner; this one is on {device}")
    opt = torch.optim.Adam(params, lr=cfg.lr, capturable=cfg.cuda_graph)
    amp = {"fp32": False, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.precision]
    scaler = torch.amp.GradScaler("cuda", enabled=cfg.precision == "fp16")
    state_shape = (cfg.hidden, build.args[0]) if cfg.stored_state else None
    replay = SequenceReplay(build.args[0], cfg.buffer_capacity, n_envs=cfg.num_envs, state_shape=state_shape)
    if replay.state is not None:  # said once: checkpoints carry the buffer, so they grow with it
        session.message(f"stored_state: the replay buffer keeps each step's recurrent state ({replay.state.nbytes / 2**20:.0f} MB "
                        "when full), and every checkpoint holds the buffer's filled part")

    # Everything a resumed run needs to continue exactly where it stopped.
    c = {"episodes": 0, "env_steps": 0, "updates": 0, "episode_id_base": 0, "pending": 0}
    returns: list[float] = []
    losses, grad_norms = [], []
    monitor = StabilityMonitor()
    ckpt = session.restore()
    if ckpt is not None:
        online.load_state_dict(ckpt["online"]), target.load_state_dict(ckpt["target"])
        opt.load_state_dict(ckpt["optim"])
        c.update(ckpt["counters"])
        returns = list(ckpt["returns"])
        monitor.load_state_dict(ckpt["stability"])
        _load_replay(replay, ckpt["replay"])
        if "rng" in ckpt:  # (checkpoints of earlier versions reseed)
            rng.bit_generator.state = ckpt["rng"]
            torch.set_rng_state(ckpt["torch_rng"])
            losses, grad_norms = list(ckpt["pending_losses"]), list(ckpt["pending_grad_norms"])
        else:
            rng = np.random.default_rng([cfg.seed, rank, c["updates"]])
        session.message(f"resumed at episode {c['episodes']} ({c['env_steps']} env steps, {c['updates']} updates)")

    graphed = None
    if cfg.cuda_graph:  # after the restore: the capture records the restored tensors
        from raysys.workloads.mpn_dqn.graphed import GraphedUpdate

        graphed = GraphedUpdate(online, target, opt, cfg.gamma, cfg.max_grad_norm, amp or None)
    every = sync_period(cfg, world)
    collector = Collector(cfg, rank)
    sampler = _restore_rollout(collector, ckpt, world, session)
    if sampler is None:  # fresh envs: number their episodes past every stored id
        c["episode_id_base"] = c.get("episode_id_max", -1) + 1 if ckpt is not None else 0
    collector.set_weights(sampler["weights"] if sampler else online)
    window = deque(returns[-cfg.avg_window:], maxlen=cfg.avg_window)
    best_avg = max((np.mean(returns[max(0, i - cfg.avg_window + 1): i + 1]) for i in range(len(returns))), default=-math.inf)
    t_start, steps_at_start, updates_at_start = time.perf_counter(), c["env_steps"], c["updates"]
    t_log, steps_at_log, updates_at_log = t_start, c["env_steps"], c["updates"]
    next_log = (c["episodes"] // cfg.print_freq + 1) * cfg.print_freq
    next_ckpt = (c["episodes"] // cfg.checkpoint_freq + 1) * cfg.checkpoint_freq

    def out_of_time() -> bool:
        return cfg.max_seconds is not None and time.perf_counter() - t_start >= cfg.max_seconds

    done = c["episodes"] >= cfg.num_episodes
    if done and ckpt is not None:
        collector.close()
        # its end checkpoint is marked ended once the final metrics are recorded: not yet, it was stopped or
        # killed in its final evaluation
        if "final" in c and not session.store.ended(session.store.latest()):
            session.message("its training had ended; its final evaluation had not: evaluating now")
            return _final_evaluation(online, cfg, dict(c["final"]), c, session, rank)
        return {}  # resumed after its end: nothing to train, and what it recorded stays
    signalled = 0.0
    rollout = None  # the rollout side of the next checkpoint, taken while the actors are idle
    if not done:
        collector.start(sampler["epsilon"] if sampler else epsilon_at(cfg, c["episodes"]))
    try:
        while not done:
            batches = collector.finish()
            new = _ingest(replay, batches, c, world)
            finished = [float(r) for b in batches for r in b["episode_returns"]]
            for ret in finished:
                returns.append(ret), window.append(ret)
                best_avg = max(best_avg, float(np.mean(window)))
            # episodes count over all learners' envs; any learner out of time stops them all
            # a SIGINT/SIGTERM of the run stops every learner at this boundary, with a checkpoint
            new_episodes, stop, signalled = all_sum([len(finished), float(out_of_time()), float(session.should_stop())],
                                                    world, device)
            c["episodes"] += int(new_episodes)
            done = c["episodes"] >= cfg.num_episodes or stop > 0 or signalled > 0
            if (done or c["episodes"] >= next_ckpt) and world == 1:
                # the next sample (in flight while the learner trains) starts from here, with
                # these weights: a resumed run redoes exactly that sample
                rollout = {"workers": collector.get_state(), "epsilon": epsilon_at(cfg, c["episodes"]),
                           "weights": {k: v.detach().cpu().clone() for k, v in online.state_dict().items()}}
            if not done:
                collector.set_weights(online)  # actors are idle now: cheap, and next sample uses it
                collector.start(epsilon_at(cfg, c["episodes"]))

            # the updates these transitions pay for (train_freq transitions each)
            c["pending"] = c["pending"] + new if len(replay) >= cfg.learning_starts else 0
            n_updates, c["pending"] = divmod(c["pending"], cfg.train_freq)
            for _ in range(n_updates):
                batch = as_tensors(replay.sample(cfg.sequence_batch_size, cfg.sequence_length, rng, cfg.burn_in), device)
                if not cfg.stored_state:
                    batch.pop("M0", None)
                if graphed is not None:
                    loss, gn = graphed(batch)
                else:
                    if cfg.path == "naive":
                        loss = td_loss_naive(online, target, batch, cfg.gamma)
                    else:
                        loss = td_loss_optimized(online, target, batch, cfg.gamma, amp=amp, compile=cfg.compile)
                    opt.zero_grad(set_to_none=True)
                    scaler.scale(loss).backward()
                    average_gradients(params, world)
                    scaler.unscale_(opt)
                    gn = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                    scaler.step(opt)
                    scaler.update()
                c["updates"] += 1
                losses.append(loss.detach()), grad_norms.append(gn.detach())  # no .item(): avoid a sync per update
                if c["updates"] % every == 0:
                    _sync_target(online, target, cfg.target_tau)

            # (a signal's stop writes no extra line: its losses wait in the checkpoint for the
            # next regular line, so a resumed run logs exactly what an uninterrupted one does)
            if c["episodes"] >= next_log or (done and not signalled):
                now = time.perf_counter()
                m = {
                    "charts/episode_reward": returns[-1] if returns else 0.0,
                    "charts/avg_reward": float(np.mean(window)) if window else 0.0,
                    "charts/best_avg_reward": best_avg if best_avg > -math.inf else 0.0,
                    "charts/epsilon": epsilon_at(cfg, c["episodes"]),
                    "charts/episodes": c["episodes"],
                    "charts/actor_restarts": collector.restarts,
                    "perf/env_steps_per_s": (c["env_steps"] - steps_at_log) / max(now - t_log, 1e-9),
                    "perf/updates_per_s": (c["updates"] - updates_at_log) / max(now - t_log, 1e-9),
                }
                if losses:
                    # one host sync per log line, not per update
                    ls, gns = torch.stack(losses).float(), torch.stack(grad_norms).float()
                    m["losses/td_loss"] = float(ls.mean())
                    m["losses/grad_norm"], m["losses/grad_norm_max"] = float(gns.mean()), float(gns.max())
                    # TD losses are noisy per update: judge spikes on the per-log-line mean
                    # and count every non-finite update loss (observe counts a non-finite mean once)
                    monitor.observe(m["losses/td_loss"], None)
                    monitor.observe_grad_norms(gns.tolist())  # stability/grad_norm_* of updates, not of line maxima
                    bad = int((~torch.isfinite(ls)).sum())
                    monitor.nonfinite_loss += bad - (bad > 0)
                    m |= monitor.metrics()
                losses, grad_norms = [], []
                session.log(m, c["env_steps"], progress=(
                    f"avg reward {m['charts/avg_reward']:.2f} | eps {m['charts/epsilon']:.2f} | "
                    f"{m['perf/env_steps_per_s']:.0f} env-steps/s | {m['perf/updates_per_s']:.1f} updates/s"),
                    bar=(min(c["episodes"], cfg.num_episodes), cfg.num_episodes), unit="episode")
                t_log, steps_at_log, updates_at_log = now, c["env_steps"], c["updates"]
                next_log = (c["episodes"] // cfg.print_freq + 1) * cfg.print_freq
            if c["episodes"] >= next_ckpt and not done:  # the end of the run is saved below
                session.checkpoint(_state(online, target, opt, c, returns, replay, monitor, rng, rollout,
                                          losses, grad_norms), c["env_steps"])
                next_ckpt = (c["episodes"] // cfg.checkpoint_freq + 1) * cfg.checkpoint_freq
    finally:
        collector.close()
    wall = time.perf_counter() - t_start
    if world > 1:
        _check_in_step(online, session, rank, world, device)
    if signalled > 0:
        session.checkpoint(_state(online, target, opt, c, returns, replay, monitor, rng, rollout, losses, grad_norms),
                           c["env_steps"])
        session.message(f"stopped at {c['episodes']}/{cfg.num_episodes} episodes; checkpoint saved")
        return {"charts/episodes": c["episodes"]}

    tail = returns[-cfg.avg_window:]
    final = {
        "charts/final_avg_reward": float(np.mean(tail)) if tail else 0.0,
        "charts/best_avg_reward": best_avg if best_avg > -math.inf else 0.0,
        "charts/episodes": c["episodes"],
        "charts/actor_restarts": collector.restarts,
        "perf/env_steps_per_s": (c["env_steps"] - steps_at_start) / max(wall, 1e-9),
        "perf/updates_per_s": (c["updates"] - updates_at_start) / max(wall, 1e-9),
        "perf/train_seconds": wall,
        "perf/env_steps": c["env_steps"],
        "perf/updates": c["updates"],
        "perf/env_steps_this_session": c["env_steps"] - steps_at_start,
        "perf/updates_this_session": c["updates"] - updates_at_start,
        **monitor.metrics(),
    }
    if c["updates"] == 0:
        session.message(f"no update ran: the replay never held learning_starts ({cfg.learning_starts}) transitions "
                        f"({c['env_steps']} env steps in all); the policy is untrained")
    # the training's measures kept with its end: a run stopped or killed in the evaluation below resumes into it
    c["final"] = {k: float(v) for k, v in final.items()}  # plain floats: torch's weights-only loader takes no numpy
    session.checkpoint(_state(online, target, opt, c, returns, replay, monitor, rng, rollout, losses, grad_norms),
                       c["env_steps"])
    return _final_evaluation(online, cfg, final, c, session, rank)


def _final_evaluation(online: MPNDQN, cfg: MPNDQNConfig, final: dict, c: dict, session: Any, rank: int) -> dict:
    """The greedy and the random policy on fresh trials, and the run's final metrics logged; a stop asked
    meanwhile leaves the run to resume into this (its end checkpoint holds ``final``)."""
    if cfg.eval_trials and rank == 0:
        greedy = evaluate(online, cfg, cfg.eval_trials, epsilon=0.0, stop=session.should_stop)
        rand = greedy and evaluate(online, cfg, cfg.eval_trials, epsilon=1.0, stop=session.should_stop)
        if rand is None:
            session.message(f"stopped in the final evaluation, after {c['episodes']} episodes; checkpoint saved: "
                            "the resume evaluates")
            return {"charts/episodes": c["episodes"]}
        final |= {"eval/reward_per_trial": greedy["reward_per_trial"], "eval/correct_rate": greedy["correct_rate"],
                  "eval/random_reward_per_trial": rand["reward_per_trial"], "eval/quality": greedy["reward_per_trial"]}
    else:
        final["eval/quality"] = final["charts/final_avg_reward"]
        session.message("eval_trials=0: eval/quality is the training reward per episode, not the greedy reward per trial")
    session.log(final, c["env_steps"])
    session.message(f"done: {c['episodes']} episodes | final avg reward {final['charts/final_avg_reward']:.2f} | "
                    f"eval reward/trial {final.get('eval/reward_per_trial', float('nan')):.3f} "
                    f"(random {final.get('eval/random_reward_per_trial', float('nan')):.3f})")
    return final


def _ingest(replay: SequenceReplay, batches: list[dict], c: dict, world: int = 1) -> int:
    """Store one sample (per-actor [T, N] arrays joined along the env axis); returns this learner's
    transitions. ``env_steps`` counts all learners' (they step the same number of envs)."""
    from raysys.rl.rollout import concat_actor_batches

    b = concat_actor_batches(batches) if len(batches) > 1 else batches[0]
    # "done" for the bootstrap cut is `terminated` (TimeLimit truncation is not the task's end)
    replay.extend(b["obs"], b["action"], b["reward"], b["next_obs"], b["terminated"].astype(np.float32),
                  b["episode_id"] + c["episode_id_base"], b.get("state"))
    c["episode_id_max"] = max(c.get("episode_id_max", 0), int(b["episode_id"].max()) + c["episode_id_base"])
    n = int(b["action"].size)
    c["env_steps"] += n * world
    return n


def _sync_target(online: torch.nn.Module, target: torch.nn.Module, tau: float) -> None:
    with torch.no_grad():
        for p_t, p in zip(target.parameters(), online.parameters()):
            p_t.lerp_(p, tau) if tau < 1.0 else p_t.copy_(p)


REPLAY_FIELDS = ("obs", "next_obs", "action", "reward", "done", "episode_id", "state")


def _state(online, target, opt, c: dict, returns: list, replay: SequenceReplay, monitor: StabilityMonitor,
           rng: np.random.Generator, rollout: Optional[dict], losses: list, grad_norms: list) -> dict:
    # its filled rows only (a buffer not yet full fills them from row 0): an early checkpoint is not the whole
    # allocation (90 MB of stored states for 400 transitions)
    rep = {k: torch.from_numpy(getattr(replay, k)[:replay.size]) for k in REPLAY_FIELDS if getattr(replay, k) is not None}
    rep |= {"ptr": replay.ptr, "size": replay.size, "rows": replay.rows}
    return {"online": online.state_dict(), "target": target.state_dict(), "optim": opt.state_dict(),
            "counters": dict(c), "returns": list(returns), "replay": rep, "stability": monitor.state_dict(),
            "rng": rng.bit_generator.state, "torch_rng": torch.get_rng_state(), "rollout": rollout,
            # the losses since the last log line, so that line averages the same updates after a resume
            "pending_losses": [x.cpu() for x in losses], "pending_grad_norms": [x.cpu() for x in grad_norms]}


def _restore_rollout(collector: Collector, ckpt: Optional[dict], world: int, session) -> Optional[dict]:
    """Put the rollout workers back mid-episode as the checkpoint left them; ``None`` (fresh
    episodes) when there is nothing to restore or it no longer fits (other actors, envs, task)."""
    rollout = (ckpt or {}).get("rollout")
    if rollout is None or world > 1:  # data-parallel learners keep only rank 0's state
        return None
    try:
        collector.set_state(rollout["workers"])
    except (env_state.EnvStateMismatch, KeyError, ValueError, TypeError, AttributeError) as e:
        session.message(f"rollout state not restored ({str(e).splitlines()[0]}): envs start fresh episodes")
        return None
    return rollout


def _load_replay(replay: SequenceReplay, rep: dict) -> None:
    rows = int(rep.get("rows", rep["obs"].shape[0]))  # (checkpoints of earlier versions hold every row)
    if (rows, *rep["obs"].shape[1:]) != replay.obs.shape:
        # e.g. resumed with another number of envs: the stored columns no longer line up
        print(f"[mpn_dqn] replay layout changed {(rows, *rep['obs'].shape[1:])} -> {replay.obs.shape}: starting it empty")
        return
    for k in REPLAY_FIELDS:
        if k in rep and getattr(replay, k) is not None:
            getattr(replay, k)[:len(rep[k])] = rep[k].numpy()
    replay.ptr, replay.size = int(rep["ptr"]), int(rep["size"])


def _check_in_step(model: torch.nn.Module, session, rank: int, world: int, device: torch.device) -> None:
    """Data-parallel learners must end with the same weights: each leaves a fingerprint in the run
    folder, and a mismatch (e.g. a rank that skipped an all-reduce) fails the run loudly."""
    import hashlib

    digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()
    (session.run_dir / f"weights_rank{rank}.txt").write_text(digest + "\n")
    total = float(sum(p.detach().double().sum() for p in model.parameters()))
    spread = all_sum([total, total * total], world, device)
    if abs(spread[1] / world - (spread[0] / world) ** 2) > 1e-9 * max(1.0, spread[1] / world):
        raise RuntimeError(f"data-parallel learners ended with different weights (rank {rank}: {digest[:12]})")
