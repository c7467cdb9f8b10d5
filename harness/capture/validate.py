"""The one place capture input is parsed and checked (DESIGN §8, issue M): every failure is
one InputError naming the file and the field, raised before anything large is read.

Order, per capture set (harness.capture.loader.load_set):
1. each rank file's safetensors header (format.read_header) and its manifest, value by value
   (`check_manifest`: types and ranges, the tensor names of the schema, the state and weight
   blocks); the file's tensors against the manifest's list (`check_tensor_entries`);
2. the ranks against each other; the config and the build keys (`parse_config`, `parse_keys`);
3. the weight entries (`parse_weight_entry`) and what they declare (a stored file's header, a
   checkpoint's shard headers) against the manifest;
4. the launch rule of ref/abi.py on shape-only ("meta") tensors of the declared shapes, with
   the config's dims as the truth (`check_launch_shapes`): a tensor that disagrees with the
   config is blamed, and a 2 GiB tensor declared in a sparse file is refused before it is read;
5. only then the small index tensors (`check_indices`: num_acc, slots, the slot lists), then
   the hashes of the rest, then the weights (sources.py), then NaN/Inf in the inputs.

ref.abi's ArgError names a launch argument (`prefix`, `key.topk`); `as_input_error`
translates it to the capture's field (`k1.in.prefix`, `weights.k2.w13`, `k2_key.topk`).
"""
from __future__ import annotations

import re

import torch

from ref import abi
from ref.config import EXPERT_FORMATS, Config, K2Build, KdaPreBuild

from ..errors import InputError
from .format import (DENSE_AFTER, DTYPES, FORMAT, GROUPS, K1_AFTER, K1_KINDS, K1_STATE, K1_WEIGHTS, K2_AFTER,
                     K2_STATE, K2_WEIGHTS, KIND_GROUPS, KINDS, READS, SLOT_MAP, WEIGHT_LAYOUT, WEIGHTS_FORMAT,
                     st_dtype)
from .slots import step_slots

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
WORLDS = (1, 2, 4, 8)
SLOT_LISTS = ("conv_read", "rstate_read", "conv_written", "rstate_written")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _need(cond: bool, field: str, msg: str, where: str) -> None:
    if not cond:
        raise InputError(field, msg, where)


def _int(d: dict, k: str, field: str, where: str, lo: int = 0, hi: int | None = None) -> int:
    v = d.get(k)
    rng = f"≥ {lo}" if hi is None else f"in {lo}..{hi}"
    _need(_is_int(v) and v >= lo and (hi is None or v <= hi), field,
          f"{v!r} is not an int {rng}" if k in d else "missing", where)
    return v


def _typed(d: dict, k: str, ty, field: str, where: str, optional: bool = False):
    v = d.get(k)
    if v is None and optional:
        return None
    names = {dict: "an object", list: "a list", str: "a string", bool: "a bool"}
    _need(isinstance(v, ty), field, f"{type(v).__name__} {v!r:.60}, expected {names.get(ty, ty)}"
          if k in d else "missing", where)
    return v


# --------------------------------------------------------------------------- tensor lists

def _tensor_entry(name: str, e, field: str, where: str, hash_key: str = "sha256") -> dict:
    _need(isinstance(e, dict), field, "not an object", where)
    dt = e.get("dtype")
    _need(isinstance(dt, str) and dt in DTYPES, f"{field}.dtype",
          f"{dt!r:.60} is not one of {', '.join(DTYPES)}", where)
    sh = e.get("shape")
    _need(isinstance(sh, list) and all(_is_int(x) and x >= 0 for x in sh), f"{field}.shape",
          f"{sh!r:.60} is not a list of non-negative ints", where)
    h = e.get(hash_key)
    if hash_key == "sha256":
        _need(isinstance(h, str) and bool(_HEX64.match(h)), f"{field}.sha256", f"{h!r:.80} is not 64 hex digits",
              where)
    else:
        _need(isinstance(h, str) and ":" in h, f"{field}.{hash_key}", f"{h!r:.80} is not a digest", where)
    return e


