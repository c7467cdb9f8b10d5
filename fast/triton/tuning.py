"""Block sizes and launch settings of the Triton backend. benchmarks/bench_fast.py times
candidate settings (CANDIDATES) on the device and reports the fastest; benchmarks/NOTES.md
has what each one measured."""
from __future__ import annotations

TUNE: dict = dict(
    stag=5,          # K-block visiting order offset per program (0: all programs in step)
    spin=1 << 22,    # polls of a ticket wait before it gives up (raising the flag health() reports)
    attn_hc=1024,    # AttnRes column chunk (programs per token row and phase: hidden / attn_hc)
    # K1
    k1_bn=32, k1_bk=512, k1_warps=4, k1_stages=4,
    k1_split=1,      # K split of in_proj (partials + last-program sum)
    k1_swap=False,   # weights on the MMA's M side (Hopper warpgroup MMA when k1_bn >= 64)
    k1_nv=4,         # programs per (request, head) in the recurrence (value-row split)
    rec_warps=4,
    # K2
    k2_bn=16, k2_bk=256, k2_warps=4, k2_stages=4, k2_swap=False,   # o_proj
    o_split=1, up_split=1, mid_split=1,
    mid_bn=16, mid_bnl=64, mid_bns=32, mid_bk=256, mid_warps=4, mid_stages=4, mid_swap=False,
    x1_br=64, x1_unr=4, x1_warps=4, x1_stages=3,
    x1_split=4, x1_fill=264,  # gemm1 K split when fewer than x1_fill (pick slot, chunk) programs exist
    sd_bn=32, sd_bk=256,
    x2_bl=128, x2_unr=4, x2_warps=4, x2_stages=3,
    x_swap=False,
    up_bn=16, up_bk=256, up_warps=4, up_swap=False,
)

# Settings the benchmark's tuning pass tries per launch group (each applied over TUNE);
# the fastest measured one is reported with the table.
CANDIDATES: dict = dict(
    k1=[{},
        dict(k1_swap=True, k1_bn=64, k1_bk=128, k1_split=2),
        dict(k1_swap=True, k1_bn=64, k1_bk=128, k1_split=4),
        dict(k1_swap=True, k1_bn=128, k1_bk=64, k1_split=4, k1_stages=5),
        dict(k1_swap=True, k1_bn=64, k1_bk=256, k1_split=2, k1_stages=3),
        dict(k1_bn=32, k1_bk=512, k1_warps=2)],
    k2=[{},
        dict(k2_swap=True, k2_bn=64, k2_bk=128, mid_bn=64, mid_bnl=64, mid_bns=64, mid_split=2, o_split=2,
             up_split=2, up_bn=64, up_bk=128),
        dict(k2_swap=True, k2_bn=64, k2_bk=128, mid_bn=64, mid_bnl=64, mid_bns=64, mid_split=4, o_split=3,
             up_split=4, up_bn=64, up_bk=128),
        dict(k2_swap=True, x_swap=True, k2_bn=64, k2_bk=128, mid_bn=64, mid_bnl=64, mid_bns=64, mid_split=2,
             o_split=2, up_split=2, up_bn=64, up_bk=128),
        dict(x_swap=True),
        dict(k2_bn=32, k2_bk=256, mid_bn=32, mid_bns=32, k2_warps=2, mid_warps=2)],
)
