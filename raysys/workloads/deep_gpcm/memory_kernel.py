"""The DKVMN memory recurrence as two fused Triton kernels (forward, reverse-time backward).

The same function as ``model._MemoryScan`` (read before write, padded steps skipped):

    r_t     = w_t^T M_t
    M_{t+1} = M_t + w_t (a_t - e_t * M_t)

Why a kernel: on a GPU the loop of ``_MemoryScan`` launches a few tiny kernels per step, so an
H100 spends its time launching them (issue #14). The recurrence is elementwise in the memory's
columns: column j of M_{t+1} needs column j of M_t, w_t and e_t[j], a_t[j] only. So one program
owns one batch row and one block of columns, keeps that [N, BLOCK_D] slice of M in registers for
all T steps, and touches global memory only for its inputs and outputs.

Backward: G_t = dL/dM_t runs in reverse time. From G_{t+1}, the read's gradient dr_t and M_t,

    dw_t[i] = sum_j dr_t[j] M_t[i,j] + G_{t+1}[i,j] (a_t[j] - e_t[j] M_t[i,j])
    da_t[j] = sum_i w_t[i] G_{t+1}[i,j]
    de_t[j] = -sum_i w_t[i] G_{t+1}[i,j] M_t[i,j]
    G_t     = G_{t+1} * (1 - w_t e_t^T) + w_t dr_t^T

and dL/dM_0 = sum over rows of G_0. M_t is needed in reverse order: the forward stores M every
``chunk`` steps; the backward recomputes one chunk into a per-program scratch slice and walks it
backwards. dw sums over all columns, so each column block writes its partial sum and the caller
adds them (one small reduction, no atomics: results are deterministic).

The tile (BLOCK_D columns, num_warps) is timed per shape on first use (``_tuned``): on an H200
narrow tiles of one or two warps won by 2x in the backward (docs/benchmarks.md).

On a CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is
imported; numpy, slow, but the same program): that is how CI checks them against the naive path.
Triton is imported only here.
"""

from __future__ import annotations

import itertools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _step_inputs(w_ptr, e_ptr, a_ptr, t, ok, b, B, N, D, SE, rows, cols):
    """w_t [BLOCK_N], e_t, a_t [BLOCK_D] of batch row b; zeros where not ``ok`` (padded steps)."""
    n_ok = tl.where(ok, N, 0)  # masks: all rows/columns inside the sequence, none after
    d_ok = tl.where(ok, D, 0)
    wt = tl.load(w_ptr + (t * B + b) * N + rows, mask=rows < n_ok, other=0.0)
    et = tl.load(e_ptr + (t * B + b) * SE + cols, mask=cols < d_ok, other=0.0)
    at = tl.load(a_ptr + (t * B + b) * SE + cols, mask=cols < d_ok, other=0.0)
    return wt, et, at


# Both kernels load step t's inputs one step ahead, during step t-1's math: the recurrence is
# serial, so a load issued when it is needed leaves the program waiting on memory for most of a step.
# Every output is written at every step, padded ones included (zeros there), so the caller
# allocates them uninitialised: no fill kernels. e and a (and their gradients) are the two halves of
# one [T, B, 2D] tensor, row stride SE = 2D: the caller neither splits nor concatenates them.

@triton.jit
def _fwd(w_ptr, e_ptr, a_ptr, m0_ptr, len_ptr, reads_ptr, ckpt_ptr, T, B, N, D, SE,
         CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WIDE: tl.constexpr):
    b = tl.program_id(0)
    if WIDE:  # element offsets past 2**31 (B x T of ~1.7M at N=50, D=200): 64-bit address math, else 32-bit
        b = b.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_N)
    col_ok, row_ok = cols < D, rows < N
    tile_ok = row_ok[:, None] & col_ok[None, :]
    tile = rows[:, None] * D + cols[None, :]
    m = tl.load(m0_ptr + tile, mask=tile_ok, other=0.0)
    length = tl.load(len_ptr + b)
    n_chunks = (length + CHUNK - 1) // CHUNK
    wt, et, at = _step_inputs(w_ptr, e_ptr, a_ptr, 0, 0 < length, b, B, N, D, SE, rows, cols)
    for c in range(0, n_chunks):
        tl.store(ckpt_ptr + (c * B + b) * N * D + tile, m, mask=tile_ok)
        for s in range(0, CHUNK):
            t = c * CHUNK + s
            wn, en, an = _step_inputs(w_ptr, e_ptr, a_ptr, t + 1, t + 1 < length, b, B, N, D, SE, rows, cols)
            tl.store(reads_ptr + (t * B + b) * D + cols, tl.sum(wt[:, None] * m, axis=0),
                     mask=cols < tl.where(t < T, D, 0))  # the last chunk may run past T
            m += wt[:, None] * (at[None, :] - et[None, :] * m)  # w = 0 on padded steps: no change
            wt, et, at = wn, en, an
    for t in range(n_chunks * CHUNK, T):  # steps past the last chunk: read nothing
        tl.store(reads_ptr + (t * B + b) * D + cols, tl.zeros((BLOCK_D,), dtype=tl.float32), mask=col_ok)


