"""The CuTeDSL kernel: a Hopper (sm_90a) grouped GEMM, C[g] = A[g] @ B[g]^T for every expert g, with fp32
accumulation, in bf16 or in FP8 e4m3 with block scales. TMA brings A and B tiles into a ring of shared-memory
stages (one mbarrier pair per stage), warpgroup MMAs (wgmma) consume them, and the epilogue writes the
accumulators to global memory with a row/column guard, so that a tile never writes rows that belong to the
next expert: from registers (2-byte elements, or 4/8-byte pairs of adjacent columns), or staged through shared
memory as 16-byte row segments (16-bit outputs; fp32 ones with `smem_epilogue_fp32`). No TMA store: it cannot
stop at an expert's last row.

Two groupings cover the expert forward and backward:

- `m`: the rows of A and C are grouped (tokens sorted by expert; forward GEMMs and dgrad). A is [M, K] with
  K contiguous, B is one [N, K] matrix per expert (K- or N-contiguous: the forward uses the weights as
  stored, the dgrad their transpose), C is [M, N]. Work item (n-tile, t): table entry t is (expert, first
  row), built on the device by the host wrapper (no host sync); an entry past the last real tile is idle.
- `k`: the reduction runs over an expert's rows (wgrad). A is [M, K] and B is [N, K], both M/N-contiguous
  (token-major activations read transposed), C is one [M, N] matrix per expert. Work item (n-tile, m-tile,
  expert); the last k-tile of an expert is cut at its end by zeroing, in shared memory, the rows of the
  next expert that TMA brought in.

FP8 (`scaled`, `m` grouping only): A and B are e4m3, both K-contiguous (the only FP8 wgmma layout), with
DeepSeek-V3's scales: one fp32 per row of A and 128 columns of K (`sfa`, (K/128, M)), one per 128x128 block of
B (`sfb`, (N/128, K/128, E)). A k-tile is 128 deep, one scale block: its wgmmas accumulate into a temporary
that is then added, times the row's A scale and the tile's B scale, to the fp32 accumulator (the promotion of
DeepSeek-V3 sec. 3.3.2, which also keeps the sum out of the tensor cores' limited-precision accumulation).

One schedule: one CTA per SM walks the work items, with a producer warpgroup (TMA, few registers) and two
consumer warpgroups of 64 rows each (wgmma), so that the loads of the next tile run under the epilogue of this
one. Three options change where the data comes from and when, not what is added (their results are bitwise those
of the plain schedule): `cluster_n = 2` pairs the CTAs in clusters that take adjacent n-tiles of the same rows,
each loading half of every A tile and multicasting it to both (A's reads from L2 halve); `overlap` (FP8) keeps
two partial accumulators, so that k-tile t + 1's wgmmas run while k-tile t's partial is promoted; `tma_scales` (FP8,
the default) has the producer's TMA bring each k-tile's scales into the stage beside its A and B tiles, so that
the consumers read them from shared memory instead of waiting on global loads every k-tile (DeepGEMM's design).
Every warp loads the work-item table entry of its next item one item ahead, under the current one.

A Blackwell variant (tcgen05, tensor memory, MXFP8 scales) would be another kernel class with the same work
items, operand views and epilogue guard; none is written (it cannot run here).

Imported only on first use (grouped.py), so that the package imports where `cutlass` is missing."""

from __future__ import annotations

import cuda.bindings.driver as cuda_driver
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

WARPGROUP = 128
PRODUCER_REGS = 40
CONSUMER_REGS = 232
SMEM_BYTES = 232448  # the most dynamic shared memory a CTA may have on sm_90 (227 KB)
SFB_BOX = 4  # B scales per TMA box: 16 bytes, the least a box may span along the contiguous mode
SFB_SLOT = 32  # words per stage of the B scales in shared memory (128 bytes, a TMA destination's alignment)
# A box must start 16 bytes into a row: an item's rows of A scales start at its first row rounded down to a multiple
# of 4 (up to 3 rows before it), so the box spans BM + SFA_LEAD rows, in a stage slot of SFA_SLOT words.
SFA_LEAD = 4
SFA_SLOT = 160


