"""Host-side helpers of the JAX workloads (no Ray, no MLflow): the persistent compilation cache, and
device arrays to the numpy / torch a checkpoint stores."""

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


def to_tensor(x):
    """numpy -> torch for a checkpoint (torch has no uint32 arithmetic, but stores it; bool as is)."""
    import numpy as np
    import torch

    return torch.from_numpy(x.astype(np.int64) if x.dtype == np.uint32 else np.array(x))  # a writable copy


def to_host(tree):
    """Replicated (possibly multi-process) arrays -> numpy, via this process's own copy."""
    import jax
    import numpy as np

    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else np.asarray(x), tree)
