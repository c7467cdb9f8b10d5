"""Checkpoint-reference weights (DESIGN §8 source 3): a launch's weights named as tensors of a
model checkpoint's safetensors shards, with the tensor-parallel slice and the transform to the
logical layout of DESIGN §7, so a capture recorded from real serving names real weights
without copying them (2.2 GB per rank and layer at k3-tp8).

An entry (manifest `weights.k1` / `weights.k2`)::

    {"source": "checkpoint", "layout": "kimi-k3-hf", "version": 1, "checkpoint": DIR,
     "layer": 5, "rank": 3, "world": 8, "which": "k2", "format": "mxfp4",
     "tensors": {"w_o": {"dtype": "bfloat16", "shape": [7168, 1536], "digest": "k3mix32x4:…",
                         "cat": 0, "parts": [{"name": "language_model.layers.5.self_attn.o_proj.weight",
                                              "narrow": [1, 4608, 1536]}]}, …}}

Each ABI tensor is the concatenation along `cat` of its parts; a part is the checkpoint
tensor `name`, narrowed (`narrow` = [dim, start, length]: the rank's slice), reshaped
(`view`), and, when `experts` = E is given, stacked over e = 0..E-1 with `{e}` in the name
replaced by e; or zeros of a `zeros` shape (in_proj's pad rows). No value changes on the way:
the dtypes are the checkpoint's. `digest` is harness.digest of the result, checked on load.

DIR (relative: to the capture's folder) is found again through `K3VERIFY_CHECKPOINT`, when
set, so a recording can be replayed where the checkpoint lives elsewhere. Tensor names are
resolved through DIR/model.safetensors.index.json (`weight_map`), or the headers of every
DIR/*.safetensors when there is no index.

Everything is checked before a byte of tensor data is read: the shard a name maps to exists
and is a regular file, the name is in it with the part's dtype, the slice is inside it, and
the result has the declared shape — each failure one InputError naming the capture, the
weight field and the shard or tensor.

The `kimi-k3-hf` layout (Kimi-K3's Hugging Face names, prefix `language_model.layers.{i}.`,
REAL-SYSTEM.md §1.5-1.6 and vLLM's KimiLinear load_weights): KDA attention
`self_attn.{q,k,v,g,f_a,b}_proj.weight` (in_proj rows q|k|v|g2|f_a|b, then zero pad),
`self_attn.f_b_proj.weight`, `self_attn.{q,k,v}_conv1d.weight` [P, 1, W] fp32, `self_attn.A_log`
fp32 (padded to head_dim: the first heads count), `self_attn.dt_bias` fp32,
`self_attn.o_norm.weight`, `self_attn.o_proj.weight` (row-parallel: the rank's columns); AttnRes
`self_attention_res_{norm,proj}.weight`, `mlp_res_{norm,proj}.weight` ([1, H] viewed [H]),
`input_layernorm.weight`, `post_attention_layernorm.weight`; latent MoE under
`block_sparse_moe.`: `gate.weight`, `gate.e_score_correction_bias` fp32,
`routed_expert_down_proj.weight`, `routed_expert_norm.weight`, `routed_expert_up_proj.weight`
(the rank's UP_N rows), `shared_experts.{gate,up,down}_proj.weight` (bf16), and per expert
`experts.{e}.w1|w3|w2` (gate | up | down) as compressed-tensors mxfp4-pack-quantized
`weight_packed` (uint8, two E2M1 codes a byte, low nibble first) + `weight_scale` (uint8 E8M0
per 32), or bf16 `weight`. The module prefix `block_sparse_moe.` is how vLLM's KimiMoE registers
its parameters [inf: not read off a published checkpoint index].
"""
from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import torch

from ..digest import digest
from ..errors import InputError
from .format import DTYPES, FROM_ST, handle, read_header

LAYOUT = "kimi-k3-hf"
LAYOUT_VERSION = 1
ROOT_ENV = "K3VERIFY_CHECKPOINT"
INDEX = "model.safetensors.index.json"
LAYER = "language_model.layers.{layer}."
MOE = "block_sparse_moe."
EXPERT_NAMES = {"bf16": ("weight", None), "mxfp4": ("weight_packed", "weight_scale"),
                "a8w4": ("weight_packed", "weight_scale")}


# --------------------------------------------------------------------------- the kimi-k3-hf plan

def _t(dtype: str, shape, parts, cat: int = 0) -> dict:
    return {"dtype": dtype, "shape": [int(x) for x in shape], "cat": cat, "parts": parts}