def check_tensor_entries(hdr, entries: dict, alias: dict) -> None:
    """The file's tensors (header) against the manifest's list: same names (aliases point at
    stored tensors), dtypes and shapes. Reads no data."""
    where = hdr.where
    stored = set(hdr.tensors)
    for name in sorted(stored - set(entries)):
        raise InputError(name, "tensor in the file but not in the manifest", where)
    for name, e in entries.items():
        src = alias.get(name, name)
        if src not in stored:
            raise InputError(name, "listed in the manifest but missing from the file"
                             + (f" (alias of {src})" if src != name else ""), where)
        h = hdr.tensors[src]
        if h["dtype"] != st_dtype(e["dtype"]) or list(h["shape"]) != list(e["shape"]):
            raise InputError(name, f"file has {h['dtype']} {h['shape']}, manifest says {e['dtype']} {e['shape']}",
                             where)


def check_weights_manifest(man: dict, where: str) -> dict:
    """A stored weight file's manifest -> its tensor entries (validated)."""
    from .sources import WEIGHTS_SCHEMA, weights_address

    _need(man.get("format") == WEIGHTS_FORMAT, "manifest.format", f"{man.get('format')!r:.60}, expected "
                                                                   f"{WEIGHTS_FORMAT!r}", where)
    _need(man.get("schema") == WEIGHTS_SCHEMA, "manifest.schema", f"unknown weight-file schema version "
                                                                  f"{man.get('schema')!r:.40} (this k3verify reads "
                                                                  f"{WEIGHTS_SCHEMA})", where)
    ents = _typed(man, "tensors", dict, "manifest.tensors", where)
    for n, e in ents.items():
        _need(n in K1_WEIGHTS or n in K2_WEIGHTS or n == "w_dense", f"manifest.tensors.{n}",
              "not a weight of the K1 or K2 ABI", where)
        _tensor_entry(n, e, f"manifest.tensors.{n}", where)
    _need(isinstance(man.get("address"), str) and man["address"] == weights_address(ents), "address",
          "file name / manifest address / tensor list disagree", where)
    return ents


# --------------------------------------------------------------------------- the capture manifest

