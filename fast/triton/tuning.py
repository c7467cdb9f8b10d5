"""Block sizes and launch settings of the Triton backend, grouped by launch (GROUPS).
benchmarks/bench_fast.py times the CANDIDATES of every launch on the device and keeps the
fastest per launch; benchmarks/NOTES.md has what each one measured."""
from __future__ import annotations

import functools
import os

TUNE: dict = dict(
    stag=5,          # K-block visiting order offset per program (0: all programs in step)
    pdl=0,           # NVIDIA: launches as programmatic dependents (_jit.pdl_enter: 1 the next starts at once, 2 as
                     # programs exit); 0, off: K2 8x4 304.9 vs 344.7 µs with 1 (NOTES v8)
    spin=1 << 22,    # polls of a ticket wait before it gives up (raising the flag health() reports)
    poll_ld=False,   # the ticket waits poll with volatile loads, one acquire RMW after (_jit.wait_ge; same bits):
                     # on vs off, H200 K1 8x4 54.6 vs 52.6 µs, K2 4x4 185.1 vs 181.0 (v13)
    poll_nap=0,      # NVIDIA: ns of sleep after each unmet poll of a ticket wait (_jit.wait_ge NAP; same bits); 0: none.
                     # H100 bench_k1 K1 4x4/8x4: 0 55.8/58.8, 100 56.4/58.7, 400 56.3/59.1, 1500 58.7/61.0 µs (v20)
    # K1 launch 1: AttnRes phases + in_proj
    k1_hc=1024,      # AttnRes column chunk (programs per token row and phase: hidden / k1_hc); H100 bench_k1 K1
                     # 1x1/4x4/8x4: 1024 53.8/56.1/58.2, 512 52.5/55.8/58.7, 256 55.9/57.3/60.4, 2048 56.3/58.1/60.4 µs (v21)
    k1_bn=32, k1_bk=128, k1_warps=2, k1_stages=6,
    k1_split=2,      # K split of in_proj (partials + last-program sum in split order)
    k1_swap=False,   # weights on the MMA's M side (Hopper warpgroup MMA when k1_bn >= 64)
    k1_xc=False,     # no AttnRes phase C, the in_proj items normalize x per block (same bits): H100 1x1 K1 63.2 vs 55.1 µs (v11)
    k1_part=True,    # in_proj's K-split partials summed by the recurrence where it reads them (_k1._pj; same bits): no
                     # split handshake at the end of in_proj's programs. Needs rec_occ=3 (L = 4: 174 registers without)
    k1_rst=True,     # k1_mid's counters reset by the recurrence at its end (_jit.ticket_reset; same bits): no done
                     # count at the end of every k1_mid program. H200 bench_k1 --rounds 5, K1 µs 1x1/4x4/8x4: both
                     # 40.0/45.8/47.4, k1_rst 42.9/46.1/47.5, k1_part 42.0/47.2/48.7, neither 43.1/47.1/48.9 (v24)
    # K1 launch 2: conv, gates, recurrence, gated norm
    k1_nv=16,        # programs per (request, head) in the recurrence (value-row split), halved while
    rec_cap=400,     # requests·heads·k1_nv > rec_cap: 8x1 K1 52.8 vs 60.9 µs (the 1536 programs took 3 waves; v10)
    rec_warps=4,
    rec_gt=True,     # the gates' MMA as [HD, LP] (w_fb @ f_a^T) so its layout stays off the state
    rec_flat=False,  # the token chain with q/k in the state's layout (same bits): H100 8x1 K1 73.5 vs 62.3 µs (v11)
    rec_lean=True,   # the token chain's q/k norms over [1, HD] rows, o stored once after it (same bits):
                     # H200 K1 µs 1x1..8x4 44.0/45.9/51.8/48.0/52.6 on vs 44.7/46.4/50.9/48.6/53.7 off (v13)
    rec_hoist=True,  # at L > 1: the conv outputs of all tokens before the chain, the gated norm's g2 rows and the q/k
                     # windows before its stores (same bits): H100 K1 4x4 57.1 vs 60.0, 8x4 59.6 vs 62.8 µs (v14); at L = 1
                     # off (no chain to hoist out of; 8x1's k1_nv=4 build would take 178 registers, 2 programs per SM)
    rec_ct=True,     # the conv windows as [channels, positions] tiles, so the state keeps the layout of its stores
                     # (same bits; L = 4, k1_nv=16: 84 -> 76 CTA barriers, no per-token shared-memory copy):
                     # H100 K1 4x4 56.9 vs 57.5, 8x4 59.6 vs 60.2 µs (v15)
    rec_pdl=True,    # NVIDIA: the recurrence as k1_mid's programmatic dependent, its state/w_fb loads before the wait:
                     # H100 K1 8x1 59.1 vs 62.3, 8x4 63.6 vs 65.2 µs, same bits (v11)
    rec_cnt=0,       # 1: the recurrence waits on k1_mid's count of stored in_proj row blocks, not on the grid
                     # dependency's completion (_k1.k1_rec_kernel CNT; same bits); 2: that count polled with
                     # volatile loads (_jit.wait_ge LD). 1 vs 0, H100 bench_fast K1 µs 1x1..8x4: 53.0/54.4/56.4/
                     # 57.8/67.0 vs 53.1/55.7/56.7/57.7/58.7; H200 bench_k1 4x4/8x4 46.5/57.1 vs 46.7/49.1 (v17):
                     # off. On its own line since: 8x4 66.8 vs 58.9 still (H100, v20): the loss is registers, below
    rec_occ=3,       # NVIDIA: cap the recurrence's registers so rec_occ programs fit an SM (ptxas maxnreg; 0: none).
                     # rec_cnt's poll takes the L = 4 build from 168 to 173 registers (Triton 3.6, sm_90), two
                     # programs per SM, and 8x4's 384 programs a second wave; capped at 168 (3) it spills nothing.
                     # H100 bench_k1 K1 1x1/4x4/8x4, rec_cnt=1: 52.5/58.3/59.8 with 3, 54.1/56.4/66.8 without,
                     # defaults 58.3/56.5/58.9 µs (v20): the wave is gone, no gain at L = 4. On for k1_part (v24)
    stamps=False,    # NVIDIA: timeline build of K1 (%globaltimer per program into scratch; bench_fast --timeline)
    # K2 launch 1: o_proj
    k2_bn=16, k2_bk=256, k2_warps=1, k2_stages=3, k2_swap=False, o_split=1,
    # K2 launch 2: AttnRes phases + router / latent-down / shared gate-up GEMVs + top-k
    mid_hc=1024, mid_bn=128, mid_bnl=64, mid_bns=32, mid_bk=128, mid_warps=8, mid_stages=3, mid_swap=True,
    mid_split=4,
    # K2 launch 3: routed gemm1 (+ shared down)
    # 2 warps, 2 stages, no K split: K2 at 8x4 259.4 µs vs 278.5 with 4 warps, 2 stages, split 2 (v9, calls 3-5)
    x1_br=64, x1_unr=4, x1_warps=2, x1_stages=2, x1_swap=False,
    x1_split=1, x1_fill=1024,  # gemm1 K split when fewer than x1_fill (pick slot, chunk) programs exist
    x1_row=True,     # mxfp4 at one token: FMA dot products instead of MMAs (same bits)
    x1_sload=False,  # quantized blocks' scales loaded per block (True) or per step and picked out (False)
    x1_ptx=True,     # NVIDIA: the E2M1 nibble decode as inline PTX (_jit.e2m1_f16x2_ptx; same bits)
    x1_sw=True,      # the weights' scale codes of a step as one word per row (_k2._words; same bits): K2 8x4 295.5 vs 304.5 µs (v9)
    sd_bn=32, sd_bk=256,
    # K2 launch 4: routed gemm2 + pick-order sum
    x2_bl=64, x2_unr=2, x2_warps=2, x2_stages=3, x2_swap=False, x2_row=True, x2_sload=False, x2_ptx=True,
    x2_sw=True,      # as x1_sw
    # K2 launch 5: latent norm + up projection
    up_bn=64, up_bk=256, up_warps=4, up_swap=True, up_split=7,
)