@triton.jit
def _bwd(w_ptr, e_ptr, a_ptr, len_ptr, ckpt_ptr, gr_ptr, dw_ptr, de_ptr, da_ptr, dm0_ptr, scratch_ptr, T, B, N, D, SE,
         CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WIDE: tl.constexpr):
    b = tl.program_id(0)
    if WIDE:  # element offsets past 2**31 (B x T of ~1.7M at N=50, D=200): 64-bit address math, else 32-bit
        b = b.to(tl.int64)
    blk = tl.program_id(1)
    cols = blk * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_N)
    col_ok, row_ok = cols < D, rows < N
    tile_ok = row_ok[:, None] & col_ok[None, :]
    tile = rows[:, None] * D + cols[None, :]
    length = tl.load(len_ptr + b)
    g = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)  # G_{t+1}; 0 after a row's last step
    n_chunks = (length + CHUNK - 1) // CHUNK
    for t in range(n_chunks * CHUNK, T):  # steps past the last chunk: no gradient
        tl.store(da_ptr + (t * B + b) * SE + cols, tl.zeros((BLOCK_D,), dtype=tl.float32), mask=col_ok)
        tl.store(de_ptr + (t * B + b) * SE + cols, tl.zeros((BLOCK_D,), dtype=tl.float32), mask=col_ok)
        tl.store(dw_ptr + ((blk * T + t) * B + b) * N + rows, tl.zeros((BLOCK_N,), dtype=tl.float32), mask=row_ok)
    for cc in range(0, n_chunks):
        c = n_chunks - 1 - cc
        m = tl.load(ckpt_ptr + (c * B + b) * N * D + tile, mask=tile_ok, other=0.0)
        t0 = c * CHUNK
        wt, et, at = _step_inputs(w_ptr, e_ptr, a_ptr, t0, t0 < length, b, B, N, D, SE, rows, cols)
        for s in range(0, CHUNK):  # recompute M_t of this chunk into scratch
            t = t0 + s
            wn, en, an = _step_inputs(w_ptr, e_ptr, a_ptr, t + 1, (t + 1 < length) & (s + 1 < CHUNK), b, B, N, D, SE,
                                      rows, cols)
            tl.store(scratch_ptr + (b * CHUNK + s) * N * D + tile, m, mask=tile_ok)
            m += wt[:, None] * (at[None, :] - et[None, :] * m)
            wt, et, at = wn, en, an
        tl.debug_barrier()  # the scratch slice written above is read back below by other threads
        t = t0 + CHUNK - 1
        wt, et, at = _step_inputs(w_ptr, e_ptr, a_ptr, t, t < length, b, B, N, D, SE, rows, cols)
        dr = tl.load(gr_ptr + (t * B + b) * D + cols, mask=cols < tl.where(t < length, D, 0), other=0.0)
        m = tl.load(scratch_ptr + (b * CHUNK + CHUNK - 1) * N * D + tile, mask=tile_ok, other=0.0)
        for s2 in range(0, CHUNK):
            s = CHUNK - 1 - s2
            t = t0 + s
            ok = (s > 0) & (t - 1 < length)  # the step before, inside this chunk: fetched ahead
            wn, en, an = _step_inputs(w_ptr, e_ptr, a_ptr, t - 1, ok, b, B, N, D, SE, rows, cols)
            drn = tl.load(gr_ptr + ((t - 1) * B + b) * D + cols, mask=cols < tl.where(ok, D, 0), other=0.0)
            mn = tl.load(scratch_ptr + (b * CHUNK + s - 1) * N * D + tile,
                         mask=(rows < tl.where(ok, N, 0))[:, None] & col_ok[None, :], other=0.0)
            d_in, n_in = tl.where(t < T, D, 0), tl.where(t < T, N, 0)  # the last chunk may run past T
            wg = wt[:, None] * g  # 0 on padded steps (w = 0), and so is every gradient below
            tl.store(da_ptr + (t * B + b) * SE + cols, tl.sum(wg, axis=0), mask=cols < d_in)
            tl.store(de_ptr + (t * B + b) * SE + cols, -tl.sum(wg * m, axis=0), mask=cols < d_in)
            dw = tl.sum(dr[None, :] * m + g * (at[None, :] - et[None, :] * m), axis=1)
            tl.store(dw_ptr + ((blk * T + t) * B + b) * N + rows, dw, mask=rows < n_in)
            g = g - wt[:, None] * (et[None, :] * g - dr[None, :])  # w = dr = 0 on padded steps: no change
            wt, et, at, dr, m = wn, en, an, drn, mn
        tl.debug_barrier()  # the next chunk overwrites the scratch slice
    tl.store(dm0_ptr + b * N * D + tile, g, mask=tile_ok)


