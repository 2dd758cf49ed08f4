"""Host-side helpers of the JAX workloads (no Ray, no MLflow, no torch): the persistent compilation
cache, and device arrays to the numpy a checkpoint stores (``state.npz``, raysys/checkpoint.py)."""

from __future__ import annotations

import os


def enable_compilation_cache(path: str) -> None:
    """Persistent JAX compilation cache in ``path`` ('' leaves it off)."""
    if not path:
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
    # cache every program, however fast it compiled (the defaults skip sub-second compiles)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def to_host(tree):
    """Replicated (possibly multi-process) arrays -> numpy, via this process's own copy."""
    import jax
    import numpy as np

    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else np.asarray(x), tree)