# Overrides of TUNE for builds with few token rows: a build of S rows uses ROWS[m] for the
# smallest m >= S (none past the largest m). The tuning pass picks them per S (bench_fast);
# these are the picks of the v9 H200 pass (call 1, benchmarks/NOTES.md v9; µs of the launch alone,
# override vs TUNE): at 1 row in_proj in 256-wide K blocks of 4 stages (36.4 vs 38.8), mid on 4
# warps (46.7 vs 54.8), gemm1 with 3 stages and a K split of 4 (28.5 vs 57.0: the FMA row path);
# at 2-4 rows the mid launch with 4 stages (49.5 vs 55.2), gemm1 as at one row (88.1 vs 90.0).
ROWS: dict = {1: dict(k1_bk=256, k1_stages=4, k1_nv=8, k2_bn=32, k2_warps=2, k2_stages=4, mid_warps=4, mid_stages=4,
                      x1_stages=3, x1_split=4, x2_unr=4, x2_stages=2, up_bk=128),
              4: dict(k2_stages=4, mid_stages=4, x1_stages=3, x1_split=4, up_bk=128, up_warps=8)}


ENV = "K3VERIFY_TRITON_TUNE"


def parse_knobs(text: str, src: str = ENV) -> dict:
    """'knob=value,...' -> {knob: value} typed as TUNE's (ints in any base; true/false or 1/0 for
    the switches): K3VERIFY_TRITON_TUNE and the benchmarks' variants. ValueError naming src and the knob."""
    return dict(_parse(text, src))


