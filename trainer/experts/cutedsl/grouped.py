"""Torch-facing launchers of the CuTeDSL grouped GEMM (kernel.py): views of torch tensors as the kernel's
(M, K, L) operands, the work-item table of the `m` grouping (built on the device, no host sync), and a cache
of compiled variants (one JIT compile per grouping, operand majorness, dtypes and tile config; shapes are
dynamic, so one compile serves every size)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileConfig:
    """CTA tile (BM, BN), shared-memory stages, consumer warpgroups (64 rows each), epilogue store width and
    staging through shared memory (16-bit outputs; fp32 ones with smem_epilogue_fp32), CTAs per cluster along N
    (sharing each A tile by TMA multicast) and, for FP8, whether the promotion of a k-tile's partial overlaps the
    next k-tile's wgmmas and whether the scales come with each stage by TMA, of one compiled variant (all
    persistent and warp-specialized: kernel.py)."""

    tile_mn: tuple[int, int] = (128, 256)
    stages: int = 4
    warpgroups: int = 2
    pair_stores: bool = True
    smem_epilogue: bool = True
    cluster_n: int = 1
    overlap: bool = False
    tma_scales: bool = False
    smem_epilogue_fp32: bool = False


# The fastest that passed the numerics in bench/cutedsl_check.py on the H200 (bench/RESULTS.md): 128x256
# tiles, 4 stages, the 16-byte shared-memory epilogue (4-byte pairs for fp32 wgrads). A one-CTA-per-tile
# schedule ran at 0.6-0.7x of it and is gone. FP8: BN = 128 (one weight scale block per tile; the fp32
# accumulator and its per-k-tile partial would not fit in registers at 256), 128-deep k-tiles of 32 KB, 5 stages.
# Clusters of two CTAs sharing each A tile: on an H100 at H2048 I768 E128 (bench/cutedsl_check.py, two runs on
# 2026-12-07) the four row-grouped GEMMs took 1.6-3.4% less time in bf16 and 0.1-1.4% in FP8 than with single
# CTAs (a small gain, near the noise); the wgrad (k) GEMMs gained nothing. The FP8 `overlap` schedule ran
# 0.68-0.75x as fast as without it (three fp32 tiles of accumulators in registers: the third spills), so it stays
# off. The FP8 scales by TMA with each stage (`tma_scales`): the four FP8 GEMMs in 0.78-0.84x the time of the
# same schedule with the consumers' global loads of the scales, 1.42-1.70x torch._grouped_mm's bf16 per GEMM (H100,
# two runs, bench/RESULTS.md "FP8 scales by TMA"); 4 and 5 stages tie (2.672 and 2.673 ms summed).
# The wgrad (k) GEMMs write fp32: staged through shared memory as 16-byte row segments (smem_epilogue_fp32, which
# leaves room for 3 stages) instead of 8-byte pairs scattered over 8 rows, they ran 1.46x as fast (2.61 against
# 3.81 ms, H100, bench/RESULTS.md "The fp32 epilogue through shared memory"); still 0.83x torch's.
M_CONFIG = TileConfig(cluster_n=2)
K_CONFIG = TileConfig(stages=3, smem_epilogue_fp32=True)
FP8_CONFIG = TileConfig((128, 128), 5, cluster_n=2, tma_scales=True)
# The FP8 weight gradients (k_grouped_scaled): with the fp32 epilogue through shared memory (4 stages leave the
# room) 1.11-1.19x torch._grouped_mm's bf16 speed on an H100 at H2048 I768 E128; with the 8-byte pair stores
# 0.72-0.76x, the consumers stalled on full load/store queues for 37% of their cycles and L2 94% busy
# (bench/RESULTS.md, 2026-12-07). The backend takes them where the masters are fp32 (cutedsl.FP8_WGRAD "auto").
FP8_WGRAD_CONFIG = TileConfig((128, 128), 4, cluster_n=2, tma_scales=True, smem_epilogue_fp32=True)

POISON_OUTPUTS = False
"""Checks set this: outputs start as NaN instead of uninitialized memory, so an element the kernel fails to
write shows up in the error instead of hiding behind stale data."""


# How a compiled kernel is called. "dlpack": every call wraps every tensor with cute.runtime.from_dlpack in Python
# and passes torch's current stream (tens of microseconds of host time a launch, more than a GEMM takes at small
# expert shapes). "tvm-ffi": the function is compiled with TVM-FFI and takes the torch tensors themselves,
# checked against its compiled layout in C++, on the stream torch reports (apache-tvm-ffi, in the `gpu` extra).
# tvm-ffi is the default: on the H200 it cut the host time of a launch from 0.15 ms to 0.03 ms and the moonlet-shape
# FP8 layer from 1.99x to 1.36x the bf16 layer's time (issue 36, 2026-12-04), and the H100 run of bench/RESULTS.md
# "CuTeDSL schedules" launched through it. dlpack stays for a machine without
# tvm_ffi (set LAUNCH = "dlpack"; cutedsl_unavailable names the missing package otherwise).
# bench/moe_bench.py --launch both times the two; tests/unit/test_experts_cutedsl.py compares them bit for bit.
LAUNCH = "tvm-ffi"
LAUNCHES = ("dlpack", "tvm-ffi")


def _unit_mode(t: torch.Tensor) -> int:
    """The mode with stride 1 (of more than one element, where there is one)."""
    return next((i for i, s in enumerate(t.stride()) if s == 1 and t.shape[i] > 1), t.stride().index(1))


def _as_cute(t: torch.Tensor, compact: bool = False):
    """A cute tensor over t's memory with dynamic shape and strides (the stride-1 mode stays static). `compact`
    (an output we allocated): also tell the compiler that the contiguous mode has a multiple of 8 elements,
    so that every row starts 16-byte aligned."""
    from cutlass.cute.runtime import from_dlpack

    unit = _unit_mode(t)
    ct = from_dlpack(t.detach(), assumed_align=16)  # autograd's inputs still require grad; DLPack refuses those
    if not compact:
        return ct.mark_layout_dynamic(leading_dim=unit)
    for mode in range(t.dim()):
        ct = ct.mark_compact_shape_dynamic(mode, divisibility=8 if mode == unit else 1)
    return ct


def _spec(t: torch.Tensor, compact: bool = False):
    """What a TVM-FFI compile is specialized on, from t's metadata alone (no device memory: it compiles anywhere,
    checked on this CPU): t's element type and rank, 16-byte alignment, its stride-1 mode static and every other
    stride and every extent dynamic; `compact` as in _as_cute. Each call checks its tensors against it in C++."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    types = {
        torch.bfloat16: cutlass.BFloat16,
        torch.float8_e4m3fn: cutlass.Float8E4M3FN,
        torch.float32: cutlass.Float32,
        torch.int32: cutlass.Int32,
    }
    if t.dtype not in types:
        raise TypeError(f"the CuTeDSL kernels take {', '.join(map(str, types))} tensors, not {t.dtype}")
    unit = _unit_mode(t)
    shape = tuple(cute.sym_int32(divisibility=8 if compact and m == unit else 1) for m in range(t.dim()))
    stride = tuple(1 if m == unit else cute.sym_int64() for m in range(t.dim()))
    return make_fake_tensor(types[t.dtype], shape, stride, assumed_align=16)


