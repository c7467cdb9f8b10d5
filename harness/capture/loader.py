"""Loading captures: one file (`load_capture`), one capture set (`load_set`), a corpus (`discover`).

`load_set` runs validate.py's checks in their order (headers and manifests, the ranks against
each other, config and keys, weight entries, launch shapes, index tensors) before it reads
tensor data; then it hashes the capture tensors and takes the weights from the per-process
WeightCache (sources.py) on `device`. Every failure is one InputError naming file and field.

Replay API::

    paths = discover(root)                 # every capture-set folder under root, sorted
    cs = load_set(path, verify="once", device="cpu")
    cs.cfg, cs.layer, cs.kind, cs.step, cs.world, cs.fmt, cs.k1_key, cs.k2_key
    cs.k1_args(rank, device, layout="compact"|"full")   # fresh tensors, K1 ABI names + layer
    cs.k2_args(rank, device)               # fresh tensors, K2 ABI names + layer (no rank/comm)
    cs.k2_world_args(device)               # [k2_args(r) for every rank], for ref.k2_world
    cs.after(rank, "k1"|"k2")              # what the producer wrote ({} if it recorded no after)
    cs.untouched(rank, layout)             # Untouched: slots/positions/rows the step must not write

Outputs (`core_out`, `out`) are POISON (a NaN with a recognisable payload). Cache slots and
bank rows a schema-2 capture does not store (the step neither reads them, nor, for slots,
reads before writing) are POISON_FINITE (finite: the launches' NaN check on inputs passes),
as is every slot of the full layout the capture does not carry. Weights are shared, read-only
(memory-mapped views of the weight file on the CPU): never write them.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from ref import abi
from ref.config import Config

from ..errors import InputError
from . import validate as V
from .format import K1_KINDS, K2_STATE, SLOT_MAP, handle, poison_, read_header, same_bits, tensor_sha256
from .slots import expand_rows, expand_slots, positions, remap_st_idx, step_slots
from .sources import CACHE, declared, verify_mode

SET_RE = re.compile(r"^s(\d+)_l(\d+)$")
RANK_RE = re.compile(r"^rank(\d+)\.safetensors$")


@dataclass
class Capture:
    """One capture file: its strict header, validated manifest and (memory-mapped) tensors."""

    path: Path
    manifest: dict
    tensors: dict
    header: object = None

    @property
    def where(self) -> str:
        return str(self.path)

    @property
    def schema(self) -> int:
        return self.manifest["schema"]

    def group(self, prefix: str) -> dict:
        return {n[len(prefix):]: t for n, t in self.tensors.items() if n.startswith(prefix)}


def _open_capture(path: Path) -> Capture:
    """Header and manifest of one capture, checked; no tensor data read."""
    hdr = read_header(path)
    man = V.check_manifest(hdr.manifest(), hdr.where)
    V.check_tensor_entries(hdr, man["tensors"], man.get("alias") or {})
    return Capture(path, man, {}, hdr)


def _read_tensors(c: Capture, verify: str) -> None:
    """Memory-map the capture's tensors; with verify, check every hash (captures are small)."""
    f = handle(c.header)
    alias = c.manifest.get("alias") or {}
    out = {}
    for name, e in c.manifest["tensors"].items():
        src = alias.get(name, name)
        out[name] = out[src] if src in out else f.get_tensor(src)
    if verify != "none":
        for name, e in c.manifest["tensors"].items():
            if name not in alias and tensor_sha256(out[name]) != e["sha256"]:
                raise InputError(name, "sha256 mismatch: the file is corrupt or was edited", c.where)
    c.tensors = out


def load_capture(path: str | os.PathLike, verify=True) -> Capture:
    """Read and verify one capture file (header, schema, manifest fields, tensor hashes)."""
    c = _open_capture(Path(path))
    _read_tensors(c, verify_mode(verify))
    return c


