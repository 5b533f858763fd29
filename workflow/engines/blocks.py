"""The fused GEMV's launch shapes, named: what a call fuses (Fuse), a call site (Use), a kernel
body and its sizes (Block), the candidates tuning times, and engine.json's form of the result.

Pure Python: engine.json is read and written without the kernels (workflow.engines.gemv).
"""

from __future__ import annotations

import enum
import functools
import operator
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch


class Fuse(enum.Flag):
    """What a call runs around its weight read: they change the best block (a norm or silu
    prologue re-reads x in every program, so fewer, wider programs can win)."""

    NONE = 0
    NORM = enum.auto()  # prologue: RMSNorm of x
    SILU = enum.auto()  # prologue: x = [gate | up] -> silu(gate) * up
    RES = enum.auto()  # epilogue: + residual
    GLU = enum.auto()  # epilogue: w = [gate; up] -> silu(x @ gate^T) * (x @ up^T)


ROWS = (1, 2, 4, 8, 16)  # the row counts tuned: a call of m rows takes the block of the fewest >= m (block_for)


def block_for(found: dict[int, Block] | None, m: int) -> Block | None:
    """The block a call of m rows takes: that of the fewest tuned rows >= m, among those an engine
    has (one built with other ROWS keeps its own); None: none fits (gemv.default_block)."""
    return next((found[r] for r in sorted(found or {}) if r >= m), None)


class Use(NamedTuple):
    """A call site as tuning sees it: the weight's shape and element size, its Fuse, and how many
    rows of x (a ROWS bucket): the block that is best for one row need not be for more (FP8's
    deferred body, best at one row, runs the tile's reduction at more)."""

    n: int
    k: int
    weight_bytes: int
    fuse: Fuse
    rows: int = 1

    @classmethod
    def of(cls, w: torch.Tensor, fuse: Fuse, rows: int = 1) -> Use:
        return cls(w.shape[0], w.shape[1], w.element_size(), fuse, rows)

    def key(self) -> str:
        """As engine.json stores it: "<n>x<k>:<bytes>:<fuse names joined by +>:<rows>"."""
        names = "+".join(f.name.lower() for f in Fuse if f and f in self.fuse)
        return f"{self.n}x{self.k}:{self.weight_bytes}:{names}:{self.rows}"

    @classmethod
    def parse(cls, key: str) -> Use:
        """A key as `key` writes it; without rows (engines built before rows were tuned), one row."""
        shape, nbytes, names, *rows = key.split(":")
        n, k = shape.split("x")
        fuse = functools.reduce(operator.or_, (Fuse[name.upper()] for name in names.split("+") if name), Fuse.NONE)
        return cls(int(n), int(k), int(nbytes), fuse, int(rows[0]) if rows else 1)


class Body(enum.StrEnum):
    """The kernel's ways of reading the weight (see the module docstring)."""

    TILE = "tile"  # each [BLOCK_N, BLOCK_K] tile reduced over K as it comes
    DEFER = "defer"  # one row: the tile's float32 products kept, reduced once after the loop
    RESIDENT = "resident"  # per_sm programs a multiprocessor hold x's whole row, striding over column blocks
    DOT = "dot"  # tensor cores, FP8 weights read as stored, loads pipelined over `stages`


class Block(NamedTuple):
    """A launch shape: the body and its sizes (per_sm: RESIDENT only; stages: DOT only)."""

    body: Body
    block_n: int
    block_k: int
    warps: int
    per_sm: int = 0
    stages: int = 0

    @classmethod
    def from_dict(cls, d: dict) -> Block:
        return cls(Body(d["body"]), d["block_n"], d["block_k"], d["warps"], d.get("per_sm", 0), d.get("stages", 0))

    def to_dict(self) -> dict:
        return self._asdict() | {"body": self.body.value}


BLOCK_N_CHOICES, WARPS_CHOICES = (2, 4, 8, 16), (4, 8)
BLOCK_K_CHOICES = {2: (512, 1024, 2048), 1: (1024, 2048, 4096), 4: (256, 512, 1024)}  # by weight bytes
DEFER_N_CHOICES, DEFER_K_CHOICES = (4, 8, 16), (256, 512, 1024)  # the deferred body holds BLOCK_N x BLOCK_K floats
DEFER_REGS = 64  # most partial sums a thread may hold in the deferred body
RESIDENT_N, RESIDENT_PER_SM, RESIDENT_MAX_K = (1, 2, 4), (4, 8), 4096  # the resident body: x's row in registers
DOT_N, DOT_K, DOT_STAGES = (32, 64, 128), (128, 256), (2, 4)  # the tensor-core body (FP8, Fuse NONE or RES)
ROWS_TILE_WARPS = 4  # past one row, tiles of this many warps and the widest BLOCK_K only (see candidates)
WIDE_ROWS = 8  # from this many rows the tensor-core body alone where it takes the use (see candidates)
DOT_K_BF16, DOT_SMEM = (64, 128), 160 << 10  # bf16's tensor-core body: its K tiles; the most shared memory its stages take


class Tuned(NamedTuple):
    """tune's choice for a use, and its time there (ms a call, for reports; None where an older
    engine.json did not record it)."""

    block: Block
    ms: float | None