def _p(name: str, narrow=None, view=None, experts=None) -> dict:
    p = {"name": name}
    if narrow is not None:
        p["narrow"] = [int(x) for x in narrow]
    if view is not None:
        p["view"] = [int(x) for x in view]
    if experts is not None:
        p["experts"] = int(experts)
    return p


def kimi_k3_plan(cfg, layer: int, rank: int, which: str, fmt: str | None) -> dict:
    """{ABI name: tensor plan} of one rank's K1 or K2 weights in the kimi-k3-hf layout."""
    H, HD, NH, P, RK, W = cfg.hidden, cfg.hd, cfg.nh, cfg.p, cfg.rank, cfg.conv
    E, LAT, RI, SI, UP = cfg.experts, cfg.lat, cfg.ri, cfg.si, cfg.up_n
    pf, at = LAYER.format(layer=layer), f"{LAYER.format(layer=layer)}self_attn."
    bf, f32 = "bfloat16", "float32"
    if which == "k1":
        rows = [_p(f"{at}{n}_proj.weight", narrow=(0, rank * P, P)) for n in ("q", "k", "v", "g")]
        rows += [_p(f"{at}f_a_proj.weight"), _p(f"{at}b_proj.weight", narrow=(0, rank * NH, NH))]
        pad = cfg.nproj - cfg.nproj_raw
        if pad:
            rows.append({"zeros": [pad, H]})
        return {
            "ares_nw": _t(bf, [H], [_p(f"{pf}self_attention_res_norm.weight")]),
            "ares_qk": _t(bf, [H], [_p(f"{pf}self_attention_res_proj.weight", view=[H])]),
            "in_nw": _t(bf, [H], [_p(f"{pf}input_layernorm.weight")]),
            "w_in": _t(bf, [cfg.nproj, H], rows),
            "w_fb": _t(bf, [P, RK], [_p(f"{at}f_b_proj.weight", narrow=(0, rank * P, P))]),
            "conv_w": _t(f32, [3 * P, W], [_p(f"{at}{n}_conv1d.weight", narrow=(0, rank * P, P), view=[P, W])
                                           for n in "qkv"]),
            "a_log": _t(f32, [NH], [_p(f"{at}A_log", narrow=(0, rank * NH, NH))]),
            "dt_bias": _t(f32, [P], [_p(f"{at}dt_bias", narrow=(0, rank * P, P))]),
            "on_w": _t(bf, [HD], [_p(f"{at}o_norm.weight")]),
        }
    if which != "k2":
        raise InputError("which", f"{which!r}: a checkpoint names K1 ('k1') or K2 ('k2') weights")
    if fmt not in EXPERT_NAMES:
        raise InputError("format", f"{fmt!r}: a Kimi-K3 checkpoint holds mxfp4 (also read as a8w4) or bf16 experts; "
                                   "int4 experts are a lossy requantization at load")
    wn, sn = EXPERT_NAMES[fmt]
    moe, ex = f"{pf}{MOE}", f"{pf}{MOE}experts.{{e}}."
    q = 1 if fmt == "bf16" else 2  # values per byte
    out = {
        "w_o": _t(bf, [H, P], [_p(f"{at}o_proj.weight", narrow=(1, rank * P, P))]),
        "ares_nw": _t(bf, [H], [_p(f"{pf}mlp_res_norm.weight")]),
        "ares_qk": _t(bf, [H], [_p(f"{pf}mlp_res_proj.weight", view=[H])]),
        "in_nw": _t(bf, [H], [_p(f"{pf}post_attention_layernorm.weight")]),
        "w_gate": _t(bf, [E, H], [_p(f"{moe}gate.weight")]),
        "bias": _t(f32, [E], [_p(f"{moe}gate.e_score_correction_bias")]),
        "w_ld": _t(bf, [LAT, H], [_p(f"{moe}routed_expert_down_proj.weight")]),
        "w_sgu": _t(bf, [2 * SI, H], [_p(f"{moe}shared_experts.{n}_proj.weight", narrow=(0, rank * SI, SI))
                                      for n in ("gate", "up")]),
        "w_sd": _t(bf, [H, SI], [_p(f"{moe}shared_experts.down_proj.weight", narrow=(1, rank * SI, SI))]),
        "w13": _t(bf if fmt == "bf16" else "uint8", [E, 2 * RI, LAT // q],
                  [_p(f"{ex}{n}.{wn}", narrow=(0, rank * RI, RI), experts=E) for n in ("w1", "w3")], cat=1),
        "w2": _t(bf if fmt == "bf16" else "uint8", [E, LAT, RI // q],
                 [_p(f"{ex}w2.{wn}", narrow=(1, rank * RI // q, RI // q), experts=E)]),
        "ln_w": _t(bf, [LAT], [_p(f"{moe}routed_expert_norm.weight")]),
        "w_up": _t(bf, [UP, LAT], [_p(f"{moe}routed_expert_up_proj.weight", narrow=(0, rank * UP, UP))]),
    }
    if sn is not None:
        out["w13s"] = _t("uint8", [E, 2 * RI, LAT // 32],
                         [_p(f"{ex}{n}.{sn}", narrow=(0, rank * RI, RI), experts=E) for n in ("w1", "w3")], cat=1)
        out["w2s"] = _t("uint8", [E, LAT, RI // 32], [_p(f"{ex}w2.{sn}", narrow=(1, rank * RI // 32, RI // 32),
                                                          experts=E)])
    return out


PLANS = {LAYOUT: kimi_k3_plan}


# --------------------------------------------------------------------------- resolving names

def checkpoint_root(entry: dict, base: Path) -> Path:
    env = os.environ.get(ROOT_ENV)
    root = Path(env) if env else Path(entry["checkpoint"])
    return root if root.is_absolute() else (Path(base) / root)


@functools.lru_cache(maxsize=16)
def _name_map(root: str, stamp: tuple) -> dict:
    """{tensor name: shard file name} of a checkpoint folder (index, or every shard's header)."""
    idx = Path(root) / INDEX
    if idx.exists():
        from .format import loads, open_regular

        with open_regular(idx, "checkpoint.index") as f:
            wm = loads(f.read(), "checkpoint.index", str(idx))
        wm = wm.get("weight_map") if isinstance(wm, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise InputError("checkpoint.index", "no weight_map of tensor names to shard files", str(idx))
        return dict(wm)
    out = {}
    for p in sorted(Path(root).glob("*.safetensors")):
        for n in read_header(p).tensors:
            out.setdefault(n, p.name)
    return out


def _names(root: Path, field: str, where: str) -> dict:
    if not root.is_dir():
        raise InputError(field, f"checkpoint folder {root} not found", where)
    idx = root / INDEX
    try:
        st = idx.stat()
        stamp = (st.st_size, st.st_mtime_ns)
    except OSError:
        stamp = tuple(sorted((p.name, p.stat().st_mtime_ns) for p in root.glob("*.safetensors")))
    return _name_map(str(root), stamp)


@functools.lru_cache(maxsize=256)
def _shard(path: str, size: int, mtime_ns: int):
    return read_header(path)


def _shard_header(root: Path, file: str, field: str, what: str, where: str):
    p = root / file
    if Path(file).is_absolute() or ".." in Path(file).parts:
        raise InputError(field, f"shard {file!r} of {what} is outside the checkpoint folder", where)
    try:
        st = p.stat()
    except OSError:
        raise InputError(field, f"shard {file} (holding {what}) missing from checkpoint {root}", where) from None
    return _shard(str(p), st.st_size, st.st_mtime_ns)


def _expand(part: dict) -> list[str]:
    if "experts" in part:
        return [part["name"].replace("{e}", str(e)) for e in range(part["experts"])]
    return [part["name"]]


def _part_shape(part: dict, shape: list, name: str, field: str, where: str) -> list:
    shape = list(shape)
    if "narrow" in part:
        d, start, n = part["narrow"]
        if not 0 <= d < len(shape):
            raise InputError(field, f"{name}: narrow dim {d} outside its {len(shape)} dims", where)
        if start + n > shape[d]:
            raise InputError(field, f"{name}: slice [{start}, {start + n}) of dim {d} out of range (size {shape[d]})",
                             where)
        shape[d] = n
    if "view" in part:
        if math.prod(part["view"]) != math.prod(shape):
            raise InputError(field, f"{name}: {shape} cannot be viewed as {part['view']}", where)
        shape = list(part["view"])
    return shape


def plan_check(entry: dict, base: Path, field: str, where: str) -> dict:
    """Check a (validated) checkpoint entry against the shards' headers, reading no tensor data.
    Returns {ABI name: [(part, [(shard header, checkpoint name), ...])]} for the loader."""
    root = checkpoint_root(entry, base)
    names = _names(root, field, where)
    out = {}
    for abi_name, t in entry["tensors"].items():
        f = f"{field}.{abi_name}"
        shapes, resolved = [], []
        for part in t["parts"]:
            if "zeros" in part:
                shapes.append(list(part["zeros"]))
                resolved.append((part, []))
                continue
            hs = []
            for n in _expand(part):
                if n not in names:
                    raise InputError(f, f"tensor {n!r} absent from checkpoint {root}", where)
                hdr = _shard_header(root, names[n], f, repr(n), where)
                if n not in hdr.tensors:
                    raise InputError(f, f"tensor {n!r} absent from shard {names[n]} (the index names it)", where)
                h = hdr.tensors[n]
                if FROM_ST.get(h["dtype"]) != t["dtype"]:
                    raise InputError(f, f"{n} is {FROM_ST.get(h['dtype'], h['dtype'])} in the checkpoint, the "
                                        f"capture says {t['dtype']}", where)
                hs.append((hdr, n))
            s = _part_shape(part, hdr.tensors[hs[0][1]]["shape"], hs[0][1], f, where)
            for hh, n in hs[1:]:
                if _part_shape(part, hh.tensors[n]["shape"], n, f, where) != s:
                    raise InputError(f, f"{n}: shape {hh.tensors[n]['shape']} differs from {hs[0][1]}'s", where)
            shapes.append(([part["experts"]] if "experts" in part else []) + s)
            resolved.append((part, hs))
        cat = t["cat"]
        got = list(shapes[0])
        for s in shapes[1:]:
            if len(s) != len(got) or any(a != b for i, (a, b) in enumerate(zip(s, got)) if i != cat):
                raise InputError(f, f"parts of shapes {shapes} do not concatenate along dim {cat}", where)
            got[cat] += s[cat]
        if got != t["shape"]:
            raise InputError(f, f"the checkpoint gives {got}, the capture says {t['shape']}", where)
        out[abi_name] = resolved
    return out


def _read(hdr, name: str, part: dict) -> torch.Tensor:
    sl = handle(hdr).get_slice(name)
    if "narrow" in part:
        d, start, n = part["narrow"]
        t = sl[tuple([slice(None)] * d + [slice(start, start + n)])]
    else:
        t = sl[:]
    return t.reshape(part["view"]) if "view" in part else t


def load_checkpoint(entry: dict, base: Path, device, verify: str, field: str, where: str) -> dict:
    """The tensors of a (validated) checkpoint entry on `device`, digests checked unless verify='none'."""
    plan = plan_check(entry, base, field, where)
    out = {}
    for abi_name, resolved in plan.items():
        t = entry["tensors"][abi_name]
        dt = DTYPES[t["dtype"]]
        pieces = []
        for part, hs in resolved:
            if "zeros" in part:
                pieces.append(torch.zeros(part["zeros"], dtype=dt))
            elif "experts" in part:
                pieces.append(torch.stack([_read(h, n, part) for h, n in hs]))
            else:
                pieces.append(_read(hs[0][0], hs[0][1], part))
        x = (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=t["cat"])).contiguous().to(device)
        if verify != "none" and digest(x) != t["digest"]:
            raise InputError(f"{field}.{abi_name}.digest", "the checkpoint's tensor differs from the one recorded "
                                                           "(another checkpoint, or edited?)", where)
        out[abi_name] = x
    return out


def checkpoint_source(checkpoint: str | os.PathLike, cfg, layer: int, rank: int, which: str, fmt: str | None,
                      device="cpu", layout: str = LAYOUT, store_as: str | None = None) -> tuple[dict, dict]:
    """(entry, tensors) naming one rank's K1 or K2 weights by reference to the checkpoint folder
    `checkpoint`. The entry records its absolute path, or `store_as` (e.g. a path relative to
    the folder the capture will be written in)."""
    root = Path(checkpoint).resolve()
    plan = PLANS[layout](cfg, layer, rank, which, fmt)
    entry = {"source": "checkpoint", "layout": layout, "version": LAYOUT_VERSION, "checkpoint": str(root),
             "layer": int(layer), "rank": int(rank), "world": int(cfg.world), "which": which,
             "format": fmt if which == "k2" else None,
             "tensors": {n: dict(t, digest="") for n, t in sorted(plan.items())}}
    ts = load_checkpoint(entry, root, device, "none", f"weights.{which}", str(root))
    for n, t in ts.items():
        entry["tensors"][n]["digest"] = digest(t)
    if store_as is not None:
        entry["checkpoint"] = str(store_as)
    return entry, ts


__all__ = ["LAYOUT", "LAYOUT_VERSION", "ROOT_ENV", "PLANS", "kimi_k3_plan", "checkpoint_source", "load_checkpoint",
           "plan_check", "checkpoint_root"]