@dataclass
class Untouched:
    """What a step must not write, in one layout ('compact' or 'full').

    conv_slots / rstate_slots: whole slots that must come back bit-identical;
    conv_written: the conv slots the step writes, whose positions [conv_keep_from, SL)
    must not change; k1_block_rows: bank rows K1 must not write (K2 writes none).
    """

    layout: str
    conv_slots: list[int]
    conv_written: list[int]
    conv_keep_from: int
    rstate_slots: list[int]
    k1_block_rows: list[int]
    shapes: dict  # name -> logical shape of the tensors the masks apply to

    def masks(self) -> dict:
        """name -> bool mask (True = must not change), broadcastable to the tensor."""
        cs, rs, bl = self.shapes["conv_state"], self.shapes["rstate"], self.shapes["blocks"]
        conv = torch.zeros(cs[0], 1, cs[2], dtype=torch.bool)
        conv[self.conv_slots] = True
        if self.conv_written:
            conv[self.conv_written, :, self.conv_keep_from:] = True
        rst = torch.zeros(rs[0], 1, 1, 1, dtype=torch.bool)
        rst[self.rstate_slots] = True
        rows = torch.zeros(1, bl[1], 1, dtype=torch.bool)
        rows[:, self.k1_block_rows] = True
        return {"conv_state": conv.expand(cs), "rstate": rst.expand(rs), "blocks": rows.expand(bl)}

    def violations(self, before: dict, after: dict) -> dict:
        """name -> number of protected elements whose bits changed (only names with changes)."""
        out = {}
        for name, m in self.masks().items():
            if name in before and name in after:
                bad = int((~same_bits(before[name], after[name]).cpu() & m).sum())
                if bad:
                    out[name] = bad
        return out