def candidates(k: int, weight_bytes: int, fuse: Fuse = Fuse.NONE, rows: int = 1) -> list[Block]:
    """Block shapes worth timing for x of `rows` rows: 1 to 64 KB of weights per program and
    step, reduced per tile; and for FP8 weights at one row the deferred body (more rows run the
    tile's reduction), with tiles whose partial sums fit the registers. For bf16 it brought
    nothing (levers ledger, probe 11). And, for K up to RESIDENT_MAX_K, the resident body:
    per_sm programs a multiprocessor, each reading x's row and running its prologue once, then
    striding over column blocks. For FP8 weights read with no prologue and no GLU, the
    tensor-core body. Past one row fewer, to keep build short: the tensor-core body alone where
    FP8 takes it (x's rows are padded to 16: more rows cost it nothing), else the resident body
    and tiles of ROWS_TILE_WARPS warps at the widest BLOCK_K that fits (every block that won at
    2, 4 or 8 rows on an H100 from the whole set is one of these: levers.md, probe 34), and for
    bf16 the tensor-core body with any prologue and epilogue, whose stages fit DOT_SMEM (CUDA
    cores' products grow with the rows: cuBLAS beat the bf16 GEMV at 4 rows); from WIDE_ROWS
    rows that body alone (tuned so, bf16's step at 8 and 16 rows beat cuBLAS's on an H100, where
    the CUDA-core bodies had lost at 8: levers.md, probes 34 and 36)."""
    fits = next_power_of_2(k)
    widest = max((bk for bk in BLOCK_K_CHOICES[weight_bytes] if bk <= fits), default=0)
    tiled = [Block(Body.TILE, bn, bk, w) for bn in BLOCK_N_CHOICES for bk in BLOCK_K_CHOICES[weight_bytes] for w in WARPS_CHOICES]
    tiled = tiled if rows == 1 else [b for b in tiled if b.warps == ROWS_TILE_WARPS and b.block_k == widest]
    deferred = [Block(Body.DEFER, bn, bk, w) for bn in DEFER_N_CHOICES for bk in DEFER_K_CHOICES for w in WARPS_CHOICES]
    deferred = deferred if weight_bytes == 1 and rows == 1 else []
    resident = [Block(Body.RESIDENT, bn, fits, w, p) for bn in RESIDENT_N for w in WARPS_CHOICES for p in RESIDENT_PER_SM]
    resident = resident if k <= RESIDENT_MAX_K else []
    dot = [Block(Body.DOT, bn, bk, 4, 0, s) for bn in DOT_N for bk in DOT_K for s in DOT_STAGES if bk <= fits]
    dot = dot if weight_bytes == 1 and fuse in (Fuse.NONE, Fuse.RES) else []
    if rows > 1 and dot:
        return dot
    tiles = 2 if Fuse.GLU in fuse else 1  # weight tiles a stage holds
    bf16_dot = [Block(Body.DOT, bn, bk, 4, 0, s) for bn in DOT_N for bk in DOT_K_BF16 for s in DOT_STAGES if bk <= fits]
    bf16_dot = [b for b in bf16_dot if b.stages * b.block_k * (tiles * b.block_n + 16) * 2 <= DOT_SMEM]
    bf16_dot = bf16_dot if weight_bytes == 2 and rows > 1 else []
    if rows >= WIDE_ROWS and bf16_dot:
        return bf16_dot
    fit = [b for b in tiled + deferred if b.block_k <= fits]
    ok = [b for b in fit if b.body != Body.DEFER or b.block_n * b.block_k <= DEFER_REGS * 32 * b.warps]
    return ok + resident + dot + bf16_dot


def fuse_of(norm: bool, silu_mul: bool, residual: bool, glu: bool = False) -> Fuse:
    """The Fuse of a call with these prologue and epilogue arguments."""
    on = ((Fuse.NORM, norm), (Fuse.SILU, silu_mul), (Fuse.RES, residual), (Fuse.GLU, glu))
    return functools.reduce(operator.or_, (f for f, yes in on if yes), Fuse.NONE)


def default_block(k: int) -> Block:
    """The block of an untuned use (the CPU's interpreter, an engine built without a GPU)."""
    return Block(Body.TILE, 8, min(512, next_power_of_2(k)), 4)


def blocks_for(tuning: dict[Use, Tuned], w: torch.Tensor, fuse: Fuse) -> dict[int, Block]:
    """A linear's decode blocks by row count (ROWS): those tuning has for its weight and Fuse."""
    found = {m: tuning.get(Use.of(w, fuse, m)) for m in ROWS}
    return {m: tuned.block for m, tuned in found.items() if tuned}


def read_tuning(stored: dict) -> dict[Use, Tuned]:
    """engine.json's `tuning.gemv` ({use key: block with its ms}) as tune returns it."""
    return {Use.parse(key): Tuned(Block.from_dict(b), b.get("ms")) for key, b in stored.items()}


def tuning_json(tuning: dict[Use, Tuned]) -> dict:
    """tune's result as engine.json stores it."""
    return {use.key(): tuned.block.to_dict() | {"ms": tuned.ms} for use, tuned in tuning.items()}


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()