def check_manifest(man: dict, where: str) -> dict:
    """Types and ranges of every manifest value; returns it (unchanged) when it passes."""
    _need(man.get("format") == FORMAT, "manifest.format", f"{man.get('format')!r:.60}, expected {FORMAT!r}", where)
    schema = man.get("schema")
    _need(_is_int(schema) and schema in READS, "manifest.schema",
          f"unknown schema version {schema!r:.40} (this k3verify reads versions {', '.join(map(str, READS))})",
          where)
    _int(man, "layer", "manifest.layer", where)
    _int(man, "step", "manifest.step", where)
    kind = _typed(man, "kind", str, "manifest.kind", where)
    _need(kind in KINDS, "manifest.kind", f"{kind!r:.40} is not one of {', '.join(KINDS)}", where)
    world = _int(man, "world", "manifest.world", where, 1)
    _need(world in WORLDS, "manifest.world", f"{world} is not one of {WORLDS}", where)
    _int(man, "rank", "manifest.rank", where, 0, world - 1)
    cfg = _typed(man, "config", dict, "manifest.config", where)
    _typed(cfg, "name", str, "manifest.config.name", where, optional=True)
    _typed(cfg, "dims", dict, "manifest.config.dims", where)
    fmt = _typed(man, "experts", str, "manifest.experts", where)
    _need(fmt in EXPERT_FORMATS, "manifest.experts", f"{fmt!r:.40} is not one of {', '.join(EXPERT_FORMATS)}", where)
    lay = _typed(man, "weight_layout", str, "manifest.weight_layout", where)
    _need(lay == WEIGHT_LAYOUT, "manifest.weight_layout", f"{lay!r:.40}, this loader reads {WEIGHT_LAYOUT!r}", where)
    _typed(man, "producer", dict, "manifest.producer", where)
    _typed(man, "meta", dict, "manifest.meta", where, optional=True)
    for k, need in (("k1_key", kind in K1_KINDS), ("k2_key", kind != "dense")):
        v = man.get(k)
        _need(isinstance(v, dict) if need else v is None, f"manifest.{k}",
              ("missing or not an object" if need else f"must be null for a {kind} layer"), where)
    weights = _typed(man, "weights", dict, "manifest.weights", where)
    for k, need in (("k1", kind in K1_KINDS), ("k2", kind != "dense")):
        v = weights.get(k)
        _need(v is not None if need else v is None, f"manifest.weights.{k}",
              "missing" if need else f"must be null for a {kind} layer", where)
    tensors = _typed(man, "tensors", dict, "manifest.tensors", where)
    groups = KIND_GROUPS[kind]
    for n, e in tensors.items():
        g = next((p for p in groups if n.startswith(p) and n[len(p):] in GROUPS[p]), None)
        _need(g is not None or (n == SLOT_MAP and kind in K1_KINDS), n,
              f"unknown tensor for a {kind} capture of schema {schema}", where)
        _tensor_entry(n, e, f"manifest.tensors.{n}", where)
    alias = man.get("alias") or {}
    _need(isinstance(alias, dict), "manifest.alias", "not an object", where)
    for a, src in alias.items():
        _need(a in tensors and isinstance(src, str) and src in tensors and src not in alias, f"manifest.alias.{a}",
              f"{src!r:.60} is not a stored tensor of this capture", where)
    st = man.get("state")
    if kind not in K1_KINDS:
        _need(st is None, "manifest.state", f"must be null for a {kind} layer", where)
    else:
        _need(isinstance(st, dict), "manifest.state", "missing or not an object", where)
        _need(st.get("slot_map") == SLOT_MAP, "manifest.state.slot_map", f"{st.get('slot_map')!r:.40}, expected "
                                                                          f"{SLOT_MAP!r}", where)
        _int(st, "conv_slots", "manifest.state.conv_slots", where, 1)
        _int(st, "rec_slots", "manifest.state.rec_slots", where, 1)
        _need(st.get("conv_layout") in ("csl", "slc"), "manifest.state.conv_layout",
              f"{st.get('conv_layout')!r:.40} is neither csl nor slc", where)
        if schema >= 2:
            for k in SLOT_LISTS:
                v = st.get(k)
                _need(isinstance(v, list) and all(_is_int(x) and x >= 0 for x in v) and v == sorted(set(v)),
                      f"manifest.state.{k}", f"{v!r:.60} is not a sorted list of distinct slot ids", where)
    if schema >= 2:
        _int(man, "bank_rows", "manifest.bank_rows", where, 1)
        _typed(man, "after", bool, "manifest.after", where)
    return man


def parse_config(man: dict, where: str) -> Config | None:
    """The manifest's Config (None when the producer had none: config.name null)."""
    c = man["config"]
    if c.get("name") is None:
        return None
    dims = c["dims"]
    try:
        cfg = Config.from_dims(dims)
    except (KeyError, TypeError, ValueError) as e:
        raise InputError("manifest.config.dims", f"not a config ({e!r:.120})", where) from None
    for f in ("world", "hidden", "nh", "hd", "rank", "conv", "experts", "topk", "lat", "ri", "si", "layers",
              "block_size"):
        _int(dims, f, f"manifest.config.dims.{f}", where, 1)
    _need(cfg.hidden % cfg.world == 0, "manifest.config.dims.hidden", f"{cfg.hidden} not divisible by world "
                                                                       f"{cfg.world}", where)
    return cfg


