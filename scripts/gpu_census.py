"""What hackmatrix PPO compiles to on an H100, counted on a machine without a GPU.

    bash scripts/gpu_census.sh [--num-envs 8192] [--precision bf16]

XLA compiles for a GPU it is not attached to when it is given the GPU's description (a "deviceless"
compile: JAX's CUDA plugin, a compile-only device). The optimized HLO then says how many kernels each
loop body launches: the rollout's env + policy step, GAE, the SGD epochs. A step of ~100 small
kernels at 8,192 envs is bound by launches and tails, not by bytes; this counts them between GPU
sessions. Not timed: kernel counts only (a GPU session times them; docs/benchmarks.md).
"""
import argparse
import collections
import re
import sys
import time

# The H100 SXM's facts XLA's GPU compiler reads (its cost model, tiling and launch limits).
H100 = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84942979072 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
FREE = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "opt-barrier", "after-all"}


def computations(text: str) -> dict:
    comps, name = {}, None
    for line in text.splitlines():
        m = re.match(r"^(ENTRY )?%(\S+) .*\{$", line)
        if m:
            name = m.group(2)
            comps[name] = (bool(m.group(1)), [])
        elif line.startswith("}"):
            name = None
        elif name:
            comps[name][1].append(line)
    return comps


def opcode(line: str):
    m = re.match(r"\s*(?:ROOT )?%\S+ = (.*)$", line)
    if not m:
        return None
    rest, depth = m.group(1), 0
    if rest.startswith("("):  # a tuple shape, nested and commented (/*index=5*/): skip to its end
        for i, ch in enumerate(rest):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                break
        rest = rest[i + 1:]
    else:
        rest = rest.split(" ", 1)[-1]
    m = re.match(r"\s*([a-z][a-z0-9\-]*)\(", rest)
    return m.group(1) if m else None


def census(text: str) -> list:
    """[(where, kernels launched per pass, by opcode)] for the entry and every loop body."""
    comps, out = computations(text), []

    def visit(name: str, where: str):
        ops = collections.Counter()
        for line in comps[name][1]:
            op = opcode(line)
            if op == "while":
                trips = re.search(r'"n":"(\d+)"', line)
                body = re.search(r"body=%([^\s,]+)", line).group(1)
                visit(body, f"{where} > loop x{trips.group(1) if trips else '?'}")
            elif op and op not in FREE:
                ops[op] += 1
        out.append((where, sum(ops.values()), dict(ops.most_common(4))))

    visit(next(n for n, (entry, _) in comps.items() if entry), "program")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-envs", type=int, default=8192)
    ap.add_argument("--num-steps", type=int, default=128)
    ap.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    ap.add_argument("--feature-align", type=int, default=1, help="model.feature_align")
    args = ap.parse_args(argv)

    import jax
    import numpy as np
    from jax._src import xla_bridge
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from raysys.workloads.hackmatrix_ppo import bench, ppo
    from raysys.workloads.hackmatrix_ppo.bench import _cfg

    bench.FEATURE_ALIGN = args.feature_align

    try:
        topology = xla_bridge.make_pjrt_topology("cuda", "", target_config=H100, topology="1x1x1")
    except Exception as e:  # no CUDA plugin: scripts/gpu_census.sh installs one beside this Python
        sys.exit(f"gpu_census: JAX's CUDA plugin is needed (run it through scripts/gpu_census.sh): {e}")
    mesh = ppo.make_mesh(topology._make_compile_only_devices())
    cfg = _cfg(args.num_envs, args.num_steps, 1, args.precision)
    shapes = jax.eval_shape(lambda k: ppo._build(cfg, k), jax.random.PRNGKey(0))
    on = lambda spec, tree: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)), tree)
    runner = ppo.Runner(*(on(spec, getattr(shapes, f)) for f, spec in zip(ppo.Runner._fields, ppo.runner_specs())))
    hp = on(P(), jax.tree.map(np.asarray, ppo.hparams_of(cfg)))
    t = time.perf_counter()
    text = ppo.make_train_chunk(cfg, mesh).trace(runner, hp).lower(lowering_platforms=("cuda",)).compile().as_text()
    print(f"one PPO update, {args.num_envs} envs x {args.num_steps} steps, {args.precision}, compiled for an H100 "
          f"in {time.perf_counter() - t:.0f} s; kernels launched per pass:")
    for where, n, ops in census(text):
        print(f"{n:6d}  {where}  {ops}")


if __name__ == "__main__":
    main()
