"""In-context RL: the trained model acts in Darkroom on goals it never saw, learning from its own context.

No weight is updated. Each (goal, stream) row keeps its own history; at step t of region r the model
reads the sample ``[cs, region r-1, ce, cs, region r so far, current cell]`` built by the training
code itself (:func:`data.pack`, one query, so attention is plain causal), samples an action, and the
env steps. Regions close every R steps, as in the training data; at each close the model is also
asked for the token type, whose answer should be end-of-region (reported as ``end_token_accuracy``).

Baselines on the same goals: a uniformly random policy, and the source PPO's own learning curve at the
same episode (``episode_returns`` of its histories: their per-update returns are per episode only where
an update is one episode of every stream, ``source.n_steps`` = the horizon).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from raysys.envs import darkroom as dr
from raysys.train.data import to_device
from raysys.workloads.ad_transformer.data import END_OF_REGION, Streams, pack


@torch.no_grad()
def rollout(model: torch.nn.Module, goals, streams: int, episodes: int, region: int, seed: int = 0,
            greedy: bool = False) -> dict:
    """-> {'returns': float[goals, streams, episodes], 'end_token_accuracy': float}."""
    goals = np.asarray(goals, np.int64)
    device = next(model.parameters()).device
    B, H, size = len(goals) * streams, dr.HORIZON, dr.SIZE
    T = episodes * H
    goal_rc = np.stack(np.divmod(np.repeat(goals, streams), size), -1)
    h = Streams(np.zeros((B, T + 1, 2), np.int8), np.zeros((B, T + 1), np.int8), np.zeros((B, T + 1), np.int8),
                np.zeros((B, T + 1, 2), np.int8))
    rows, centre = np.arange(B), np.full((B, 2), size // 2, np.int64)
    pos, returns = centre.copy(), np.zeros((B, episodes), np.float32)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ends = []
    was_training = model.training
    model.eval()
    try:
        for t in range(T):
            r, c = divmod(t, region)
            h.states[:, t] = pos
            if c == 0 and r > 0:  # the previous region just filled: the model should call its end
                logits_type = model(to_device(pack(h, rows, np.full(B, r - 1), [region], region), device))[1]
                ends.append((logits_type.argmax(-1) == END_OF_REGION).float().mean().item())
            logits = model(to_device(pack(h, rows, np.full(B, r), [c], region), device))[0].float().cpu()
            a = logits.argmax(-1) if greedy else torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0]
            a = a.numpy()
            nxt = dr.move(pos, a, size)
            reward = (nxt == goal_rc).all(-1)
            h.actions[:, t], h.rewards[:, t], h.next_states[:, t] = a, reward, nxt
            returns[:, t // H] += reward
            pos = centre.copy() if (t + 1) % H == 0 else nxt
    finally:
        model.train(was_training)
    return {"returns": returns.reshape(len(goals), streams, episodes),
            "end_token_accuracy": float(np.mean(ends)) if ends else float("nan")}


def episode_returns(rewards: np.ndarray) -> np.ndarray:
    """The source PPO's learning curve, float[goals, episodes]: each stream's rewards ``[goals, streams, steps]``
    summed over its episodes (the env ends one every ``HORIZON`` steps from the stream's start, whatever the
    PPO's rollout length), averaged over the streams; a last episode cut short is left out."""
    G, S, T = rewards.shape
    E = T // dr.HORIZON
    return rewards[:, :, :E * dr.HORIZON].reshape(G, S, E, dr.HORIZON).sum(-1, dtype=np.float32).mean(1)


def random_returns(goals, episodes: int = 2000, seed: int = 0) -> np.ndarray:
    """Mean episode return of a uniformly random policy on each goal (simulated)."""
    goals = np.asarray(goals, np.int64)
    rng = np.random.default_rng(seed)
    size = dr.SIZE
    goal_rc = np.stack(np.divmod(np.repeat(goals, episodes), size), -1)
    pos = np.full_like(goal_rc, size // 2)
    total = np.zeros(len(goal_rc))
    for _ in range(dr.HORIZON):
        pos = dr.move(pos, rng.integers(0, dr.N_ACTIONS, len(pos)), size)
        total += (pos == goal_rc).all(-1)
    return total.reshape(len(goals), episodes).mean(1)


def summarize(returns: np.ndarray, last: int, random: np.ndarray, goals, source: Optional[np.ndarray] = None,
              points=(1, 5, 10, 20, 30, 40, 50)) -> dict[str, float]:
    """Metrics of a rollout: first / last episodes, a few curve points, and the baselines."""
    curve = returns.mean((0, 1))  # over goals and streams
    n = len(curve)
    out = {"icl_return_first": float(curve[0]), "icl_return_last": float(curve[-last:].mean()),
           "random_return": float(random.mean()), "optimal_return": float(dr.optimal_return(goals).mean())}
    for k in points:
        if k <= n:
            out[f"icl_return_ep{k}"] = float(curve[k - 1])
    if source is not None and source.shape[1]:
        m = min(n, source.shape[1])
        out["source_return_first"] = float(source[:, 0].mean())
        out["source_return_last"] = float(source[:, m - last:m].mean())  # the source PPO at the same episodes
    return out


def plot(curve: np.ndarray, random: float, source: Optional[np.ndarray], optimal: float, path: str, title: str) -> None:
    """Return per in-context episode, with the baselines, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ep = np.arange(1, len(curve) + 1)
    ax.plot(ep, curve, label="AD transformer, in context (no weight updates)", lw=2)
    if source is not None:
        n = min(len(curve), source.shape[1])
        ax.plot(ep[:n], source[:, :n].mean(0), label="source PPO, learning (its histories)", ls="--")
    ax.axhline(random, color="grey", ls=":", label="random policy")
    ax.axhline(optimal, color="black", lw=0.8, label="optimum")
    ax.set(xlabel="episode", ylabel="mean return on the held-out goals", title=title)
    ax.set_ylim(0, optimal * 1.05)  # the optimum's line stays in the picture
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    """Evaluate a run's checkpoint in context on the held-out goals: table, JSON and plot."""
    import argparse
    import json
    import sys
    from pathlib import Path

    from raysys.checkpoint import CheckpointStore
    from raysys.config import ConfigError, from_dict, read_yaml

    ap = argparse.ArgumentParser(prog="python -m raysys.workloads.ad_transformer.icl", description=main.__doc__)
    ap.add_argument("run", help="the run's folder (raysys_runs/<name>)")
    ap.add_argument("--episodes", type=int, help="in-context episodes (default: the run's eval.episodes)")
    ap.add_argument("--streams", type=int, help="rollouts per held-out goal (default: the run's eval.streams)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampled actions")
    ap.add_argument("--plot", metavar="PNG", help="write the curve with its baselines here")
    ap.add_argument("--json", metavar="PATH", help="write the metrics and the curve here")
    a = ap.parse_args(argv)
    from raysys.workloads.ad_transformer.workload import ADConfig, DistillationTask

    run = Path(a.run)
    try:
        cfg = from_dict(ADConfig, read_yaml(run / "config.yaml", "the run's config.yaml"))
        ckpt = CheckpointStore(run, "ad_transformer", {}).latest()
        if ckpt is None:
            raise ConfigError(f"{run} has no complete checkpoint")
        for flag in ("episodes", "streams"):
            if getattr(a, flag) is not None and getattr(a, flag) < 1:
                raise ConfigError(f"--{flag} must be at least 1, got {getattr(a, flag)}")
    except ConfigError as e:
        print(f"raysys: {e}", file=sys.stderr)
        return 2
    task = DistillationTask()
    model = task.build_model(cfg)
    model.load_state_dict(torch.load(ckpt / "state.pt", map_location="cpu", weights_only=True)["model"])
    _, held_out = task.goals(cfg)
    episodes = a.episodes if a.episodes is not None else cfg.eval.episodes
    streams = a.streams if a.streams is not None else cfg.eval.streams
    last = min(cfg.eval.last_episodes, episodes)
    out = rollout(model, held_out, streams, episodes, cfg.data.region, seed=a.seed)
    base = task.baselines(cfg, held_out)
    m = summarize(out["returns"], last, base["random"], held_out, base["source"])
    curve = out["returns"].mean((0, 1))
    per_goal = out["returns"][:, :, -last:].mean((1, 2))
    print(f"{ckpt} | held-out goals {held_out.tolist()} | {streams} rollouts each")
    print("| episode | AD in context | source PPO | random |\n|---:|---:|---:|---:|")
    src = base["source"]
    for k in sorted({1, 2, 3, 5, 10, 20, 30, 40, 50, episodes} & set(range(1, episodes + 1))):
        s = f"{src[:, k - 1].mean():.2f}" if src is not None and k <= src.shape[1] else "-"
        print(f"| {k} | {curve[k - 1]:.2f} | {s} | {m['random_return']:.2f} |")
    print(f"last {last} episode{'s' if last > 1 else ''}: {m['icl_return_last']:.2f} +- {per_goal.std():.2f} over goals "
          f"(optimum {m['optimal_return']:.2f}); end-token accuracy {out['end_token_accuracy']:.2f}")
    if a.plot:
        plot(curve, m["random_return"], src, m["optimal_return"], a.plot, f"in-context RL, {run.name} ({ckpt.name})")
        print(f"wrote {a.plot}")
    if a.json:
        Path(a.json).write_text(json.dumps({**m, "curve": curve.tolist(), "per_goal_last": per_goal.tolist(),
                                            "end_token_accuracy": out["end_token_accuracy"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