def configs(n: int, d: int) -> list[tuple[int, int]]:
    """The (BLOCK_D, num_warps) the tuner tries for a memory of n rows and d columns: 16 or 32 tile
    elements per thread, so a tile and its temporaries stay in registers; BLOCK_D no wider than d."""
    block_n = triton.next_power_of_2(n)
    out = [(bd, nw) for bd in (16, 32, 64, 128) for nw in (1, 2, 4, 8)
           if bd <= max(16, triton.next_power_of_2(d)) and block_n * bd // (32 * nw) in (16, 32)]
    if out:
        return out
    # a memory of more than 512 rows: the narrowest tile over more warps (up to 1,024 threads), the fewest
    # elements a thread holds; one warp would hold 512 and spill them to local memory
    return [(16, nw) for nw in (16, 32) if block_n * 16 // (32 * nw) in (16, 32)] or [(16, 32)]


def compile_for(arch: int = 90, chunk: int = 8, n: int = 50, d: int = 200) -> dict:
    """Both kernels, in every configuration the tuner may pick, through Triton's whole compiler (to
    PTX and cubin) for a CUDA architecture (90: H100), without a GPU: what a CPU-only CI can check
    besides the numerics. -> {"fwd 64x4": PTX, ...} (BLOCK_D x num_warps)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptr, i32 = "*fp32", "i32"
    sigs = {
        "fwd": (_fwd, [ptr] * 4 + ["*i32", ptr, ptr] + [i32] * 5),
        "bwd": (_bwd, [ptr] * 3 + ["*i32"] + [ptr] * 7 + [i32] * 5),
    }
    out = {}
    for (block_d, warps), wide in itertools.product(configs(n, d), (False, True)):
        consts = {"CHUNK": chunk, "BLOCK_N": triton.next_power_of_2(n), "BLOCK_D": block_d, "WIDE": wide}
        for name, (kernel, types) in sigs.items():
            signature = dict(zip(kernel.arg_names, types)) | {k: "constexpr" for k in consts}
            compiled = triton.compile(ASTSource(kernel, signature, constexprs=consts),
                                      target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
            out[f"{name} {block_d}x{warps}" + (" wide" if wide else "")] = compiled.asm["ptx"]
    return out


def _check_device(x: torch.Tensor) -> None:
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton memory recurrence runs on a CUDA device, or on a CPU in Triton's interpreter "
                           "(TRITON_INTERPRET=1 set before triton is imported)")


_best: dict = {}  # (kernel, device, B rounded up to a power of two, N, D, chunk) -> (BLOCK_D, num_warps)
_times: dict = {}  # the same keys -> {(BLOCK_D, num_warps): ms}


def tuning_report() -> list[str]:
    """What the tuner measured in this process, one line per kernel and shape (benches print it)."""
    return [f"{kind} B<={b} N={n} D={d} chunk={c}: " + ", ".join(
        f"{bd}x{nw} {ms:.2f}{'*' if (bd, nw) == _best[key] else ''}" for (bd, nw), ms in _times[key].items())
        + " ms (BLOCK_D x warps, * picked)" for key in _times for kind, _, b, n, d, c in [key]]


def _tuned(kind: str, run, x: torch.Tensor, B: int, N: int, D: int, chunk: int) -> tuple[int, int]:
    """The fastest configuration of one kernel for this shape, timed once per process on the call's
    own inputs (as ``triton.autotune`` does, but here the grid and the dw partials depend on the
    pick). The best tile differs by GPU and by shape, so it is measured, not assumed. The
    interpreter (CPU) takes the widest tile; its timings would mean nothing."""
    if x.device.type != "cuda":
        return min(triton.next_power_of_2(D), 64), 4
    key = (kind, x.device.index, triton.next_power_of_2(B), N, D, chunk)
    if key not in _best:
        from triton.runtime.errors import OutOfResources
        from triton.testing import do_bench

        def ms(cfg) -> float:
            try:
                return do_bench(lambda: run(cfg), warmup=2, rep=10)
            except OutOfResources:  # a smaller GPU may not fit a tile: the others compete
                return float("inf")

        _times[key] = {cfg: ms(cfg) for cfg in configs(N, D)}
        _best[key] = min(_times[key], key=_times[key].get)
    return _best[key]


def _wide(*tensors) -> bool:
    """Whether an element offset into one of the kernel's buffers may pass int32 (then 64-bit offsets)."""
    return max(t.numel() for t in tensors) >= 2 ** 31


def forward_kernel(w, ea, m0, lengths, chunk: int, config: tuple[int, int]):
    """-> (reads [T,B,D], checkpoints [T/chunk,B,N,D]) with one (BLOCK_D, num_warps) configuration.
    ``ea`` [T,B,2D]: erase then add, each step's row contiguous."""
    T, B, N = w.shape
    D = ea.shape[-1] // 2
    block_d, warps = config
    reads = ea.new_empty(T, B, D)
    ckpt = ea.new_empty(triton.cdiv(T, chunk), B, N, D)
    _fwd[(B, triton.cdiv(D, block_d))](w, ea, ea[..., D:], m0, lengths, reads, ckpt, T, B, N, D, 2 * D, CHUNK=chunk,
                                       BLOCK_N=triton.next_power_of_2(N), BLOCK_D=block_d, num_warps=warps,
                                       WIDE=_wide(w, ea, ckpt))
    return reads, ckpt


def backward_kernel(w, ea, lengths, ckpt, grad_reads, chunk: int, config: tuple[int, int]):
    """-> (dw, d ea, dm0) with one (BLOCK_D, num_warps) configuration."""
    T, B, N = w.shape
    D = ea.shape[-1] // 2
    block_d, warps = config
    blocks = triton.cdiv(D, block_d)
    dw = w.new_empty(blocks, T, B, N)  # one partial sum per column block: no atomics, deterministic
    dea = torch.empty_like(ea)
    dm0 = ea.new_empty(B, N, D)
    scratch = ea.new_empty(B, chunk, N, D)
    _bwd[(B, blocks)](w, ea, ea[..., D:], lengths, ckpt, grad_reads, dw, dea, dea[..., D:], dm0, scratch, T, B, N, D,
                      2 * D, CHUNK=chunk, BLOCK_N=triton.next_power_of_2(N), BLOCK_D=block_d, num_warps=warps,
                      WIDE=_wide(w, ea, ckpt, dw, scratch))
    return dw.sum(0), dea, dm0.sum(0)


class TritonMemoryScan(torch.autograd.Function):
    """``_MemoryScan``'s contract with per-row lengths and erase/add as one tensor: w [T,B,N],
    ea [T,B,2Dv] (erase, then add), m0 [N,Dv], lengths [B] (int32, steps inside each row's sequence)
    -> reads [T,B,Dv], 0 on padded steps. float32."""

    @staticmethod
    def forward(ctx, w, ea, m0, lengths, chunk: int):
        _check_device(w)
        if len({x.device for x in (w, ea, m0, lengths)}) > 1:  # a raw pointer of another device is read as garbage
            raise RuntimeError(f"the Triton memory recurrence takes its inputs on one device, got w, ea, m0, lengths "
                               f"on {', '.join(str(x.device) for x in (w, ea, m0, lengths))}")
        w, ea, m0 = (x.float().contiguous() for x in (w, ea, m0))
        (_, B, N), D = w.shape, ea.shape[-1] // 2
        cfg = _tuned("fwd", lambda c: forward_kernel(w, ea, m0, lengths, chunk, c), w, B, N, D, chunk)
        reads, ckpt = forward_kernel(w, ea, m0, lengths, chunk, cfg)
        ctx.save_for_backward(w, ea, lengths, ckpt)
        ctx.chunk = chunk
        return reads

    @staticmethod
    def backward(ctx, grad_reads):
        w, ea, lengths, ckpt = ctx.saved_tensors
        (_, B, N), D = w.shape, ea.shape[-1] // 2
        gr = grad_reads.float().contiguous()
        cfg = _tuned("bwd", lambda c: backward_kernel(w, ea, lengths, ckpt, gr, ctx.chunk, c), w, B, N, D, ctx.chunk)
        return *backward_kernel(w, ea, lengths, ckpt, gr, ctx.chunk, cfg), None, None


# torch.compile runs this eagerly (a graph break): Dynamo would trace the tuner's timing runs and
# cannot take a launch option (num_warps) that it sees as symbolic. One kernel launch each way
# gains nothing from being inside a compiled graph.
@torch.compiler.disable
def memory_scan(w: torch.Tensor, ea: torch.Tensor, m0: torch.Tensor, lengths: torch.Tensor,
                chunk: int = 8) -> torch.Tensor:
    """reads [T,B,Dv] of the memory written with erase ``ea[..., :Dv]`` and add ``ea[..., Dv:]``."""
    return TritonMemoryScan.apply(w, ea, m0, lengths.to(device=w.device, dtype=torch.int32).contiguous(), chunk)
