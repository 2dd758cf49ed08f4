"""Small vectorised helpers over the flat board (cell = 6*row + col).

Cost notes (XLA on CPU, under vmap): per-env gathers (`layer[cells]`) and
elementwise ops are cheap; reductions over one-hot [units, cells] products and
`cumsum` are not, so prefix counts are a matmul with a constant triangle.
"""
import jax
import jax.numpy as jnp
import numpy as np

from .constants import GRID, MAX_UNITS, N_CELLS

# NumPy, not jnp: what is computed from them alone (cell rows, tie-break tables) folds into
# constants at trace time instead of running as tiny kernels inside every step's loop on a GPU.
CELLS = np.arange(N_CELLS, dtype=np.int32)
SLOTS = np.arange(MAX_UNITS, dtype=np.int32)
BIG = 1 << 20


def cell_of(row, col):
    return GRID * row + col


def on_board(row, col):
    return (row >= 0) & (row < GRID) & (col >= 0) & (col < GRID)


def prefix_count(mask):
    """Inclusive running count of a 1-d bool mask, as int32.

    On a CPU a matmul with a constant triangle (`cumsum` is slow there); elsewhere a masked
    reduction over the same triangle, which a GPU fuses with what feeds it instead of
    launching a matmul of its own.
    """
    return jax.lax.platform_dependent(mask, cpu=_prefix_by_matmul, default=_prefix_by_reduce)


def _upper(n):
    return np.triu(np.ones((n, n), bool))


def _prefix_by_matmul(mask):
    return (mask.astype(jnp.float32) @ _upper(mask.shape[-1]).astype(np.float32)).astype(jnp.int32)


def _prefix_by_reduce(mask):
    return (mask[..., :, None] & _upper(mask.shape[-1])).sum(-2, dtype=jnp.int32)


def first_true(mask, axis=-1):
    """Index of the first True along `axis` (its length if none).

    A plain min-reduce: argmax/argmin lower to a much slower two-value reduce.
    """
    n = mask.shape[axis]
    iota = jax.lax.broadcasted_iota(jnp.int32, mask.shape, axis % mask.ndim)
    return jnp.min(jnp.where(mask, iota, n), axis=axis)


def first_min(values, axis=-1):
    """argmin with the lowest index winning ties, via `first_true`."""
    return first_true(values == values.min(axis=axis, keepdims=True), axis)


def nth_true(mask, k):
    """Index of the k-th (0-based) True of a 1-d bool mask (the length if none)."""
    return first_true(mask & (prefix_count(mask) == k + 1))


def occupancy(units):
    """bool[N_CELLS]: cells holding at least one active unit of the table."""
    cells = cell_of(units.row, units.col)
    return ((cells[:, None] == CELLS) & units.active[:, None]).any(0)


def materialize(tree):
    """Compute `tree` once, here (an XLA optimization barrier).

    XLA fuses cheap elementwise producers into every consumer; when a consumer
    broadcasts (a [slots] value compared against all 36 cells, say) a long
    producer chain gets recomputed per element. Barriers at phase boundaries
    cut the vmapped step's CPU time by ~30% (measured at 256 envs).
    """
    keep = jax.lax.optimization_barrier
    return jax.lax.platform_dependent(tree, cpu=keep, default=keep if GPU_BARRIERS else lambda t: t)


# Whether `materialize` cuts fusions on a GPU too. Without them an H100's rollout step is 90
# kernels, not 104 (scripts/gpu_census.sh), but some producers are then computed more than once;
# which is faster is for a GPU to say: `python -m raysys.workloads.hackmatrix_ppo.bench --profile
# 8192 --gpu-barriers off` (read when a step is traced).
GPU_BARRIERS = True


def walls(board):
    """bool[N_CELLS]: unsiphoned blocks, which stop walking (siphoned ones do not)."""
    return (board.block != 0) & ~board.siphoned