@functools.lru_cache(maxsize=16)
def _parse(text: str, src: str) -> tuple:
    out = []
    for kv in filter(None, (p.strip() for p in text.split(","))):
        k, eq, v = kv.partition("=")
        k, v = k.strip(), v.strip()
        if not eq or k not in TUNE:
            raise ValueError(f"{src}: {k!r} is not a TUNE knob (want 'knob=value,...')")
        if isinstance(TUNE[k], bool):
            if v.lower() not in ("0", "1", "true", "false"):
                raise ValueError(f"{src}: {k}={v!r}: want true/false or 1/0")
            out.append((k, v.lower() in ("1", "true")))
        else:
            try:
                out.append((k, int(v, 0)))
            except ValueError:
                raise ValueError(f"{src}: {k}={v!r}: want an integer") from None
    return tuple(out)


def check_combination(knobs: dict, src: str = "TUNE") -> None:
    """ValueError naming src and the knobs for settings that cannot run together: rec_cnt's poll
    replaces the wait for k1_mid's completion that k1_part and k1_rst rely on."""
    if knobs["rec_cnt"] and (knobs["k1_part"] or knobs["k1_rst"]):
        raise ValueError(f"{src}: rec_cnt={knobs['rec_cnt']} cannot be combined with k1_part or k1_rst (set "
                         f"k1_part=0,k1_rst=0): its poll replaces the wait for k1_mid's completion that both rely on")


def env_overrides() -> dict:
    """Knobs set by the environment, over TUNE and ROWS: K3VERIFY_TRITON_TUNE='poll_nap=400,k1_split=4'
    tries a setting in replays and benchmarks without an edit (the test suite refuses to run with it set).
    ValueError naming the knob on a malformed value or a combination that cannot run with TUNE
    (the backend is then not available)."""
    out = parse_knobs(os.environ.get(ENV, ""))
    check_combination(dict(TUNE, **out), ENV)
    return out


def settings(rows: int) -> dict:
    """TUNE with the ROWS overrides of a build of `rows` token rows, then env_overrides()."""
    m = min((m for m in ROWS if m >= rows), default=None)
    out = dict(TUNE, **(ROWS[m] if m is not None else {}))
    out.update(env_overrides())
    return out


