"""Cheap randomness for vmapped steps: counter-hash uniforms and random cell orders."""
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .board import CELLS, prefix_count


def uniforms(key, n):
    """n float32 uniforms in [0, 1) with 24-bit resolution, cheaply.

    One threefry word seeds a counter hash (the `lowbias32` mixer, a bijection
    on uint32). It is ~15x cheaper than `jax.random.uniform` for the few hundred
    draws a step needs, which otherwise dominated the step's cost.
    """
    x = jax.random.bits(key, (), jnp.uint32) + jnp.arange(n, dtype=jnp.uint32) * jnp.uint32(0x9E3779B9)
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    x = x ^ (x >> 16)
    return (x >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


def uniform_int(u, n):
    """Map uniforms in [0, 1) to ints in 0..n-1 (clipped against float rounding)."""
    return jnp.minimum(jnp.floor(u * n), n - 1).astype(jnp.int32)


class Order(NamedTuple):
    """A uniformly random order of the 36 cells."""
    rank: jax.Array   # int32[36]: position of each cell
    perm: jax.Array   # int32[36]: cell at each position


def random_order(noise) -> Order:
    """Rank 36 uniforms (ties, probability ~0, broken by cell index).

    A [36, 36] compare is the one quadratic piece of a step; sorts are far
    slower under vmap on CPU. One order per step serves the siphon and the
    stage generation, which never both take effect in the same step.
    """
    a, b = noise[None, :], noise[:, None]
    earlier = (a < b) | ((a == b) & (CELLS[None, :] < CELLS[:, None]))
    rank = earlier.sum(1).astype(jnp.int32)
    return Order(rank=rank, perm=jnp.zeros_like(rank).at[rank].set(CELLS.astype(jnp.int32)))


def rank_within(order: Order, allowed):
    """Position of each allowed cell among the allowed cells in `order`.

    Taking the cells with rank_within < k gives a uniform random k-subset of
    the allowed cells. Disallowed cells get a rank >= the number allowed.
    """
    allowed = jnp.asarray(allowed)
    before = prefix_count(allowed[order.perm])[order.rank] - 1
    return jnp.where(allowed, before, CELLS.shape[0])