class CaptureSet:
    """All ranks of one (step, layer), loaded and validated (see the module docstring)."""

    def __init__(self, path: Path, caps: list[Capture], cfg: Config | None, k1_key, k2_key, entries: list[dict],
                 verify: str = "once"):
        self.path = path
        self.captures = caps
        self._entries = entries  # per rank {"k1": entry | None, "k2": entry | None}
        self._verify = verify
        m = caps[0].manifest
        self.manifest = m
        self.schema = m["schema"]
        self.layer, self.kind, self.step, self.world = m["layer"], m["kind"], m["step"], m["world"]
        self.fmt = m["experts"]
        self.config_name = m["config"].get("name")
        self.cfg, self.k1_key, self.k2_key = cfg, k1_key, k2_key

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def ranks(self) -> range:
        return range(self.world)

    @property
    def has_k1(self) -> bool:
        return self.kind in K1_KINDS

    @property
    def has_k2(self) -> bool:
        return self.kind != "dense"

    def weight_entry(self, rank: int, which: str) -> dict | None:
        return self._entries[rank][which]

    def weights(self, rank: int, which: str, device="cpu") -> dict:
        """The weights of one rank's launch ('k1' or 'k2') on `device`, from the process's
        WeightCache: shared and read-only, never write them."""
        e = self._entries[rank][which]
        if e is None:
            return {}
        c = self.captures[rank]
        return CACHE.get(e, c.path.parent, device, self._verify, f"weights.{which}", c.where)

    # ---- state rebuild (schema 2 stores only what the step reads)
    def _cache(self, rank: int, name: str) -> torch.Tensor:
        """k1.in.<name> as the compact cache (slot i = slot_map[i]), a fresh CPU tensor."""
        c = self.captures[rank]
        t = c.tensors[f"k1.in.{name}"]
        if self.schema < 2:
            return t.clone()
        st = c.manifest["state"]
        smap = c.tensors[SLOT_MAP].tolist()
        lst = "conv_read" if name == "conv_state" else "rstate_read"
        return expand_slots(t, len(smap), positions(smap, st[lst]))

    def _bank(self, rank: int, prefix: str) -> torch.Tensor:
        t = self.captures[rank].tensors[f"{prefix}blocks"]
        if self.schema < 2:
            return t.clone()
        return expand_rows(t, self.captures[rank].manifest["bank_rows"])

    def k1_args(self, rank: int, device="cpu", layout: str = "compact", poison: bool = True) -> dict:
        """Fresh K1 launch kwargs (ABI names + layer): caches rebuilt in `layout`, core_out poisoned.

        compact: caches hold the carried slots only (slot i = slot_map[i]), st_idx remapped;
        full: caches of the original slot counts, st_idx as captured, other slots POISON_FINITE
        (zeros with poison=False).
        """
        if not self.has_k1:
            raise InputError("kind", f"layer {self.layer} is an MLA layer: it has no K1 launch", str(self.path))
        if layout not in ("compact", "full"):
            raise ValueError(f"layout: {layout!r} is neither compact nor full")
        cap = self.captures[rank]
        st = cap.manifest["state"]
        g = cap.group("k1.in.")
        smap = cap.tensors[SLOT_MAP]
        a = {n: (g[n].to(device, copy=True) if g.get(n) is not None else None)
             for n in ("prefix", "delta", "num_acc")}
        a["blocks"] = self._bank(rank, "k1.in.").to(device)
        conv_c, rs_c = self._cache(rank, "conv_state"), self._cache(rank, "rstate")
        if layout == "compact":
            conv, rs = conv_c, rs_c
            st_idx = remap_st_idx(g["st_idx"], smap)
        else:
            conv = torch.empty((st["conv_slots"],) + tuple(conv_c.shape[1:]), dtype=conv_c.dtype)
            rs = torch.empty((st["rec_slots"],) + tuple(rs_c.shape[1:]), dtype=rs_c.dtype)
            if poison:
                poison_(conv, finite=True), poison_(rs, finite=True)
            else:
                conv.zero_(), rs.zero_()
            conv[smap] = conv_c
            rs[smap] = rs_c
            st_idx = g["st_idx"].clone()
        if st["conv_layout"] == "slc":  # rebuild the transposed buffer the kernel saw
            conv = conv.to(device).transpose(1, 2).contiguous().transpose(1, 2)
        a.update(conv_state=conv.to(device), rstate=rs.to(device), st_idx=st_idx.to(device))
        a.update(self.weights(rank, "k1", device))
        core = torch.empty(g["prefix"].shape[0], conv_c.shape[1] // 3, dtype=g["prefix"].dtype, device=device)
        a["core_out"] = poison_(core) if poison else core.zero_()
        a["layer"] = self.layer
        return {n: a[n] for n in abi.K1_NAMES}

    def k2_args(self, rank: int, device="cpu", poison: bool = True) -> dict:
        """Fresh K2 launch kwargs (ABI names + layer; the caller adds rank and comm), out poisoned."""
        if not self.has_k2:
            raise InputError("kind", f"layer {self.layer} is a dense-MLP layer: it has no K2 launch", str(self.path))
        g = self.captures[rank].group("k2.in.")
        a = {n: g[n].to(device, copy=True) for n in K2_STATE if n != "blocks"}
        a["blocks"] = self._bank(rank, "k2.in.").to(device)
        a.update(self.weights(rank, "k2", device))
        a.setdefault("w13s", None)
        a.setdefault("w2s", None)
        out = torch.empty_like(a["prefix"])
        a["out"] = poison_(out) if poison else out.zero_()
        a["layer"] = self.layer
        return {n: a[n] for n in abi.K2_NAMES if n not in ("rank", "comm")}

    def k2_world_args(self, device="cpu") -> list[dict] | None:
        """Every rank's K2 args (None for a dense layer)."""
        if not self.has_k2:
            return None
        return [self.k2_args(r, device) for r in self.ranks]

    def after(self, rank: int, which: str) -> dict:
        """What the producer's kernel wrote: 'k1' (prefix, blocks, conv_state, rstate compact,
        core_out), 'k2' (prefix, out, blocks) or 'dense'. {} when the producer recorded none.
        Schema 2 stores the written slots and rows only: the rest is the input's (as loaded)."""
        if which not in ("k1", "k2", "dense"):
            raise ValueError(f"which: {which!r}")
        cap = self.captures[rank]
        g = dict(cap.group(f"{which}.after."))
        if self.schema < 2 or not g:
            return g
        st = cap.manifest["state"]
        if which == "k1":
            smap = cap.tensors[SLOT_MAP].tolist()
            for n, lst in (("conv_state", "conv_written"), ("rstate", "rstate_written")):
                if n in g:
                    g[n] = expand_slots(g[n], len(smap), positions(smap, st[lst]), base=self._cache(rank, n))
        if "blocks" in g:
            base = self._bank(rank, f"{which}.in." if which != "dense" else "k1.in.")
            base[:, :g["blocks"].shape[1]] = g["blocks"]
            g["blocks"] = base
        return g

    def inputs(self, rank: int, which: str) -> dict:
        """The input tensors of one launch as loaded ('k1' or 'k2'; caches compact, st_idx as
        captured, weights and outputs left out): what a schema-2 capture does not store
        (unread slots, bank rows) is POISON_FINITE. captures[rank].group(...) has them as stored."""
        g = dict(self.captures[rank].group(f"{which}.in."))
        if self.schema >= 2:
            if which == "k1":
                g.update(conv_state=self._cache(rank, "conv_state"), rstate=self._cache(rank, "rstate"))
            g["blocks"] = self._bank(rank, f"{which}.in.")
        return g

    def slots_read(self, rank: int) -> dict:
        """Original slot ids the K1 step reads and writes (conv_read, rstate_read, conv_written,
        rstate_written), from st_idx and num_acc."""
        g = self.captures[rank].group("k1.in.")
        return step_slots(g["st_idx"], g["num_acc"], self.k1_key.qlen)

    def untouched(self, rank: int, layout: str = "compact") -> Untouched:
        """Slots/positions/rows the K1 launch must leave bit-identical (DESIGN §5 exactness)."""
        if not self.has_k1:
            raise InputError("kind", f"layer {self.layer} is an MLA layer: no K1 state", str(self.path))
        cap = self.captures[rank]
        g = cap.group("k1.in.")
        smap = cap.tensors[SLOT_MAP].tolist()
        st = cap.manifest["state"]
        L, W = self.k1_key.qlen, self.weights(rank, "k1")["conv_w"].shape[1]
        idx = g["st_idx"][:, :L].tolist()
        na = g["num_acc"].tolist()
        conv_w = sorted({row[0] for row in idx if row[0] > 0})
        rs_w = sorted({v for row, a in zip(idx, na) if row[a - 1] > 0 for v in row if v > 0})
        if layout == "compact":
            conv_w, rs_w = positions(smap, conv_w), positions(smap, rs_w)
            n_conv = n_rs = len(smap)
        else:
            n_conv, n_rs = st["conv_slots"], st["rec_slots"]
        cs = (n_conv,) + tuple(g["conv_state"].shape[1:])
        rs = (n_rs,) + tuple(g["rstate"].shape[1:])
        rows = cap.manifest.get("bank_rows") or g["blocks"].shape[1]
        bl = (g["blocks"].shape[0], rows, g["blocks"].shape[2])
        wi = self.k1_key.write_idx
        return Untouched(layout=layout, conv_slots=sorted(set(range(n_conv)) - set(conv_w)), conv_written=conv_w,
                         conv_keep_from=W - 2 + L, rstate_slots=sorted(set(range(n_rs)) - set(rs_w)),
                         k1_block_rows=[b for b in range(bl[1]) if b != wi],
                         shapes={"conv_state": cs, "rstate": rs, "blocks": bl})


# --------------------------------------------------------------------------- discovery

def _listdir(d: Path, where: str | None = None) -> list[os.DirEntry]:
    try:
        with os.scandir(d) as it:
            return list(it)
    except PermissionError:
        raise InputError("captures", "folder cannot be listed (permission denied)", where or str(d)) from None
    except NotADirectoryError:
        raise InputError("captures", "not a folder", where or str(d)) from None
    except FileNotFoundError:
        raise InputError("captures", "folder not found", where or str(d)) from None
    except OSError as e:
        raise InputError("captures", f"folder cannot be listed ({e.strerror})", where or str(d)) from None


def discover(root: str | os.PathLike) -> list[Path]:
    """Every capture-set folder (holding rank*.safetensors) under root, sorted; root itself if
    it is one. Never descends into dot-folders (golden's .set.tmp-*/.set.old-*) or weights/;
    a folder that cannot be listed is an InputError, not a silent skip."""
    root = Path(root)
    if not os.path.lexists(root):
        raise InputError("captures", "folder not found", str(root))
    if root.is_file():
        return [root.parent]
    found: set[Path] = set()
    todo = [root]
    while todo:
        d = todo.pop()
        for e in _listdir(d):
            if e.name.startswith("."):
                continue
            if e.is_dir(follow_symlinks=False):
                if e.name != "weights":
                    todo.append(Path(e.path))
            elif RANK_RE.match(e.name):
                found.add(d)
    return sorted(found, key=lambda p: (str(p.parent), _set_order(p)))


def _set_order(p: Path):
    m = SET_RE.match(p.name)
    return (0, int(m.group(1)), int(m.group(2))) if m else (1, 0, 0)


# --------------------------------------------------------------------------- set loading

_CONSISTENT = ("schema", "layer", "kind", "step", "world", "config", "k1_key", "k2_key", "experts", "weight_layout",
               "bank_rows", "after")


def load_set(path: str | os.PathLike, verify=True, verify_weights=None, device="cpu") -> CaptureSet:
    """Load every rank of one capture set and validate it (DESIGN §8); InputError on any defect.

    verify: "once" (True, default) / "full" / "none" (False), see sources.py; verify_weights
    (default: as verify) for the weights alone. device: where the weights are loaded (and, for
    recipe weights, regenerated and their digests checked) while validating.
    """
    verify = verify_mode(verify)
    wverify = verify if verify_weights is None else verify_mode(verify_weights)
    path = Path(path)
    if path.is_file():
        path = path.parent
    if not path.is_dir():
        raise InputError("captures", "capture-set folder not found", str(path))
    files = {}
    for e in _listdir(path):
        m = RANK_RE.match(e.name)
        if m:
            files[int(m.group(1))] = Path(e.path)
    if not files:
        raise InputError("captures", "no rank*.safetensors in this folder", str(path))
    # 1. headers and manifests, value by value; no tensor data yet
    first = _open_capture(files[min(files)])
    world = first.manifest["world"]
    missing = [r for r in range(world) if r not in files]
    if missing:
        raise InputError("rank", f"missing rank(s) {missing} of world {world}", str(path))
    extra = sorted(r for r in files if r >= world)
    if extra:
        raise InputError("rank", f"rank file(s) {extra} beyond world {world}", str(path))
    caps = [first if r == min(files) else _open_capture(files[r]) for r in range(world)]
    cfg = V.parse_config(first.manifest, first.where)
    k1, k2 = V.parse_keys(first.manifest, first.where)
    # 2. each rank's config and keys, then the ranks against each other
    for c in caps[1:]:
        V.parse_config(c.manifest, c.where)
        V.parse_keys(c.manifest, c.where)
    for r, c in enumerate(caps):
        if c.manifest["rank"] != r:
            raise InputError("manifest.rank", f"{c.manifest['rank']} in file rank{r}.safetensors", c.where)
        for k in _CONSISTENT:
            if c.manifest.get(k) != first.manifest.get(k):
                raise InputError(f"manifest.{k}", f"differs from rank {min(files)}'s", c.where)
    # 3. weight entries and what they declare; 4. launch shapes, the config as the truth
    entries = []
    for c in caps:
        ent, wdecl = {}, {}
        for which in ("k1", "k2"):
            e = c.manifest["weights"].get(which)
            if e is None:
                ent[which], wdecl[which] = None, {}
                continue
            ent[which] = V.parse_weight_entry(e, which, c.manifest, c.where)
            wdecl[which] = declared(ent[which], c.path.parent, f"weights.{which}", c.where)
        V.check_launch_shapes(c.manifest, c.where, cfg, k1, k2, wdecl)
        entries.append(ent)
    # 5. the data: index tensors, hashes, weights, NaN/Inf of the inputs
    for c in caps:
        _read_tensors(c, "none")
        if k1 is not None:
            V.check_indices(c.manifest, c.where, k1, c.tensors["k1.in.st_idx"], c.tensors["k1.in.num_acc"],
                            c.tensors[SLOT_MAP])
        if verify != "none":
            _read_tensors(c, verify)
    cs = CaptureSet(path, caps, cfg, k1, k2, entries, wverify)
    for r, c in enumerate(caps):
        for which in ("k1", "k2"):
            cs.weights(r, which, device)
        if verify != "none":
            for n, t in c.tensors.items():
                if (n.startswith("k1.in.") or n.startswith("k2.in.")) and t.is_floating_point() \
                        and not bool(torch.isfinite(t).all()):
                    raise InputError(n, "contains NaN or Inf", c.where)
    return cs


def load_sets(root, verify=True, device="cpu") -> Iterable[CaptureSet]:
    for p in discover(root):
        yield load_set(p, verify, device=device)


__all__ = ["Capture", "CaptureSet", "Untouched", "load_capture", "load_set", "load_sets", "discover", "SET_RE",
           "RANK_RE"]