# The knobs of each launch (call, index of the launch within the call): a launch's time
# depends on its own knobs only, so the tuning pass picks each group's best independently.
GROUPS: dict = {
    ("k1", 0): ("k1_hc", "k1_bn", "k1_bk", "k1_warps", "k1_stages", "k1_split", "k1_swap", "k1_xc", "k1_part", "k1_rst"),
    ("k1", 1): ("k1_nv", "rec_cap", "rec_warps", "rec_gt", "rec_flat", "rec_lean", "rec_hoist", "rec_ct", "rec_pdl",
                "rec_cnt", "rec_occ"),
    ("k2", 0): ("k2_bn", "k2_bk", "k2_warps", "k2_stages", "k2_swap", "o_split"),
    ("k2", 1): ("mid_hc", "mid_bn", "mid_bnl", "mid_bns", "mid_bk", "mid_warps", "mid_stages", "mid_swap",
                "mid_split"),
    ("k2", 2): ("x1_br", "x1_unr", "x1_warps", "x1_stages", "x1_swap", "x1_split", "x1_fill", "x1_row", "x1_sload", "x1_ptx", "x1_sw", "sd_bn",
                "sd_bk"),
    ("k2", 3): ("x2_bl", "x2_unr", "x2_warps", "x2_stages", "x2_swap", "x2_row", "x2_sload", "x2_ptx", "x2_sw"),
    ("k2", 4): ("up_bn", "up_bk", "up_warps", "up_swap", "up_split"),
}

# Candidates per launch; candidate i of every group runs together in variant i of the tuning
# pass (each applied over TUNE), and each launch keeps its fastest candidate. TUNE holds what
# the tuning passes chose (the v9 pass: bench_fast_h200_v9.txt; x1_row / x2_row in v6, over
# v5's choice: bench_fast_h200_v5.txt; the v4 sweep: bench_fast_h200_v4_sweep.txt). A candidate that fails
# to build or disagrees with the reference drops its whole variant, so risky ones share one.
CANDIDATES: dict = {
    ("k1", 0): [{}, dict(k1_stages=4), dict(k1_stages=5), dict(k1_bk=256, k1_stages=4), dict(k1_split=1),
                dict(k1_bn=16), dict(k1_bn=16, k1_split=4), dict(k1_split=4), dict(k1_warps=4), dict(k1_hc=512)],
    ("k1", 1): [{}, dict(rec_gt=False), dict(rec_warps=2), dict(rec_warps=8), dict(k1_nv=16),
                dict(k1_nv=16, rec_warps=2), dict(k1_nv=4), dict(k1_nv=4, rec_warps=8)],
    ("k2", 0): [{}, dict(o_split=2), dict(k2_bk=128), dict(k2_bn=32, k2_warps=2), dict(k2_warps=2), dict(o_split=4),
                dict(k2_stages=3), dict(k2_bn=32)],
    ("k2", 1): [{}, dict(mid_split=2), dict(mid_bk=256), dict(mid_bn=64), dict(mid_warps=4), dict(mid_bnl=32),
                dict(mid_bns=16), dict(mid_stages=3), dict(mid_split=8), dict(mid_stages=5)],
    ("k2", 2): [{}, dict(x1_sw=False), dict(x1_stages=3), dict(x1_split=2), dict(x1_unr=2, x1_split=14),
                dict(x1_warps=4), dict(x1_split=2, x1_warps=4), dict(x1_warps=1), dict(x1_unr=2), dict(x1_split=4)],
    ("k2", 3): [{}, dict(x2_sw=False), dict(x2_unr=4), dict(x2_unr=1), dict(x2_unr=4, x2_stages=2),
                dict(x2_stages=2), dict(x2_stages=4), dict(x2_unr=1, x2_warps=1), dict(x2_warps=4), dict(x2_bl=32)],
    ("k2", 4): [{}, dict(up_split=14), dict(up_bn=32, up_split=14), dict(up_warps=2), dict(up_bk=256),
                dict(up_split=4), dict(up_bn=128), dict(up_warps=8)],
}


def variant(i: int) -> dict:
    """Candidate i of every launch group, merged (the groups' knobs are disjoint)."""
    out: dict = {}
    for cands in CANDIDATES.values():
        if i < len(cands):
            out.update(cands[i])
    return out


def n_variants() -> int:
    return max(len(c) for c in CANDIDATES.values())