class GroupedGemm:
    """One compiled variant: grouping (`m` or `k`), CTA tile (BM, BN) of 64 rows per consumer warpgroup,
    pipeline stages, epilogue store width, and bf16 or block-scaled FP8 (`scaled`). BK is one 128-byte swizzle
    atom: 64 bf16 or 128 e4m3 elements (an FP8 k-tile is exactly one scale block)."""

    def __init__(
        self,
        grouping: str,
        tile_mn: tuple[int, int],
        stages: int,
        warpgroups: int,
        pair_stores: bool = False,
        sm_count: int = 132,
        smem_epilogue: bool = False,
        scaled: bool = False,
        cluster_n: int = 1,
        overlap: bool = False,
        tma_scales: bool = False,
        smem_epilogue_fp32: bool = False,
    ) -> None:
        if grouping not in ("m", "k"):
            raise ValueError(f"grouping must be 'm' or 'k', got {grouping!r}")
        if tile_mn[0] != 64 * warpgroups:
            raise ValueError(f"tile {tile_mn} with {warpgroups} warpgroups: BM must be 64 per warpgroup")
        if tile_mn[1] not in (64, 128, 256):
            raise ValueError(f"tile {tile_mn}: BN must be 64/128/256")
        if (smem_epilogue or smem_epilogue_fp32) and tile_mn[1] % 128:
            raise ValueError("the shared-memory epilogue needs BN % 128 == 0")
        if scaled and tile_mn[1] != 128:
            # m: one B scale per k-tile needs BN = the 128-row weight block; both: the fp32 accumulator and its
            # per-k-tile partial would not fit in registers at 256.
            raise ValueError(f"FP8 block scales run with BN = 128, not {tile_mn}")
        if scaled and grouping == "k" and not tma_scales:
            # The k grouping's B scales are per column: TMA brings the tile's 128 with each stage.
            raise ValueError("the FP8 k grouping (weight gradients) takes its scales by TMA: tma_scales=True")
        if cluster_n not in (1, 2):
            raise ValueError(f"cluster_n must be 1 or 2, got {cluster_n}")
        if overlap and not scaled:
            raise ValueError("overlap (two FP8 partial accumulators) is a schedule of the scaled kernel")
        if tma_scales and (not scaled or overlap):
            raise ValueError(
                "tma_scales brings the scales with each stage: a schedule of the scaled kernel, not overlap"
            )
        self.grouping = grouping
        self.scaled = scaled
        # CTAs per cluster along N: the pair works on the same rows of A (one work item) and adjacent n-tiles,
        # and each CTA loads half of every A tile and multicasts it to both (half the A reads from L2).
        self.cluster_n = cluster_n
        # FP8: the wgmmas of k-tile t + 1 run while k-tile t's partial is promoted (two partials in registers).
        self.overlap = overlap
        # FP8: the producer's TMA brings each k-tile's scales into the stage with its A and B tiles (the item's rows
        # of sfa, and of sfb the 16 bytes holding the block's scale (`m`) or the tile's columns (`k`)), so that
        # the consumers read them from shared memory instead of waiting on global loads.
        self.tma_scales = tma_scales
        # Words per stage of the B scales in shared memory.
        self.sfb_words = SFB_SLOT if grouping == "m" else tile_mn[1]
        self.tile = (tile_mn[0], tile_mn[1], 128 if scaled else 64)
        self.stages = stages
        self.warpgroups = warpgroups
        self.sm_count = sm_count
        self.mma_threads = WARPGROUP * warpgroups
        self.threads = self.mma_threads + WARPGROUP
        self.acc_dtype = cutlass.Float32
        # Store the two adjacent columns each thread holds as one 4- (bf16) or 8-byte (fp32) word.
        self.pair_stores = pair_stores
        # 16-bit outputs: stage each warpgroup's 64 rows in shared memory, 128 columns at a time, and write
        # them back as 16-byte row segments (coalesced) instead of the 4-byte pairs of the MMA layout.
        self.smem_epilogue = smem_epilogue
        # The same for fp32 outputs (the weight gradients), in 16-byte segments of 4 columns instead of the 8-byte
        # pairs, which scatter each warp's store over 8 rows: 70 KB of shared memory, which a tile of 128x128 FP8
        # with 4 stages leaves free.
        self.smem_epilogue_fp32 = smem_epilogue_fp32

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,
        b: cute.Tensor,
        c: cute.Tensor,
        offsets: cute.Tensor,
        item_expert: cute.Tensor,
        item_row: cute.Tensor,
        sfa: cute.Tensor,
        sfb: cute.Tensor,
        stream: cuda_driver.CUstream,
    ):
        """a (M, K, 1), b (N, K, E or 1), c (M, N, 1 or E); offsets [E] int32 running ends of the groups;
        item_expert / item_row [T] the work items of the `m` grouping (ignored by `k`); sfa (K/128, M) and
        sfb (N/128, K/128, E) fp32 scales when `scaled` (ignored otherwise)."""
        BM, BN, BK = self.tile
        # The epilogue's staging rows: 128 columns of 4-byte words (fp32) or pairs (16-bit), padded by 32 or 16
        # bytes so that the pair stores of 8 rows (or of the 4 rows of a half-warp's 8-byte stores) fall in
        # different banks.
        wide = c.element_type.width == 32
        self.staged = (self.smem_epilogue and c.element_type.width == 16) or (self.smem_epilogue_fp32 and wide)
        self.epi_pitch = 136 if wide else 68
        self.epi_words = self.warpgroups * 64 * self.epi_pitch if self.staged else 4
        a_layout = LayoutEnum.from_tensor(a)
        b_layout = LayoutEnum.from_tensor(b)
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            a.element_type,
            b.element_type,
            a_layout.sm90_mma_major_mode(),
            b_layout.sm90_mma_major_mode(),
            self.acc_dtype,
            (self.warpgroups, 1, 1),
            tiler_mn=(64, BN),
        )
        a_smem = sm90_utils.make_smem_layout_a(a_layout, self.tile, a.element_type, self.stages)
        b_smem = sm90_utils.make_smem_layout_b(b_layout, self.tile, b.element_type, self.stages)
        if cutlass.const_expr(self.cluster_n > 1):
            tma_a, tma_tensor_a = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SMulticastOp(),
                a,
                cute.slice_(a_smem, (None, None, 0)),
                (BM, BK),
                num_multicast=self.cluster_n,
            )
        else:
            tma_a, tma_tensor_a = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), a, cute.slice_(a_smem, (None, None, 0)), (BM, BK)
            )
        tma_b, tma_tensor_b = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), b, cute.slice_(b_smem, (None, None, 0)), (BN, BK)
        )
        # The scales' TMA (tma_scales): per stage BM rows of sfa (one k-tile) and a 16-byte box of sfb along its
        # contiguous K/128 mode holding the k-tile's scale, each stage in its own 128-byte aligned slot.
        # Placeholders (A's atom, the global tensors, unit layouts) where the scales come by global loads.
        sfa_smem = cute.make_layout(1)
        sfb_smem = cute.make_layout(1)
        tma_sfa, tma_tensor_sfa, tma_sfb, tma_tensor_sfb = tma_a, sfa, tma_a, sfb
        if cutlass.const_expr(self.tma_scales):
            sfa_smem = cute.make_layout((1, BM + SFA_LEAD, self.stages), stride=(SFA_SLOT, 1, SFA_SLOT))
            tma_sfa, tma_tensor_sfa = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), sfa, cute.slice_(sfa_smem, (None, None, 0)), (1, BM + SFA_LEAD)
            )
            if cutlass.const_expr(self.grouping == "m"):
                sfb_smem = cute.make_layout((1, SFB_BOX, 1, self.stages), stride=(SFB_BOX, 1, SFB_BOX, SFB_SLOT))
                tma_sfb, tma_tensor_sfb = cpasync.make_tiled_tma_atom(
                    cpasync.CopyBulkTensorTileG2SOp(),
                    sfb,
                    cute.slice_(sfb_smem, (None, None, None, 0)),
                    (1, SFB_BOX, 1),
                )
            else:  # the k-tile's scales of the tile's BN columns: (P / 128, N), N contiguous
                sfb_smem = cute.make_layout((1, BN, self.stages), stride=(BN, 1, BN))
                tma_sfb, tma_tensor_sfb = cpasync.make_tiled_tma_atom(
                    cpasync.CopyBulkTensorTileG2SOp(), sfb, cute.slice_(sfb_smem, (None, None, 0)), (1, BN)
                )
        self.storage = self.shared_storage(a.element_type, b.element_type, a_smem, b_smem)
        if cutlass.const_expr(self.storage.size_in_bytes() > SMEM_BYTES):
            raise ValueError(
                f"tile {self.tile[:2]} with {self.stages} stages needs {self.storage.size_in_bytes()} bytes of shared"
                f" memory, more than the {SMEM_BYTES} a Hopper CTA may have: fewer stages or a smaller tile"
            )
        self.a_dtype, self.b_dtype = a.element_type, b.element_type
        n_pairs = (c.shape[1] + BN * self.cluster_n - 1) // (BN * self.cluster_n)
        if cutlass.const_expr(self.grouping == "m"):
            slots = item_expert.shape[0]
        else:
            slots = ((c.shape[0] + BM - 1) // BM) * c.shape[2]
        clusters = cutlass.min(n_pairs * slots, self.sm_count // self.cluster_n)
        grid = (clusters * self.cluster_n, 1, 1)
        self.kernel(
            tiled_mma,
            tma_a,
            tma_tensor_a,
            tma_b,
            tma_tensor_b,
            c,
            offsets,
            item_expert,
            item_row,
            sfa,
            sfb,
            a_smem,
            b_smem,
            tma_sfa,
            tma_tensor_sfa,
            tma_sfb,
            tma_tensor_sfb,
            sfa_smem,
            sfb_smem,
        ).launch(grid=grid, block=[self.threads, 1, 1], cluster=(self.cluster_n, 1, 1), stream=stream)

    def shared_storage(self, a_type, b_type, a_smem, b_smem):
        """The kernel's shared memory as a struct: the stages' barriers and A and B tiles, the epilogue's staging
        words and, with tma_scales, the stages' scales (left out otherwise: the bf16 128x256 4-stage config fills
        the 227 KB to the byte). Built from a field dict, since this module's annotations are strings."""
        MemRange, Align = cute.struct.MemRange, cute.struct.Align
        fields = {
            "barriers": MemRange[cutlass.Int64, self.stages * 2],
            "sA": Align[MemRange[a_type, cute.cosize(a_smem)], 1024],
            "sB": Align[MemRange[b_type, cute.cosize(b_smem)], 1024],
            # Per consumer warpgroup 64 rows x (64 + 4) 32-bit words: 128 bf16 columns, rows padded by 16 bytes
            # so that the 4-byte pair stores of 8 rows fall in different banks.
            "sC": Align[MemRange[cutlass.Int32, self.epi_words], 128],
        }
        if self.tma_scales:
            fields["sSFA"] = Align[MemRange[cutlass.Float32, SFA_SLOT * self.stages], 128]
            fields["sSFB"] = Align[MemRange[cutlass.Float32, self.sfb_words * self.stages], 128]
        return cute.struct(type("Storage", (), {"__annotations__": fields}))

    @cute.jit
    def item_entry(self, tables, w):
        """What work item w (clamped to the last) reads from global memory: (expert, first row, the expert's end
        row). `m`: its slot's table entry (expert -1: idle, the end then meaningless) and the end of its expert;
        `k`: the expert of its slot (m_tiles slots an expert) and its rows. Loaded one item ahead of its use (the
        kernel's loops), so that these dependent loads hide under the item before. tables = (item_expert,
        item_row, offsets, m_tiles, n_pairs, items)."""
        item_expert, item_row, offsets, m_tiles, n_pairs, items = tables
        slot = cutlass.min(w, items - 1) // n_pairs
        e = cutlass.Int32(0)
        r = cutlass.Int32(0)
        if cutlass.const_expr(self.grouping == "m"):
            e = item_expert[slot]
            r = item_row[slot]
        else:
            e = slot // m_tiles
            if e > 0:
                r = offsets[e - 1]
        return e, r, offsets[cutlass.max(e, 0)]

    @cute.jit
    def work_item(self, mA, mB, mC, mSFA, mSFB, entry, n_tile, slot):
        """The tiles of work item (n_tile, slot), `entry` its item_entry: TMA coordinate tensors gA (BM, BK, restK),
        gB (BN, BK, restK) and, with tma_scales, gSFA (1, BM + SFA_LEAD, restK) from row0 rounded down to a
        multiple of SFA_LEAD and gSFB (1, SFB_BOX, 1, restK / SFB_BOX); the output tile gC (BM, BN), the k-tiles
        to run, the valid k of the last one, the valid rows and columns of gC, the expert and the item's first
        row of A (`m`). An idle item has no k-tiles and no valid rows."""
        BM, BN, BK = self.tile
        zero = cutlass.Int32(0)
        k_tiles = zero
        k_rem = cutlass.Int32(BK)
        rows = zero
        cols = cutlass.min(mC.shape[1] - n_tile * BN, BN)
        expert = zero
        row0 = zero  # first row of A/C (`m`) or first k (`k`)
        m_tile = zero
        e, r, end = entry
        if cutlass.const_expr(self.grouping == "m"):
            if e >= 0:
                expert = e
                row0 = r
                rows = cutlass.min(end - row0, BM)
                k_tiles = (mA.shape[1] + BK - 1) // BK
        else:
            m_tiles = (mC.shape[0] + BM - 1) // BM
            m_tile = slot % m_tiles
            expert = e
            row0 = r
            k_len = end - row0
            k_tiles = (k_len + BK - 1) // BK
            k_rem = k_len - (k_tiles - 1) * BK
            rows = cutlass.min(mC.shape[0] - m_tile * BM, BM)
        if cutlass.const_expr(self.grouping == "m"):
            gA = cute.local_tile(
                cute.domain_offset((row0, 0, 0), mA), self.tile, (0, n_tile, None, 0), proj=(1, None, 1)
            )
            gB = cute.local_tile(mB, self.tile, (0, n_tile, None, expert), proj=(None, 1, 1))
            gC = cute.local_tile(
                cute.domain_offset((row0, 0, 0), mC), self.tile, (0, n_tile, None, 0), proj=(1, 1, None)
            )
        else:
            gA = cute.local_tile(
                cute.domain_offset((0, row0, 0), mA), self.tile, (m_tile, n_tile, None, 0), proj=(1, None, 1)
            )
            gB = cute.local_tile(
                cute.domain_offset((0, row0, 0), mB), self.tile, (m_tile, n_tile, None, 0), proj=(None, 1, 1)
            )
            gC = cute.local_tile(mC, self.tile, (m_tile, n_tile, None, expert), proj=(1, 1, None))
        gSFA, gSFB = mSFA, mSFB
        if cutlass.const_expr(self.tma_scales and self.grouping == "m"):
            gSFA = cute.local_tile(cute.domain_offset((0, row0 - row0 % SFA_LEAD), mSFA), (1, BM + SFA_LEAD), (None, 0))
            gSFB = cute.local_tile(mSFB, (1, SFB_BOX, 1), (n_tile, None, expert))
        if cutlass.const_expr(self.tma_scales and self.grouping == "k"):
            # The expert's k-blocks start at its first (padded, 128-aligned) token: row0 / BK.
            gSFA = cute.local_tile(cute.domain_offset((row0 // BK, m_tile * BM), mSFA), (1, BM + SFA_LEAD), (None, 0))
            gSFB = cute.local_tile(cute.domain_offset((row0 // BK, n_tile * BN), mSFB), (1, BN), (None, 0))
        return gA, gB, gC, gSFA, gSFB, k_tiles, k_rem, rows, cols, expert, row0

    @cute.jit
    def load_tile(self, ring, load, tma_a, tma_b, sA, sB, gA, gB, k_tiles, first_kt, rank, a_mask, scale_tiles):
        """Issue the TMA loads of k-tiles [first_kt, k_tiles) of one work item (the calling warp). In a cluster,
        this CTA (`rank`) loads its share of each A tile for every CTA of `a_mask`. scale_tiles, with
        tma_scales: (tma_sfa, sSFA, gSFA, tma_sfb, sSFB, gSFB), each k-tile's scales into the same stage."""
        tAsA, tAgA = cpasync.tma_partition(
            tma_a,
            rank,
            cute.make_layout(self.cluster_n),
            cute.group_modes(sA, 0, 2),
            cute.group_modes(gA, 0, 2),
        )
        tBsB, tBgB = cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
        )
        tma_sfa, sSFA, gSFA, tma_sfb, sSFB, gSFB = scale_tiles
        tSAs, tSAg, tSBs, tSBg = sSFA, gSFA, sSFB, gSFB
        if cutlass.const_expr(self.tma_scales):
            tSAs, tSAg = cpasync.tma_partition(
                tma_sfa, 0, cute.make_layout(1), cute.group_modes(sSFA, 0, 2), cute.group_modes(gSFA, 0, 2)
            )
            sfb_modes = 3 if self.grouping == "m" else 2
            tSBs, tSBg = cpasync.tma_partition(
                tma_sfb,
                0,
                cute.make_layout(1),
                cute.group_modes(sSFB, 0, sfb_modes),
                cute.group_modes(gSFB, 0, sfb_modes),
            )
        for kt in cutlass.range(first_kt, k_tiles, 1, unroll=1):
            ring.producer_acquire(load)
            bar = ring.producer_get_barrier(load)
            if cutlass.const_expr(self.cluster_n > 1):
                cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, load.index)], tma_bar_ptr=bar, mcast_mask=a_mask)
            else:
                cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, load.index)], tma_bar_ptr=bar)
            cute.copy(tma_b, tBgB[(None, kt)], tBsB[(None, load.index)], tma_bar_ptr=bar)
            if cutlass.const_expr(self.tma_scales):
                cute.copy(tma_sfa, tSAg[(None, kt)], tSAs[(None, load.index)], tma_bar_ptr=bar)
                sfb_tile = kt // SFB_BOX if self.grouping == "m" else kt
                cute.copy(tma_sfb, tSBg[(None, sfb_tile)], tSBs[(None, load.index)], tma_bar_ptr=bar)
            ring.producer_commit(load)
            load.advance()
        return load

    @cute.jit
    def zero_k_tail(self, sA, sB, stage, k_rem, mma_tidx):
        """Zero k in [k_rem, BK) of one stage of A and B (the consumer threads together), then make the
        writes visible to the tensor cores."""
        BM, BN, BK = self.tile
        dead = BK - k_rem
        for i in cutlass.range(mma_tidx, dead * BM, self.mma_threads, unroll=1):
            sA[i % BM, k_rem + i // BM, stage] = sA.element_type(0)
        for i in cutlass.range(mma_tidx, dead * BN, self.mma_threads, unroll=1):
            sB[i % BN, k_rem + i // BN, stage] = sB.element_type(0)
        cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def store_tile(self, acc, tiled_mma, gC, rows, cols, mma_tidx, sC):
        """Registers -> global memory: only this item's rows and C's columns."""
        BM, BN, BK = self.tile
        thr_mma = tiled_mma.get_slice(mma_tidx)
        tCgC = thr_mma.partition_C(gC)
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((BM, BN)))
        out = cute.make_rmem_tensor(acc.shape, gC.element_type)
        out.store(acc.load().to(gC.element_type))
        if cutlass.const_expr(self.staged):
            wg = mma_tidx // WARPGROUP
            lane = mma_tidx % WARPGROUP
            pitch = self.epi_pitch
            segs = 128 * (gC.element_type.width // 8) // 16  # 16-byte segments of 128 columns: 16 or 32 (fp32)
            pair = cutlass.Int32 if cutlass.const_expr(gC.element_type.width == 16) else cutlass.Int64
            out_w = cute.recast_tensor(out, pair)
            gW = cute.recast_tensor(gC, cutlass.Int32)  # (BM, BN / 2 or BN) words, rows 16-byte aligned
            gV = cute.zipped_divide(gW, (1, 4))  # ((1, 4), (BM, BN / 8 or BN / 4)): 16-byte segments
            sW = cute.make_tensor(sC.iterator + wg * (64 * pitch), cute.make_layout((64, pitch), stride=(pitch, 1)))
            sP = cute.recast_tensor(sW, pair)  # the row's column pairs
            sV = cute.zipped_divide(sW, (1, 4))  # ((1, 4), (64, pitch / 4))
            bar = pipeline.NamedBarrier(barrier_id=2 + wg, num_threads=WARPGROUP)
            for h in cutlass.range_constexpr(BN // 128):
                for j in cutlass.range_constexpr(cute.size(out_w)):
                    r, col = tCcC[2 * j]
                    if col // 128 == h:
                        sP[r - wg * 64, (col % 128) // 2] = out_w[j]
                bar.arrive_and_wait()
                for it in cutlass.range_constexpr(64 * segs // WARPGROUP):
                    v = lane + it * WARPGROUP
                    lr = v // segs
                    seg = v % segs
                    grow = wg * 64 + lr
                    if grow < rows and h * 128 + seg * (128 // segs) < cols:
                        # Both ends are 16-byte aligned (rows of C hold a multiple of 8 elements, padded shared
                        # rows 272 or 544 bytes); say so, since the compiler loses it through the dynamic offsets.
                        src = sV[(0, None), (lr, seg)]
                        dst = gV[(0, None), (grow, h * segs + seg)]
                        cute.autovec_copy(
                            cute.make_tensor(src.iterator.align(16), src.layout),
                            cute.make_tensor(dst.iterator.align(16), dst.layout),
                        )
                bar.arrive_and_wait()
        elif cutlass.const_expr(self.pair_stores):
            word = cutlass.Int32 if cutlass.const_expr(gC.element_type.width == 16) else cutlass.Int64
            out_w = cute.recast_tensor(out, word)
            gC_w = cute.recast_tensor(tCgC, word)
            for j in cutlass.range_constexpr(cute.size(out_w)):
                r, col = tCcC[2 * j]
                if r < rows and col < cols:  # N is a multiple of 8, so col + 1 < cols too
                    gC_w[j] = out_w[j]
        else:
            for i in cutlass.range_constexpr(cute.size(out)):
                r, col = tCcC[i]
                if r < rows and col < cols:
                    tCgC[i] = out[i]

    @cute.jit
    def mma_item(self, ring, read, release, tiled_mma, tCrA, tCrB, acc, k_tiles, k_rem, sA, sB, mma_tidx, tail):
        """The bf16 main loop of one work item: acc = sum over its k-tiles, one k-tile of wgmmas kept in flight
        so that the stage before it can be released; the `k` grouping zeroes the tail of its last k-tile."""
        BM, BN, BK = self.tile
        k_blocks = cute.size(tCrA, mode=[2])
        acc.fill(0.0)
        for kt in cutlass.range(k_tiles, unroll=1):
            ring.consumer_wait(read)
            if cutlass.const_expr(self.grouping == "k"):
                if kt == k_tiles - 1 and k_rem < BK:
                    self.zero_k_tail(sA, sB, read.index, k_rem, mma_tidx)
                    tail.arrive_and_wait()
            warpgroup.fence()
            for kb in cutlass.range_constexpr(k_blocks):
                cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, read.index)], tCrB[(None, None, kb, read.index)], acc)
            warpgroup.commit_group()
            warpgroup.wait_group(1)
            if kt > 0:
                ring.consumer_release(release)
                release.advance()
            read.advance()
        warpgroup.wait_group(0)
        if k_tiles > 0:  # the last stage of this item
            ring.consumer_release(release)
            release.advance()
        return read, release

    @cute.jit
    def scales(self, src, kt, stage):
        """k-tile kt's scales of this thread's two rows: (A scale of row a, of row b, B scale of the block). src:
        with tma_scales (sSFA, sSFB, row a, row b) in the item's tile, read from the k-tile's stage; else
        (sfa, sfb, n_tile, expert, row a, row b) in global memory."""
        if cutlass.const_expr(self.tma_scales):
            sSFA, sSFB, ra, rb = src
            return sSFA[0, ra, stage], sSFA[0, rb, stage], sSFB[0, kt % SFB_BOX, 0, stage]
        else:
            sfa, sfb, n_tile, expert, ra, rb = src
            return sfa[kt, ra], sfa[kt, rb], sfb[n_tile, kt, expert]

    @cute.jit
    def mma_item_scaled(self, ring, read, release, tiled_mma, tCrA, tCrB, acc, part, k_tiles, src):
        """The FP8 main loop of one work item: per k-tile (one scale block) the wgmmas write `part`, which is
        then added to acc times the scale of the row (sfa[k-tile, row]) and of the block (sfb[n-tile, k-tile,
        expert]); `src` says where `scales` reads them. This thread's accumulators hold two rows of A (the wgmma
        C fragment: element i is the first row where (i // 2) % 2 == 0, else the second).

        With tma_scales the scales come with the stage and are read from shared memory before it is released;
        else the k-tile's three global loads are issued under its wgmmas and awaited after them (an L2 latency
        that the MMAs of one k-tile do not cover: bench/RESULTS.md "FP8 scales by TMA")."""
        k_blocks = cute.size(tCrA, mode=[2])
        acc.fill(0.0)
        for kt in cutlass.range(k_tiles, unroll=1):
            ring.consumer_wait(read)
            row_a, row_b, block = self.scales(src, kt, read.index)
            warpgroup.fence()
            tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
            for kb in cutlass.range_constexpr(k_blocks):
                cute.gemm(tiled_mma, part, tCrA[(None, None, kb, read.index)], tCrB[(None, None, kb, read.index)], part)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            ring.consumer_release(release)
            release.advance()
            self.add_scaled(acc, part, row_a * block, row_b * block)
            read.advance()
        return read, release

    @cute.jit
    def add_scaled(self, acc, part, lo, hi):
        """acc += part times the scale of its row: `lo` for this thread's first row, `hi` for its second (the
        wgmma C fragment: element i is the first row where (i // 2) % 2 == 0)."""
        for i in cutlass.range_constexpr(cute.size(acc)):
            if cutlass.const_expr((i // 2) % 2 == 0):
                acc[i] = acc[i] + part[i] * lo
            else:
                acc[i] = acc[i] + part[i] * hi

    @cute.jit
    def issue_scaled(self, tiled_mma, tCrA, tCrB, part, stage):
        """The wgmmas of one FP8 k-tile (one scale block), accumulating into `part` (zero: `promote` clears it;
        the MMA's ACCUMULATE field stays set, since a field set inside a branch cannot be read after it),
        committed as one group."""
        k_blocks = cute.size(tCrA, mode=[2])
        warpgroup.fence()
        for kb in cutlass.range_constexpr(k_blocks):
            cute.gemm(tiled_mma, part, tCrA[(None, None, kb, stage)], tCrB[(None, None, kb, stage)], part)
        warpgroup.commit_group()

    @cute.jit
    def promote(self, acc, part, sfa, sfb, kt, n_tile, expert, rows_ab):
        """acc += part * (A scale of the row) * (B scale of the block), for k-tile kt; part = 0 for its next use."""
        sb = sfb[n_tile, kt, expert]
        self.add_scaled(acc, part, sfa[kt, rows_ab[0]] * sb, sfa[kt, rows_ab[1]] * sb)
        part.fill(0.0)

    @cute.jit
    def mma_item_scaled_k(self, ring, read, release, tiled_mma, tCrA, tCrB, acc, part, k_tiles, sSFA, sSFB, tCcC):
        """The FP8 main loop of one weight-gradient item (`k` grouping, both operands quantized per feature and
        128-token block): per k-tile the wgmmas write `part`, which is added to acc times the scale of its row
        (sSFA, the A feature) and of its column (sSFB, the B feature), both from the k-tile's stage. The stage is
        released after the promotion, which reads its column scales. tCcC: this thread's (row, column) of each
        accumulator element in the tile."""
        k_blocks = cute.size(tCrA, mode=[2])
        r_lo, _ = tCcC[0]
        r_hi, _ = tCcC[2]
        acc.fill(0.0)
        for _ in cutlass.range(k_tiles, unroll=1):
            ring.consumer_wait(read)
            row_a = sSFA[0, r_lo, read.index]
            row_b = sSFA[0, r_hi, read.index]
            warpgroup.fence()
            tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
            for kb in cutlass.range_constexpr(k_blocks):
                cute.gemm(tiled_mma, part, tCrA[(None, None, kb, read.index)], tCrB[(None, None, kb, read.index)], part)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            for i in cutlass.range_constexpr(cute.size(acc)):
                _, col = tCcC[i]
                if cutlass.const_expr((i // 2) % 2 == 0):
                    acc[i] = acc[i] + part[i] * (row_a * sSFB[0, col, read.index])
                else:
                    acc[i] = acc[i] + part[i] * (row_b * sSFB[0, col, read.index])
            ring.consumer_release(release)
            release.advance()
            read.advance()
        return read, release

    @cute.jit
    def mma_item_overlapped(
        self, ring, read, release, tiled_mma, tCrA, tCrB, acc, parts, k_tiles, sfa, sfb, n_tile, expert, rows_ab
    ):
        """mma_item_scaled with the promotion off the tensor cores' path: k-tile t's wgmmas write parts[t % 2]
        and run while parts[(t - 1) % 2] is promoted (one wgmma group kept in flight). Two k-tiles a turn of
        the loop, so that each partial is a register tensor named at compile time."""
        p0, p1 = parts
        acc.fill(0.0)
        p0.fill(0.0)
        p1.fill(0.0)
        for kt in cutlass.range(0, k_tiles, 2, unroll=1):
            ring.consumer_wait(read)
            self.issue_scaled(tiled_mma, tCrA, tCrB, p0, read.index)
            read.advance()
            if kt > 0:  # k-tile kt - 1 (in p1) is done once at most kt's group is in flight
                warpgroup.wait_group(1)
                ring.consumer_release(release)
                release.advance()
                self.promote(acc, p1, sfa, sfb, kt - 1, n_tile, expert, rows_ab)
            if kt + 1 < k_tiles:
                ring.consumer_wait(read)
                self.issue_scaled(tiled_mma, tCrA, tCrB, p1, read.index)
                read.advance()
                warpgroup.wait_group(1)
                ring.consumer_release(release)
                release.advance()
                self.promote(acc, p0, sfa, sfb, kt, n_tile, expert, rows_ab)
        warpgroup.wait_group(0)
        if k_tiles > 0:
            ring.consumer_release(release)
            release.advance()
            if k_tiles % 2 == 1:
                self.promote(acc, p0, sfa, sfb, k_tiles - 1, n_tile, expert, rows_ab)
            else:
                self.promote(acc, p1, sfa, sfb, k_tiles - 1, n_tile, expert, rows_ab)
        return read, release

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        mC: cute.Tensor,
        offsets: cute.Tensor,
        item_expert: cute.Tensor,
        item_row: cute.Tensor,
        sfa: cute.Tensor,
        sfb: cute.Tensor,
        a_smem: cute.ComposedLayout,
        b_smem: cute.ComposedLayout,
        tma_sfa: cute.CopyAtom,
        mSFA: cute.Tensor,
        tma_sfb: cute.CopyAtom,
        mSFB: cute.Tensor,
        sfa_smem: cute.Layout,
        sfb_smem: cute.Layout,
    ):
        BM, BN, BK = self.tile
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        gdx, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            if cutlass.const_expr(self.tma_scales):
                cpasync.prefetch_descriptor(tma_sfa)
                cpasync.prefetch_descriptor(tma_sfb)

        smem = SmemAllocator()
        storage = smem.allocate(self.storage)
        sSFA, sSFB = sfa, sfb  # placeholders where the scales come by global loads
        if cutlass.const_expr(self.tma_scales):
            sSFA = storage.sSFA.get_tensor(sfa_smem)
            sSFB = storage.sSFB.get_tensor(sfb_smem)
        sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        sC = storage.sC.get_tensor(cute.make_layout(self.epi_words))
        stage_bytes = cute.size_in_bytes(self.a_dtype, cute.slice_(a_smem, (None, None, 0))) + cute.size_in_bytes(
            self.b_dtype, cute.slice_(b_smem, (None, None, 0))
        )
        if cutlass.const_expr(self.tma_scales):
            # a box's bytes count in full, also where it reaches past the tensor
            stage_bytes += (BM + SFA_LEAD + (SFB_BOX if self.grouping == "m" else BN)) * 4
        # Full barriers: the TMA-issuing warp arrives with the byte count; empty: one arrive per consumer warp.
        # A cluster of cluster_n CTAs along N: each CTA's stage is filled by the A loads of all of them (and its
        # own B), so each of its consumer warps releases the stage in every CTA of the cluster.
        cta_layout = cute.make_layout((1, self.cluster_n, 1))
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        a_mask = cute.make_layout_image_mask(cta_layout, cta_layout.get_flat_coord(rank), mode=1)
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.cluster_n * self.mma_threads // 32),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, self.cluster_n, 1)),
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, self.cluster_n), is_relaxed=True)
        load = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        # Work item w of this cluster: n-tile (w % n_pairs) * cluster_n + rank, slot w // n_pairs (both CTAs of a
        # cluster walk the same items, so they share every item's rows of A). The host keeps cluster_n a divisor
        # of the n-tile count.
        n_pairs = (mC.shape[1] + BN * self.cluster_n - 1) // (BN * self.cluster_n)
        items = n_pairs * item_expert.shape[0]
        if cutlass.const_expr(self.grouping == "k"):
            items = n_pairs * ((mC.shape[0] + BM - 1) // BM) * mC.shape[2]
        cluster = bx // self.cluster_n
        clusters = gdx // self.cluster_n
        tables = (item_expert, item_row, offsets, (mC.shape[0] + BM - 1) // BM, n_pairs, items)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, self.cluster_n))
        # Consumer thread index (0 .. mma_threads): the producer warpgroup comes first.
        mma_tidx = cutlass.max(tidx - WARPGROUP, 0)
        if warp < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                ahead = self.item_entry(tables, cluster)
                for w in cutlass.range(cluster, items, clusters, unroll=1):
                    entry = ahead
                    ahead = self.item_entry(tables, w + clusters)
                    gA, gB, gC, gSFA, gSFB, k_tiles, k_rem, rows, cols, expert, row0 = self.work_item(
                        mA, mB, mC, mSFA, mSFB, entry, (w % n_pairs) * self.cluster_n + rank, w // n_pairs
                    )
                    scale_tiles = (tma_sfa, sSFA, gSFA, tma_sfb, sSFB, gSFB)
                    load = self.load_tile(
                        ring, load, tma_a, tma_b, sA, sB, gA, gB, k_tiles, cutlass.Int32(0), rank, a_mask, scale_tiles
                    )
                ring.producer_tail(load)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            wg = cute.arch.make_warp_uniform(mma_tidx // WARPGROUP)
            wg_mma = tiled_mma.get_slice(wg * WARPGROUP)
            tCrA = tiled_mma.make_fragment_A(wg_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(wg_mma.partition_B(sB))
            tail = pipeline.NamedBarrier(barrier_id=1, num_threads=self.mma_threads)
            tCcC = tiled_mma.get_slice(mma_tidx).partition_C(cute.make_identity_tensor((BM, BN)))
            acc = cute.make_rmem_tensor(tCcC.shape, self.acc_dtype)
            part = acc
            part2 = acc
            if cutlass.const_expr(self.scaled):
                part = cute.make_rmem_tensor(tCcC.shape, self.acc_dtype)
                if cutlass.const_expr(self.overlap):
                    part2 = cute.make_rmem_tensor(tCcC.shape, self.acc_dtype)
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            else:
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            ahead = self.item_entry(tables, cluster)
            for w in cutlass.range(cluster, items, clusters, unroll=1):
                entry = ahead
                ahead = self.item_entry(tables, w + clusters)
                n_tile = (w % n_pairs) * self.cluster_n + rank
                gA, gB, gC, gSFA, gSFB, k_tiles, k_rem, rows, cols, expert, row0 = self.work_item(
                    mA, mB, mC, mSFA, mSFB, entry, n_tile, w // n_pairs
                )
                if cutlass.const_expr(self.scaled and self.grouping == "k"):
                    read, release = self.mma_item_scaled_k(
                        ring, read, release, tiled_mma, tCrA, tCrB, acc, part, k_tiles, sSFA, sSFB, tCcC
                    )
                elif cutlass.const_expr(self.scaled):
                    r_lo, _ = tCcC[0]
                    r_hi, _ = tCcC[2]
                    if cutlass.const_expr(self.overlap):
                        # Rows past A's end (an item's last tile) read row M - 1's scale; they are never stored.
                        last = mA.shape[0] - 1
                        rows_ab = (cutlass.min(row0 + r_lo, last), cutlass.min(row0 + r_hi, last))
                        read, release = self.mma_item_overlapped(
                            ring, read, release, tiled_mma, tCrA, tCrB, acc, (part, part2), k_tiles, sfa, sfb,
                            n_tile, expert, rows_ab,
                        )  # fmt: skip
                    else:
                        src: tuple = ()
                        if cutlass.const_expr(self.tma_scales):  # rows past A's end: TMA fills zeros
                            lead = row0 % SFA_LEAD  # the rows of the box before the item's first
                            src = (sSFA, sSFB, r_lo + lead, r_hi + lead)
                        else:  # rows past A's end read row M - 1's scale; they are never stored
                            last = mA.shape[0] - 1
                            rows_ab = (cutlass.min(row0 + r_lo, last), cutlass.min(row0 + r_hi, last))
                            src = (sfa, sfb, n_tile, expert, *rows_ab)
                        read, release = self.mma_item_scaled(
                            ring, read, release, tiled_mma, tCrA, tCrB, acc, part, k_tiles, src
                        )
                else:
                    read, release = self.mma_item(
                        ring, read, release, tiled_mma, tCrA, tCrB, acc, k_tiles, k_rem, sA, sB, mma_tidx, tail
                    )
                self.store_tile(acc, tiled_mma, gC, rows, cols, mma_tidx, sC)