def parse_keys(man: dict, where: str) -> tuple[KdaPreBuild | None, K2Build | None]:
    """Both build keys, every field typed and in range (ref.abi.check_key)."""
    out = []
    for fld, cls in (("k1_key", KdaPreBuild), ("k2_key", K2Build)):
        d = man.get(fld)
        if d is None:
            out.append(None)
            continue
        try:
            from ref.config import key_from_dict

            key = key_from_dict(cls, d)
        except (KeyError, TypeError) as e:
            raise InputError(f"manifest.{fld}", f"bad build key (missing field {e})", where) from None
        extra = sorted(set(d) - set(cls.__dataclass_fields__))
        _need(not extra, f"{fld}.{extra[0] if extra else ''}", "not a field of the build key", where)
        try:
            abi.check_key(key)
        except abi.ArgError as e:
            raise as_input_error(e, fld[:2], where) from None
        out.append(key)
    return out[0], out[1]


# --------------------------------------------------------------------------- weight entries

def parse_weight_entry(e, which: str, man: dict, where: str) -> dict:
    """A manifest weight entry of any source (schema 1: stored, without "source"), typed; a
    recipe or checkpoint entry must name this capture's layer, rank, world, launch, format."""
    field = f"weights.{which}"
    _need(isinstance(e, dict), f"manifest.{field}", "not an object", where)
    src = e.get("source", "stored")
    from .sources import SOURCES

    _need(src in SOURCES, f"{field}.source", f"{src!r:.40} is not one of {', '.join(SOURCES)}", where)
    if src == "stored":
        h = e.get("sha256")
        _need(isinstance(h, str) and bool(_HEX64.match(h)), f"{field}.sha256", f"{h!r:.80} is not 64 hex digits",
              where)
        _typed(e, "file", str, f"{field}.file", where, optional=True)
        return dict(e, source="stored")
    if src == "recipe":
        from ref import synth as rsynth

        g = _typed(e, "generator", str, f"{field}.generator", where)
        _need(g == rsynth.GENERATOR, f"{field}.generator", f"{g!r:.60}: this k3verify has generator "
                                                           f"{rsynth.GENERATOR!r}", where)
        v = e.get("version")
        _need(v == rsynth.VERSION and _is_int(v), f"{field}.version",
              f"generator {g} version {v!r:.20} is unknown here (this k3verify generates version {rsynth.VERSION})",
              where)
        _int(e, "seed", f"{field}.seed", where)
        c = _typed(e, "config", dict, f"{field}.config", where)
        _typed(c, "dims", dict, f"{field}.config.dims", where)
        try:
            cfg = Config.from_dims(c["dims"])
        except (KeyError, TypeError, ValueError) as x:
            raise InputError(f"{field}.config.dims", f"not a config ({x!r:.120})", where) from None
        _need(c["dims"] == man["config"]["dims"], f"{field}.config.dims", "differs from the capture's config",
              where)
        _need(cfg.world == e.get("world"), f"{field}.world", f"{e.get('world')!r} but its config is split for "
                                                             f"{cfg.world}", where)
        _need(e.get("which") in rsynth.WHICH, f"{field}.which", f"{e.get('which')!r:.20} is not one of "
                                                                f"{', '.join(rsynth.WHICH)}", where)
        hk = "digest"
    else:
        from .checkpoint import LAYOUT_VERSION, PLANS

        lay = e.get("layout")
        _need(lay in PLANS, f"{field}.layout", f"{lay!r:.40} is not one of {', '.join(PLANS)}", where)
        _need(e.get("version") == LAYOUT_VERSION, f"{field}.version", f"layout {lay} version {e.get('version')!r:.20}"
                                                                      f" is unknown here (this k3verify reads "
                                                                      f"{LAYOUT_VERSION})", where)
        _typed(e, "checkpoint", str, f"{field}.checkpoint", where)
        hk = "digest"
    for k in ("layer", "rank", "world"):
        _need(e.get(k) == man[k] and _is_int(e.get(k)), f"{field}.{k}", f"{e.get(k)!r:.20} but the capture's "
                                                                        f"{k} is {man[k]}", where)
    _need(e.get("which") == which, f"{field}.which", f"{e.get('which')!r:.20} in the {which} slot", where)
    if which == "k2":
        _need(e.get("format") == man["experts"], f"{field}.format", f"{e.get('format')!r:.20} but the capture's "
                                                                     f"experts are {man['experts']}", where)
    ts = _typed(e, "tensors", dict, f"{field}.tensors", where)
    names = K1_WEIGHTS if which == "k1" else K2_WEIGHTS
    for n, t in ts.items():
        _need(n in names, f"{field}.tensors.{n}", f"not a {which} weight", where)
        _tensor_entry(n, t, f"{field}.tensors.{n}", where, hk)
        if src == "checkpoint":
            _int(t, "cat", f"{field}.tensors.{n}.cat", where, 0, len(t["shape"]) - 1 if t["shape"] else 0)
            parts = _typed(t, "parts", list, f"{field}.tensors.{n}.parts", where)
            _need(bool(parts), f"{field}.tensors.{n}.parts", "empty", where)
            for i, p in enumerate(parts):
                _check_part(p, f"{field}.tensors.{n}.parts[{i}]", where)
    return e


