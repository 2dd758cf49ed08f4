"""The pointer-generator summarizer (``model.py``), its data, beam search and workload.

Its batched beam search returns exactly what a per-example search does (``model.chunked_context``).
That needs a GEMM to give each row the same bits whatever the number of rows. On AVX-512 CPUs MKL
picks other kernels for a few rows than for many, which sum in another order (last-bit differences
that can flip a near-tie), unless its conditional numerical reproducibility is strict. MKL reads
``MKL_CBWR`` at its first call, so it is set here, on import, unless the user set it: it costs
little (about +15% on products of a few rows, nothing on large ones) and only this workload asks.
"""

import os

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
