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
    # every program shape a sweep tries adds entries, and JAX evicts none unless bounded: the least recently
    # used go past $RAYSYS_JAX_CACHE_MAX_MB (2 GiB; -1: no bound)
    limit = int(os.environ.get("RAYSYS_JAX_CACHE_MAX_MB", "2048"))
    jax.config.update("jax_compilation_cache_max_size", limit * 2**20 if limit >= 0 else -1)


def wait(tree):
    """``jax.block_until_ready(tree)`` in a helper thread that the main thread joins: a wait inside XLA defers
    Python's signal handlers to its end (a Ctrl-C said nothing for a whole chunk); a join lets them run at
    once. Errors of the computation are raised here. Returns ``tree``."""
    import threading

    import jax

    if threading.current_thread() is not threading.main_thread():  # no handlers run here anyway
        return jax.block_until_ready(tree)
    failed: list[BaseException] = []

    def block():
        try:
            jax.block_until_ready(tree)
        except BaseException as e:  # an XLA runtime error (out of memory): the caller's to raise
            failed.append(e)

    helper = threading.Thread(target=block, name="raysys-jax-wait", daemon=True)
    helper.start()
    helper.join()
    if failed:
        raise failed[0]
    return tree


def to_host(tree):
    """Replicated (possibly multi-process) arrays -> numpy, via this process's own copy (waited for with
    :func:`wait`)."""
    import jax
    import numpy as np

    wait(tree)
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else np.asarray(x), tree)