def _check_part(p, field: str, where: str) -> None:
    _need(isinstance(p, dict), field, "not an object", where)
    if "zeros" in p:
        z = p["zeros"]
        _need(set(p) == {"zeros"} and isinstance(z, list) and all(_is_int(x) and x >= 0 for x in z), field,
              "zeros must be a list of non-negative ints, alone", where)
        return
    _need(set(p) <= {"name", "narrow", "view", "experts"}, field, f"unknown keys {sorted(set(p))}", where)
    _typed(p, "name", str, f"{field}.name", where)
    for k, n in (("narrow", 3), ("view", None)):
        if k in p:
            v = p[k]
            _need(isinstance(v, list) and all(_is_int(x) and x >= 0 for x in v) and (n is None or len(v) == n),
                  f"{field}.{k}", f"{v!r:.60} is not a list of {n or 'some'} non-negative ints", where)
    if "experts" in p:
        _int(p, "experts", f"{field}.experts", where, 1, 1 << 16)
        _need("{e}" in p["name"], f"{field}.name", "an expert stack needs {e} in the name", where)


# --------------------------------------------------------------------------- ArgError -> InputError

def as_input_error(e: abi.ArgError, kernel: str, where: str) -> InputError:
    """Name the field as the capture does: k1.in.prefix, weights.k2.w13, k2_key.topk, ..."""
    f = e.field
    state, weights = (K1_STATE + ("core_out",), K1_WEIGHTS) if kernel == "k1" else (K2_STATE + ("out",), K2_WEIGHTS)
    if f.startswith("key."):
        f = f"{kernel}_key.{f[4:]}"
    elif f in state:
        f = f"{kernel}.in.{f}"
    elif f in weights:
        f = f"weights.{kernel}.{f}"
    elif f == "rank":
        f = "manifest.rank"
    return InputError(f, str(e).split(": ", 1)[-1], where)


def expected_dims(cfg: Config | None, man: dict) -> dict:
    """The dims the tensors must have: the config's, or (no config) the manifest's dims."""
    if cfg is not None:
        return abi.dims_of(cfg)
    d = man["config"]["dims"]
    pairs = {"H": "hidden", "P": "p", "NH": "nh", "HD": "hd", "RK": "rank", "W": "conv", "NP": "nproj", "C": "qkv",
             "NB": "nbmax", "E": "experts", "LAT": "lat", "SI": "si", "UP": "up_n"}
    out = {s: d[k] for s, k in pairs.items() if _is_int(d.get(k))}
    if _is_int(d.get("ri")):
        out["RI2"] = 2 * d["ri"]
    return out


# --------------------------------------------------------------------------- shapes before data

def _meta(dtype: str, shape) -> torch.Tensor:
    return torch.empty(shape, dtype=DTYPES[dtype], device="meta")