def _check_aligned(tensors) -> None:
    for t in tensors:
        if t.data_ptr() % 16:
            raise ValueError(f"tensor of shape {tuple(t.shape)} is not 16-byte aligned; pass a fresh (.clone()) tensor")


@functools.cache
def import_error(module: str, package: str, fix: str) -> str | None:
    """None if `module` imports, else why `package` is missing and `fix`."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return f"{package} is not importable ({exc}); {fix}"
    return None


def _tvm_ffi_error() -> str | None:
    return import_error(
        "tvm_ffi",
        "apache-tvm-ffi",
        "grouped.LAUNCH = 'tvm-ffi' launches the CuTeDSL kernels through it: install the `gpu` extra "
        "(pip install -e '.[gpu]') or set LAUNCH = 'dlpack'",
    )


def call(cache: dict, key: tuple, jit_fn, tensors, compact: tuple[int, ...] = ()) -> None:
    """Launch `jit_fn` on `tensors` on the current stream, compiled on first use per `key` and LAUNCH (shapes
    and strides are dynamic, so one compile serves every size). `compact`: the indices of tensors we allocated
    (outputs), whose contiguous mode is a multiple of 8 elements."""
    import cutlass.cute as cute

    _check_aligned(tensors)
    full = (*key, LAUNCH)
    fn = cache.get(full)
    if LAUNCH == "tvm-ffi":
        if fn is None:
            if (why := _tvm_ffi_error()) is not None:
                raise RuntimeError(why)
            from cutlass.cute.runtime import make_fake_stream

            args = [_spec(t, compact=i in compact) for i, t in enumerate(tensors)]
            stream = make_fake_stream(use_tvm_ffi_env_stream=True)
            fn = cache[full] = cute.compile(jit_fn, *args, stream, options="--enable-tvm-ffi")
        fn(*[t.detach() for t in tensors])
    elif LAUNCH == "dlpack":
        args = [_as_cute(t, compact=i in compact) for i, t in enumerate(tensors)]
        if fn is None:
            fn = cache[full] = cute.compile(jit_fn, *args, _stream())
        fn(*args, _stream())
    else:
        raise ValueError(f"grouped.LAUNCH = {LAUNCH!r} is not one of {LAUNCHES}")


def _with_batch(t: torch.Tensor) -> torch.Tensor:
    """[R, C] -> [R, C, 1] with a batch stride of R*C, so that no two modes claim stride 1."""
    return t.as_strided((*t.shape, 1), (*t.stride(), t.numel()))


def _output(*shape: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), device=device, dtype=dtype)
    return torch.empty(shape, device=device, dtype=dtype)


def _stream():
    import cuda.bindings.driver as cuda_driver

    return cuda_driver.CUstream(torch.cuda.current_stream().cuda_stream)


@functools.cache
def _kernel(grouping: str, config: TileConfig, sm_count: int, scaled: bool):
    from trainer.experts.cutedsl.kernel import GroupedGemm

    return GroupedGemm(
        grouping,
        config.tile_mn,
        config.stages,
        config.warpgroups,
        config.pair_stores,
        sm_count,
        config.smem_epilogue,
        scaled,
        config.cluster_n,
        config.overlap,
        config.tma_scales,
        config.smem_epilogue_fp32,
    )


_COMPILED: dict[tuple, object] = {}


def _launch(grouping: str, config: TileConfig, a, b, c, offsets, item_expert, item_row, sfa=None, sfb=None) -> None:
    """One kernel launch (compiled on first use per variant). sfa/sfb given: the FP8 block-scaled kernel."""
    scaled = sfa is not None
    n_tiles = -(-c.shape[1] // config.tile_mn[1])
    if n_tiles % config.cluster_n:  # a cluster's CTAs take adjacent n-tiles: the count must split evenly
        config = _single_ctas(config)
    if not scaled:  # the kernel ignores them; any tensors of a fixed type keep one compile per variant
        sfa, sfb = offsets, offsets
    tensors = (a, b, c, offsets, item_expert, item_row, sfa, sfb)
    key = (grouping, config, scaled, *((t.dtype, _unit_mode(t)) for t in tensors))
    ctas = _resident_ctas(a.device, config.cluster_n)
    call(_COMPILED, key, _kernel(grouping, config, ctas, scaled), tensors, compact=(2,))


@functools.cache
def _single_ctas(config: TileConfig) -> TileConfig:
    """`config` without clusters (made once per config: it is on every launch's path)."""
    return dataclasses.replace(config, cluster_n=1)


@functools.cache
def _resident_ctas(device: torch.device, cluster_n: int) -> int:
    """How many CTAs of the persistent grid run at once: one per SM, or for clusters of two, twice the clusters
    the GPU can hold at once (an SM left over in a GPC cannot take a pair), so that no cluster waits for another
    to finish."""
    if cluster_n == 1:
        return torch.cuda.get_device_properties(device).multi_processor_count
    import cutlass.utils

    with torch.cuda.device(device):
        return cutlass.utils.HardwareInfo().get_max_active_clusters(cluster_n) * cluster_n


def work_items(offsets: torch.Tensor, rows: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `m` grouping's work items: item t covers rows [item_row[t], +bm) of expert item_expert[t] (cut at
    the expert's end), -1 for items past the last tile. Built with device ops from the offsets (no sync);
    the table has room for the worst case, ceil(rows / bm) + E items."""
    E = offsets.numel()
    ends = offsets.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    tiles = (counts + bm - 1) // bm
    cum = tiles.cumsum(0)
    t = torch.arange((rows + bm - 1) // bm + E, device=offsets.device)
    e = torch.searchsorted(cum, t, right=True)
    live = e < E
    e = e.clamp(max=E - 1)
    row = ends[e] - counts[e] + (t - (cum[e] - tiles[e])) * bm
    return torch.where(live, e, -1).int(), torch.where(live, row, 0).int()


def m_grouped(
    a: torch.Tensor,
    b_nke: torch.Tensor,
    offsets: torch.Tensor,
    items: tuple[torch.Tensor, torch.Tensor],
    config: TileConfig | None = None,
) -> torch.Tensor:
    """c[rows of expert e] = a[rows of e] @ b_nke[:, :, e]^T.  a [M, K] (K contiguous), b_nke (N, K, E) with K
    or N contiguous, offsets [E] int32 running ends, items from `work_items(offsets, M, BM)`. Returns [M, N]
    in a's dtype. `config` defaults to M_CONFIG as it is at the call."""
    config = config or M_CONFIG
    M, K = a.shape
    N = b_nke.shape[0]
    c = _output(M, N, device=a.device, dtype=a.dtype)
    if M:
        _launch("m", config, _with_batch(a), b_nke, _with_batch(c), offsets, *items)
    return c


def m_grouped_scaled(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    offsets: torch.Tensor,
    items: tuple[torch.Tensor, torch.Tensor],
    config: TileConfig | None = None,
) -> torch.Tensor:
    """The FP8 m_grouped: c[rows of e] = (a * a_scale)[rows of e] @ (b[e] * b_scale[e])^T in bf16.  a [M, K]
    e4m3, a_scale [ceil(K/128), M] fp32 (one per row and 128 columns), b [E, N, K] e4m3 (K contiguous),
    b_scale [E, ceil(N/128), ceil(K/128)] fp32 (one per 128x128 block); items from `work_items(offsets, M, 128)`.
    `config` defaults to FP8_CONFIG as it is at the call."""
    config = config or FP8_CONFIG
    M = a.shape[0]
    c = _output(M, b.shape[1], device=a.device, dtype=torch.bfloat16)
    if M:
        if config.tma_scales:
            a_scale, b_scale = _tma_rows(a_scale), _tma_rows(b_scale)
        _launch(
            "m",
            config,
            _with_batch(a),
            b.permute(1, 2, 0),
            _with_batch(c),
            offsets,
            *items,
            a_scale,
            b_scale.permute(1, 2, 0),
        )
    return c


def _tma_rows(t: torch.Tensor) -> torch.Tensor:
    """t (contiguous, fp32) where TMA can read it: every stride but the last a multiple of 16 bytes. Else a copy
    whose rows are padded to a multiple of 4 elements, as a view of t's shape (the kernel's tma_scales reads the
    scales by TMA; one row of A's scales spans the M rows, one of B's the K / 128 blocks)."""
    if t.data_ptr() % 16 == 0 and all(st % 4 == 0 for st in t.stride()[:-1]):
        return t
    padded = t.new_zeros(*t.shape[:-1], -(-t.shape[-1] // 4) * 4)
    padded[..., : t.shape[-1]] = t
    return padded[..., : t.shape[-1]]


def k_grouped(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    out_dtype: torch.dtype,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """c[e] = a[rows of e]^T @ b[rows of e] for every expert e.  a [R, M], b [R, N] token-major (contiguous),
    offsets [E] int32 running ends of the rows. Returns [E, M, N] in out_dtype (zeros for an empty expert).
    `config` defaults to K_CONFIG as it is at the call."""
    config = config or K_CONFIG
    R, M = a.shape
    N = b.shape[1]
    E = offsets.numel()
    c = _output(E, M, N, device=a.device, dtype=out_dtype)
    dummy = offsets[:1]
    _launch("k", config, _with_batch(a.t()), _with_batch(b.t()), c.permute(1, 2, 0), offsets, dummy, dummy)
    return c


def k_grouped_scaled(
    a_t: torch.Tensor,
    a_scale: torch.Tensor,
    b_t: torch.Tensor,
    b_scale: torch.Tensor,
    ends: torch.Tensor,
    out_dtype: torch.dtype,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """The FP8 weight gradient: c[e] = (a_t * a_scale)[:, tokens of e] @ (b_t * b_scale)[:, tokens of e]^T for
    every expert e, from the operands of trainer.experts.fp8.quantize_tokens_t: a_t [M, P] and b_t [N, P] e4m3
    (tokens contiguous, each expert's starting at a multiple of 128), a_scale [P / 128, M] and b_scale
    [P / 128, N] fp32, ends [E] int32 (the experts' padded running ends). Returns [E, M, N] in out_dtype (zeros
    for an empty expert). `config` defaults to FP8_WGRAD_CONFIG as it is at the call."""
    config = config or FP8_WGRAD_CONFIG
    M, N, E = a_t.shape[0], b_t.shape[0], ends.numel()
    c = _output(E, M, N, device=a_t.device, dtype=out_dtype)
    dummy = ends[:1]
    _launch(
        "k",
        config,
        _with_batch(a_t),
        _with_batch(b_t),
        c.permute(1, 2, 0),
        ends,
        dummy,
        dummy,
        _tma_rows(a_scale),
        _tma_rows(b_scale),
    )
    return c


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t contiguous and 16-byte aligned (TMA and the DLPack export ask for it); a copy only if it is not."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


# The two GEMMs as torch custom ops, so that torch.compile (compile_blocks) keeps them as opaque calls instead
# of tracing into the DSL's host code. The weights go in whole ([E, N, K] as stored, contiguous) with the
# view taken inside, so that no compiler pass has to preserve a permuted stride order.
@torch.library.custom_op("slipstream::cutedsl_m_grouped", mutates_args=())
def m_grouped_op(
    a: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    item_expert: torch.Tensor,
    item_row: torch.Tensor,
    transpose_w: bool,
) -> torch.Tensor:
    """m_grouped over w [E, N, K] (or, with transpose_w, w [E, K, N] read transposed) with the module config."""
    w = _aligned(w)
    return m_grouped(
        _aligned(a), w.permute(2, 1, 0) if transpose_w else w.permute(1, 2, 0), offsets, (item_expert, item_row)
    )


@m_grouped_op.register_fake
def _(a, w, offsets, item_expert, item_row, transpose_w):
    return a.new_empty(a.shape[0], w.shape[2] if transpose_w else w.shape[1])


@torch.library.custom_op("slipstream::cutedsl_k_grouped", mutates_args=())
def k_grouped_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """k_grouped with the module config."""
    return k_grouped(_aligned(a), _aligned(b), offsets, out_dtype)


@k_grouped_op.register_fake
def _(a, b, offsets, out_dtype):
    return a.new_empty(offsets.shape[0], a.shape[1], b.shape[1], dtype=out_dtype)


@torch.library.custom_op("slipstream::cutedsl_m_grouped_scaled", mutates_args=())
def m_grouped_scaled_op(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    offsets: torch.Tensor,
    item_expert: torch.Tensor,
    item_row: torch.Tensor,
) -> torch.Tensor:
    """m_grouped_scaled over w [E, N, K] e4m3 with its block scales, with the module config."""
    return m_grouped_scaled(
        _aligned(a), a_scale.contiguous(), _aligned(w), w_scale.contiguous(), offsets, (item_expert, item_row)
    )


@m_grouped_scaled_op.register_fake
def _(a, a_scale, w, w_scale, offsets, item_expert, item_row):
    return a.new_empty(a.shape[0], w.shape[1], dtype=torch.bfloat16)


@torch.library.custom_op("slipstream::cutedsl_k_grouped_scaled", mutates_args=())
def k_grouped_scaled_op(
    a_t: torch.Tensor,
    a_scale: torch.Tensor,
    b_t: torch.Tensor,
    b_scale: torch.Tensor,
    ends: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """k_grouped_scaled with the module config."""
    return k_grouped_scaled(_aligned(a_t), a_scale.contiguous(), _aligned(b_t), b_scale.contiguous(), ends, out_dtype)


@k_grouped_scaled_op.register_fake
def _(a_t, a_scale, b_t, b_scale, ends, out_dtype):
    return a_t.new_empty(ends.shape[0], a_t.shape[0], b_t.shape[0], dtype=out_dtype)
