"""RLlib's PPO on the same HackMatrix game through the gymnasium adapter: the peer to measure against.

RLlib's default PPO module takes a flat Box observation, so the adapter's Dict (observations[1545],
action_mask[28]) is concatenated into one Box[1573]. The mask enters as input only: RLlib's
default module does not mask logits, and the env answers an illegal action with its invalid-action
penalty. This changes what the policy learns, not how fast the game steps. Same network as
raysys (ReLU MLP 2 x 256), PPO defaults otherwise, new API stack, learner in the driver.

    python -m raysys.workloads.hackmatrix_ppo.rllib_compare --seconds 60
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import gymnasium as gym
import numpy as np


class FlatObs(gym.ObservationWrapper):
    def __init__(self, env: gym.Env):
        super().__init__(env)
        n = sum(int(np.prod(s.shape)) for s in env.observation_space.spaces.values())
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (n,), np.float32)

    def observation(self, obs):
        return np.concatenate([obs["observations"], obs["action_mask"]]).astype(np.float32)


def _make_env(_cfg=None):
    from raysys.envs.hackmatrix import HackMatrixGymEnv

    return FlatObs(HackMatrixGymEnv())


def measure_rllib_ppo(seconds: float = 60.0, num_env_runners: int = 1, envs_per_runner: int = 8) -> dict:
    """Train RLlib PPO for about ``seconds`` (whole iterations) and return env-steps/s of training
    (sampling + learning), measured from the first iteration's end so that startup is excluded."""
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig
    from ray.tune.registry import register_env

    from raysys.train.runtime import init_ray

    with warnings.catch_warnings():
        # JAX warns at every fork of its (multithreaded) process; Ray's start-up forks only to exec its
        # services at once, which the warning's deadlock cannot reach
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        init_ray(None)
    register_env("raysys-hackmatrix-flat", _make_env)
    t_build = time.perf_counter()
    algo = (
        PPOConfig()
        .environment("raysys-hackmatrix-flat")
        .env_runners(num_env_runners=num_env_runners, num_envs_per_env_runner=envs_per_runner, num_cpus_per_env_runner=1)
        .learners(num_learners=0)
        .training(train_batch_size_per_learner=2048, minibatch_size=512, num_epochs=4, lr=2.5e-4, gamma=0.99,
                  lambda_=0.95, clip_param=0.2, entropy_coeff=0.1, vf_loss_coeff=0.5, grad_clip=0.5)
        .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[256, 256], fcnet_activation="relu"))
        .build_algo()
    )
    build_s = time.perf_counter() - t_build

    def lifetime_steps(result) -> int:
        return int(result["num_env_steps_sampled_lifetime"])

    try:
        first = algo.train()  # pays for lazy imports and the first compile-free warm-up
        t0, s0 = time.perf_counter(), lifetime_steps(first)
        result, iters = first, 0
        while time.perf_counter() - t0 < seconds or iters == 0:
            result = algo.train()
            iters += 1
        dt = time.perf_counter() - t0
        steps = lifetime_steps(result) - s0
        ret = result["env_runners"].get("episode_return_mean")
    finally:
        algo.stop()
    return {"env_steps_per_s": steps / dt, "env_steps": steps, "seconds": dt, "iterations": iters,
            "build_s": build_s, "episode_return_mean": None if ret is None else float(ret),
            "num_env_runners": num_env_runners, "envs_per_runner": envs_per_runner}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m raysys.workloads.hackmatrix_ppo.rllib_compare",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0, help="train for about this long (whole iterations), after the first")
    ap.add_argument("--runners", type=int, default=1, help="RLlib EnvRunner actors")
    ap.add_argument("--envs", type=int, default=8, help="envs per EnvRunner")
    a = ap.parse_args()
    print(json.dumps(measure_rllib_ppo(a.seconds, a.runners, a.envs), indent=1))
