"""Cheap randomness for vmapped steps: counter-hash uniforms and random cell orders."""
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .board import CELLS


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
    earlier: jax.Array   # bool[36, 36]: earlier[c, d] is True when cell d comes before cell c


def random_order(noise) -> Order:
    """Order 36 uniforms (ties, probability ~0, broken by cell index).

    A [36, 36] compare is the one quadratic piece of a step; sorts are far
    slower under vmap on CPU. One order per step serves the siphon and the
    stage generation, which never both take effect in the same step.
    """
    a, b = noise[None, :], noise[:, None]
    return Order(earlier=(a < b) | ((a == b) & (CELLS[None, :] < CELLS[:, None])))


def rank_within(order: Order, allowed):
    """Position of each allowed cell among the allowed cells in `order`.

    Taking the cells with rank_within < k gives a uniform random k-subset of
    the allowed cells. Disallowed cells get a rank >= the number allowed.
    The allowed cells before each cell, counted in one masked reduction: no
    permutation to scatter, gather and prefix-count (five GPU kernels, none fused).
    """
    allowed = jnp.asarray(allowed)
    before = (order.earlier & allowed[None, :]).sum(1).astype(jnp.int32)
    return jnp.where(allowed, before, CELLS.shape[0])