def check_launch_shapes(man: dict, where: str, cfg: Config | None, k1: KdaPreBuild | None, k2: K2Build | None,
                        wdecl: dict) -> None:
    """The launch rule (ref.abi.check_k1 / check_k2) on shape-only tensors of the declared
    dtypes and shapes, the config's dims as the truth; then what the producer wrote against
    the inputs. wdecl: {"k1"/"k2": {weight name: (dtype, shape)}}. Reads no tensor data."""
    ts, kind, v2 = man["tensors"], man["kind"], man["schema"] >= 2
    dims = expected_dims(cfg, man)
    if cfg is not None:
        _need(cfg.kind(man["layer"]) == kind, "manifest.kind",
              f"{kind} but config {cfg.name} makes layer {man['layer']} {cfg.kind(man['layer'])}", where)
        _need(cfg.world == man["world"], "manifest.world", f"{man['world']} but config {cfg.name} is split for "
                                                           f"{cfg.world}", where)
    if k2 is not None:
        _need(man["experts"] == k2.experts, "manifest.experts", f"{man['experts']!r} but k2_key.experts is "
                                                                f"{k2.experts!r}", where)
    if k1 is not None and k2 is not None:
        _need(k1.tokens == k2.tokens, "k2_key.tokens", f"{k2.tokens} but k1_key.tokens is {k1.tokens}", where)

    def decl(n):
        e = ts.get(n)
        return None if e is None else (e["dtype"], list(e["shape"]))

    def need(n):
        d = decl(n)
        _need(d is not None, n, "missing", where)
        return d

    rows = man.get("bank_rows")

    def bank(n, least: int):
        """A bank's meta tensor: schema 2 stores its leading rows, the rest is poison on load."""
        dt, sh = need(n)
        if len(sh) != 3 or not v2:
            return _meta(dt, sh)
        _need(least <= sh[1] <= rows, n, f"{sh[1]} rows stored, the step needs {least} of the bank's {rows}", where)
        return _meta(dt, [sh[0], rows, sh[2]])

    def weights(which):
        return {n: _meta(dt, sh) for n, (dt, sh) in wdecl[which].items()}

    if k1 is not None:
        st = man["state"]
        dm, sm = need(SLOT_MAP)
        _need(dm == "int64" and len(sm) == 1 and sm[0] >= 1, SLOT_MAP, f"{dm} {sm}, expected int64 [n ≥ 1]", where)
        n_map = sm[0]
        caches = {}
        for c, lst in (("conv_state", "conv_read"), ("rstate", "rstate_read")):
            dt, sh = need(f"k1.in.{c}")
            _need(len(sh) >= 1, f"k1.in.{c}", f"shape {sh} has no slot dim", where)
            if v2:
                _need(sh[0] == len(st[lst]), f"k1.in.{c}", f"{sh[0]} slots stored, manifest.state.{lst} lists "
                                                           f"{len(st[lst])}", where)
                sh = [n_map] + sh[1:]
            _need(sh[0] == n_map, SLOT_MAP, f"{n_map} slots but the caches carry {need('k1.in.conv_state')[1][:1]} / "
                                            f"{need('k1.in.rstate')[1][:1]}", where)
            caches[c] = _meta(dt, sh)
        pdt, psh = need("k1.in.prefix")
        P = dims.get("P") or (caches["conv_state"].shape[1] // 3 if caches["conv_state"].dim() > 1 else 0)
        args = dict(prefix=_meta(pdt, psh), delta=None if decl("k1.in.delta") is None else _meta(*decl("k1.in.delta")),
                    blocks=bank("k1.in.blocks", k1.nblocks), **caches, st_idx=_meta(*need("k1.in.st_idx")),
                    num_acc=_meta(*need("k1.in.num_acc")),
                    core_out=_meta("bfloat16", [psh[0] if psh else 0, P]), **weights("k1"))
        try:
            abi.check_k1(k1, args, "exact", expect=dims, data=False)
        except abi.ArgError as e:
            raise as_input_error(e, "k1", where) from None
        _after(man, where, "k1.after.", args, {"conv_state": "conv_written", "rstate": "rstate_written"},
               k1.nblocks + (k1.write_idx >= 0))
        _after(man, where, "dense.after.", {"prefix": args["prefix"], "out": args["prefix"]}, {}, 0)
    if k2 is not None:
        args = dict(core=_meta(*need("k2.in.core")), prefix=_meta(*need("k2.in.prefix")),
                    blocks=bank("k2.in.blocks", k2.nblocks), out=_meta(*need("k2.in.prefix")), **weights("k2"))
        args.setdefault("w13s", None)
        args.setdefault("w2s", None)
        try:
            abi.check_k2(k2, args, "exact", rank=man["rank"], world=man["world"], expect=dims, data=False)
        except abi.ArgError as e:
            raise as_input_error(e, "k2", where) from None
        _after(man, where, "k2.after.", args, {}, k2.nblocks)


def _after(man: dict, where: str, prefix: str, ins: dict, slot_lists: dict, rows_least: int) -> None:
    """What the producer wrote must have its input's dtype and shape (schema 2: caches hold the
    written slots only, banks their leading rows)."""
    v2 = man["schema"] >= 2
    for n in GROUPS[prefix]:
        e = man["tensors"].get(prefix + n)
        if e is None:
            continue
        ref_t = ins.get("core_out" if n == "core_out" else n)
        if n == "out" and prefix == "k2.after.":
            ref_t = ins["prefix"]
        if ref_t is None:
            continue
        want = list(ref_t.shape)
        got = list(e["shape"])
        if v2 and n in slot_lists and got:
            want[0] = len(man["state"][slot_lists[n]])
        if v2 and n == "blocks" and len(got) == 3 and rows_least <= got[1] <= want[1]:
            want[1] = got[1]
        _need(got == want and e["dtype"] == str(ref_t.dtype).removeprefix("torch."), prefix + n,
              f"{e['dtype']} {got} does not match its input ({str(ref_t.dtype).removeprefix('torch.')} {want})",
              where)


# --------------------------------------------------------------------------- the index tensors

def check_indices(man: dict, where: str, k1: KdaPreBuild, st_idx: torch.Tensor, num_acc: torch.Tensor,
                  slot_map: torch.Tensor) -> None:
    """num_acc in 1..L, slots inside the original caches and carried, the slot map, and (schema
    2) the declared read/written slot lists against the ones st_idx and num_acc imply."""
    st = man["state"]
    L = k1.qlen
    try:
        abi.check_k1_indices(st_idx, num_acc, L, st["conv_slots"], st["rec_slots"])
    except abi.ArgError as e:
        raise as_input_error(e, "k1", where) from None
    sm = slot_map.tolist()
    _need(bool(sm) and sm[0] == 0 and len(set(sm)) == len(sm) and min(sm) >= 0, SLOT_MAP,
          "must start with the null slot 0 and list distinct slots", where)
    for k, what in (("rec_slots", "recurrent"), ("conv_slots", "conv")):
        _need(max(sm) < st[k], SLOT_MAP, f"slot {max(sm)} outside the {what} cache ({st[k]} slots)", where)
    used = {int(v) for v in st_idx[:, :L].reshape(-1).tolist() if v > 0}
    for v in sorted(used - set(sm)):
        raise InputError("k1.in.st_idx", f"slot {v} is referenced but not carried in state.slot_map", where)
    if man["schema"] >= 2:
        got = step_slots(st_idx, num_acc, L)
        for k in SLOT_LISTS:
            _need(st[k] == got[k], f"manifest.state.{k}", f"{st[k]} but st_idx and num_acc give {got[k]}", where)


__all__ = ["check_manifest", "check_tensor_entries", "check_weights_manifest", "parse_config", "parse_keys",
           "parse_weight_entry", "as_input_error", "expected_dims", "check_launch_shapes", "check_indices",
           "SLOT_LISTS"]
