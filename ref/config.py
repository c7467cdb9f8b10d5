"""Model configs (DESIGN §4) and the two launch build keys (DESIGN §6).

Every dimension a stage needs is read from tensor shapes; a Config is only used
to *make* tensors (synthetic weights, captures) and to name the layer schedule.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

EXPERT_FORMATS = ("bf16", "mxfp4", "int4", "a8w4")


def _pad16(n: int) -> int:
    return (n + 15) // 16 * 16


@dataclass(frozen=True)
class Config:
    """Per-rank dims of one preset; `world` is the TP size they were split for."""

    name: str
    world: int
    hidden: int
    nh: int  # KDA heads per rank
    hd: int  # head dim
    rank: int  # f_a low rank (replicated across TP ranks)
    conv: int  # short-conv width W
    lower_bound: float
    experts: int  # E
    topk: int
    lat: int  # latent dim LAT
    ri: int  # routed intermediate per rank
    si: int  # shared intermediate per rank
    situ_beta: float
    situ_linear_beta: float
    eps: float  # K1 AttnRes norm (self_attention_res_norm)
    l2_eps: float  # KDA q/k L2 norm
    layers: int
    block_size: int
    mla_layers: tuple[int, ...]  # 1-based, as DESIGN §4 lists them
    dense_layers: tuple[int, ...] = (0,)  # 0-based: dense-MLP layers (first_k_dense_replace), K1 only
    out_eps: float | None = None  # input_layernorm (None: eps)
    onorm_eps: float | None = None  # KDA gated output norm
    mlp_eps: float | None = None  # K2 AttnRes norm (mlp_res_norm)
    mlp_out_eps: float | None = None  # post_attention_layernorm
    ln_eps: float | None = None  # latent norm (routed_expert_norm)

    def norm_eps(self, name: str) -> float:
        """eps of one norm: out_eps, onorm_eps, mlp_eps, mlp_out_eps, ln_eps (None -> eps)."""
        v = getattr(self, name)
        return self.eps if v is None else v

    # ---- derived dims ----
    @property
    def p(self) -> int:
        return self.nh * self.hd

    @property
    def qkv(self) -> int:
        return 3 * self.p

    @property
    def nproj_raw(self) -> int:
        return 4 * self.p + self.rank + self.nh

    @property
    def nproj(self) -> int:
        return _pad16(self.nproj_raw)

    @property
    def up_n(self) -> int:
        return self.hidden // self.world

    @property
    def nbmax(self) -> int:
        """Rows of the AttnRes bank: one per block-write layer."""
        return (self.layers - 1) // self.block_size + 1

    # ---- layer schedule (0-based layer index i) ----
    def is_mla(self, i: int) -> bool:
        return (i + 1) in self.mla_layers

    def is_dense(self, i: int) -> bool:
        return i in self.dense_layers

    def kind(self, i: int) -> str:
        """'kda' (K1 + K2), 'mla' (K2 on MLA's core) or 'dense' (K1 + the dense MLP, no K2)."""
        return "mla" if self.is_mla(i) else "dense" if self.is_dense(i) else "kda"

    def has_k1(self, i: int) -> bool:
        return not self.is_mla(i)

    def has_k2(self, i: int) -> bool:
        return not self.is_dense(i)

    def is_block_write(self, i: int) -> bool:
        return i % self.block_size == 0

    def write_idx(self, i: int) -> int:
        return i // self.block_size if self.is_block_write(i) else -1

    def prev_valid_blocks(self, i: int) -> int:
        return math.ceil(i / self.block_size)

    def k1_nblocks(self, i: int) -> int:
        return self.prev_valid_blocks(i)

    def k2_nblocks(self, i: int) -> int:
        return self.prev_valid_blocks(i) + (1 if self.is_block_write(i) else 0)

    def with_world(self, world: int) -> "Config":
        """Same global model split over another TP size (per-rank dims rescaled)."""
        g = {f: getattr(self, f) * self.world for f in ("nh", "ri", "si")}
        for f, v in g.items():
            if v % world:
                raise ValueError(f"world={world}: global {f}={v} is not divisible")
        if self.hidden % world:
            raise ValueError(f"world={world}: hidden={self.hidden} is not divisible")
        return dataclasses.replace(self, world=world, **{f: v // world for f, v in g.items()})

    def dims(self) -> dict:
        d = dataclasses.asdict(self)
        d["mla_layers"] = list(self.mla_layers)
        d["dense_layers"] = list(self.dense_layers)
        d.update(p=self.p, qkv=self.qkv, nproj=self.nproj, up_n=self.up_n, nbmax=self.nbmax)
        return d

    @staticmethod
    def from_dims(d: dict) -> "Config":
        names = {f.name for f in dataclasses.fields(Config)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["mla_layers"] = tuple(kw["mla_layers"])
        # captures written before dense layers existed carry no field: they had none
        kw["dense_layers"] = tuple(kw.get("dense_layers", ()))
        return Config(**kw)


_COMMON = dict(conv=4, lower_bound=-5.0, situ_beta=4.0, situ_linear_beta=25.0, eps=1e-5, l2_eps=1e-6)

PRESETS: dict[str, Config] = {
    # tiny discriminates: top-k 4 (per-pick rounding order visible), RI/SI of 128 global so
    # world 4 keeps whole quant blocks, and a distinct eps per norm (a kernel reading the
    # wrong eps field shows on the synthetic quiet rows, ref.synth.carry). The post-attention
    # norm never sees a quiet row (its prefix carries the layer's own delta), so its eps is set
    # where it moves every row by ~1% (mean(x²) ~ 2).
    "tiny": Config(name="tiny", world=2, hidden=128, nh=2, hd=16, rank=16, experts=16, topk=4,
                   lat=64, ri=64, si=64, layers=6, block_size=2, mla_layers=(4, 6),
                   **_COMMON, out_eps=3e-5, onorm_eps=2e-4, mlp_eps=2e-5, mlp_out_eps=4e-2,
                   ln_eps=1e-4),
    "small": Config(name="small", world=2, hidden=1024, nh=4, hd=128, rank=128, experts=64, topk=8,
                    lat=512, ri=128, si=256, layers=12, block_size=4, mla_layers=(4, 8, 12), **_COMMON),
    "k3-tp8": Config(name="k3-tp8", world=8, hidden=7168, nh=12, hd=128, rank=128, experts=896,
                     topk=16, lat=3584, ri=384, si=768, layers=93, block_size=12,
                     mla_layers=tuple(range(4, 93, 4)) + (93,), **_COMMON),
}


def get_config(name: str) -> Config:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"config: unknown preset {name!r} (known: {', '.join(PRESETS)})") from None


@dataclass(frozen=True)
class KdaPreBuild:
    """K1 build key. `delta`: a pending delta is passed; `write_idx` -1: no block write."""

    tokens: int
    qlen: int
    nblocks: int
    delta: bool
    state_len: int
    eps: float
    out_eps: float
    onorm_eps: float
    lower_bound: float
    write_idx: int


@dataclass(frozen=True)
class K2Build:
    """K2 build key. `experts` is the expert weight format (bf16 | mxfp4 | int4 | a8w4)."""

    tokens: int
    nblocks: int
    eps: float
    out_eps: float
    ln_eps: float
    reset: bool
    topk: int
    situ_beta: float
    situ_linear_beta: float
    experts: str


def k1_build(cfg: Config, layer: int, tokens: int, qlen: int, delta: bool, state_len: int) -> KdaPreBuild:
    return KdaPreBuild(tokens=tokens, qlen=qlen, nblocks=cfg.k1_nblocks(layer), delta=delta,
                       state_len=state_len, eps=cfg.eps, out_eps=cfg.norm_eps("out_eps"),
                       onorm_eps=cfg.norm_eps("onorm_eps"), lower_bound=cfg.lower_bound,
                       write_idx=cfg.write_idx(layer))


def k2_build(cfg: Config, layer: int, tokens: int, fmt: str) -> K2Build:
    if fmt not in EXPERT_FORMATS:
        raise ValueError(f"experts: unknown format {fmt!r} (known: {', '.join(EXPERT_FORMATS)})")
    if cfg.is_dense(layer):
        raise ValueError(f"layer {layer}: a dense-MLP layer has no K2")
    return K2Build(tokens=tokens, nblocks=cfg.k2_nblocks(layer), eps=cfg.norm_eps("mlp_eps"),
                   out_eps=cfg.norm_eps("mlp_out_eps"), ln_eps=cfg.norm_eps("ln_eps"),
                   reset=cfg.is_block_write(layer), topk=cfg.topk,
                   situ_beta=cfg.situ_beta, situ_linear_beta=cfg.situ_linear_beta, experts=fmt)


def key_to_dict(key) -> dict:
    return dataclasses.asdict(key)


def key_from_dict(cls, d: dict):
    return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})
