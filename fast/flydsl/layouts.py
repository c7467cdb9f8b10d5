"""The index maps of the FlyDSL kernels, written as FlyDSL layouts (shape : stride).

Each function returns a plain `(shape, stride)` pair; kernels build it with
`fx.make_layout(*spec)` and map coordinates with `at(spec, coord)` /
`coord_of(spec, index)`. The CPU tests evaluate the very same pairs through
FlyDSL's layout algebra (static coordinates fold to integers without compiling)
and compare them with the intended mapping written out as loops.

A layout maps a coordinate (c0, c1, ...) to Σ c_i·stride_i; `coord_of` is the
inverse (colexicographic: the first mode varies fastest).
"""
from __future__ import annotations


# ---- work splits (thread -> coordinates)

def lane_split(lanes_per_row: int, wave: int = 64):
    """lane -> (klane, group): `lanes_per_row` adjacent lanes share one output row
    group and split its K chunks; a wave holds wave/lanes_per_row groups."""
    return (lanes_per_row, wave // lanes_per_row), (1, lanes_per_row)


def gemv_waves(ksplit: int, row_groups: int):
    """GEMV wave -> (ks, rg): `ksplit` adjacent waves share row group rg and take the
    K splits ks = 0..ksplit-1."""
    return (ksplit, row_groups), (1, ksplit)


def gemv_chunks(lanes_per_row: int, steps: int, ksplit: int, per_split: int):
    """GEMV (klane, it, ks) -> 8-element K chunk ks·per_split + klane + lanes_per_row·it:
    split ks owns the contiguous chunks [ks·per_split, (ks+1)·per_split), lane klane takes
    every lanes_per_row-th of them (a chunk at or past the split's end is masked off)."""
    return (lanes_per_row, steps, ksplit), (1, lanes_per_row, per_split)


def kda_split(hd: int, ksplit: int):
    """KDA thread t -> (kq, v): KSPLIT adjacent lanes own one state row v, lane kq
    holds columns [kq·HD/KSPLIT, (kq+1)·HD/KSPLIT)."""
    return (ksplit, hd), (1, ksplit)


def kda_kcol(hd: int, ksplit: int):
    """(i, kq) -> key channel k = kq·KC + i, KC = HD/KSPLIT."""
    kc = hd // ksplit
    return (kc, ksplit), (1, kc)


def experts_of_thread(threads: int, per_thread: int):
    """(thread, i) -> expert id e = thread + threads·i (router top-k: strided ownership)."""
    return (threads, per_thread), (1, threads)


def pick(topk: int, tokens: int):
    """(k, t) -> pick row p = t·K + k of the routed scratch buffers."""
    return (topk, tokens), (1, topk)


# ---- tensor column maps

def proj_heads(nh: int, hd: int):
    """(i, h, blk) -> in_proj column of channel i of head h in block blk of q|k|v|g2:
    blk·P + h·HD + i (P = NH·HD). The same map indexes conv_out's q|k|v."""
    return (hd, nh, 4), (1, hd, nh * hd)


def packed_block(kblocks: int):
    """(nibble, byte, block) -> logical k of a packed 4-bit weight row:
    k = 32·block + 2·byte + nibble (low nibble = even k, 16 bytes per 32-block)."""
    return (2, 16, kblocks), (1, 2, 32)


def head_channel(nh: int, hd: int):
    """(i, h) -> channel p = h·HD + i of a [P] per-head vector (gate, dt_bias, w_fb rows)."""
    return (hd, nh), (1, hd)


# ---- evaluation in a kernel (traced) and on the CPU (static)

def at(spec, coord):
    """Coordinate -> index through FlyDSL's crd2idx (inside a kernel trace)."""
    import flydsl.expr as fx

    idx = fx.crd2idx(fx.make_coord(*coord), fx.make_layout(*spec))
    return fx.get_scalar(idx)


def coord_of(spec, index):
    """Index -> coordinate tuple of scalars through FlyDSL's idx2crd."""
    import flydsl.expr as fx

    crd = fx.idx2crd(index, fx.make_layout(*spec))
    return tuple(fx.get_scalar(crd[i]) for i in range(len(spec[0])))


def evaluate_chunks(length: int, vec: int, coords):
    """CPU: FlyDSL's map of (element e, chunk i) of a contiguous row of `length`
    divided into chunks of `vec` (the kernels' `row_chunks`: logical_divide by vec:1)."""
    import flydsl.expr as fx
    from flydsl._mlir import ir
    from flydsl.compiler.jit_function import _create_mlir_context

    with _create_mlir_context(), ir.Location.unknown():
        mod = ir.Module.create()
        with ir.InsertionPoint(mod.body):
            div = fx.logical_divide(fx.make_layout(length, 1), fx.make_layout(vec, 1))
            return [int(fx.get_scalar(fx.crd2idx(fx.make_coord(*c), div))) for c in coords]


def evaluate(spec, coords=None, indices=None):
    """CPU: FlyDSL's own answers for static coordinates / indices of `spec`."""
    from flydsl._mlir import ir
    from flydsl.compiler.jit_function import _create_mlir_context

    out = []
    with _create_mlir_context(), ir.Location.unknown():
        mod = ir.Module.create()
        with ir.InsertionPoint(mod.body):
            for c in coords or ():
                out.append(int(at(spec, c)))
            for i in indices or ():
                out.append(tuple(int(v) for v in coord_of(spec, i)))
    return out
