"""Writing captures (schema 2, docs/capture-format.md). Writers never replace a file: it is
written under a temp name and hard-linked into place, which fails if the name exists.

What a schema-2 capture stores of a K1 step is what a replay reads: the conv and recurrent
state of the slots the step reads (slots.step_slots), the bank rows the launch reads; the
caches the producer wrote only at the written slots. `StepRecord.after = False` leaves out
what the producer's kernels wrote (a replay recomputes it; synth at k3-tp8 does so).

Producers call::

    rec = StepRecord(step=, layer=, rank=, world=, kind=, fmt=, k2_key=, k2_in=, k2_weights=W2,
                     k1_key=, k1_in=, k1_weights=W1, slot_map=, conv_slots=, rec_slots=, cfg=, after=)
    write_capture(root, rec, producer("k3verify synth", device))

where W1 / W2 name the weights by any source: a stored address (str, from store_weights),
or an entry dict (sources.stored_entry, sources.recipe_source(...)[0],
checkpoint.checkpoint_source(...)[0]).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ref.config import Config, K2Build, KdaPreBuild, key_to_dict

from ..errors import InputError
from .format import FORMAT, K1_KINDS, KINDS, META_KEY, SCHEMA, SLOT_MAP, WEIGHT_LAYOUT, canon, dtype_name, \
    tensor_sha256
from .slots import positions, step_slots


def set_dirname(step: int, layer: int) -> str:
    return f"s{step:05d}_l{layer:03d}"


def capture_path(root, step: int, layer: int, rank: int) -> Path:
    return Path(root) / set_dirname(step, layer) / f"rank{rank}.safetensors"


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def write_new(path: Path, tensors: dict, manifest: dict, exist_ok: bool = False) -> None:
    """Write a safetensors file without ever replacing an existing one (link, then unlink tmp)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={META_KEY: canon(manifest)})
        os.chmod(tmp, 0o666 & ~_umask())
        try:
            os.link(tmp, path)
        except FileExistsError:
            if not exist_ok:
                raise InputError("out", "a capture already exists here; nothing written over it", str(path)) from None
    finally:
        os.unlink(tmp)


@dataclass
class StepRecord:
    """Everything one capture holds, before it is written. Caches are given compact (the
    slot_map's slots); banks whole. k1_weights / k2_weights: a stored address or an entry."""

    step: int
    layer: int
    rank: int
    world: int
    kind: str  # kda | mla | dense
    fmt: str
    k2_key: K2Build | None  # None for a dense layer (no K2)
    k2_in: dict | None  # core, prefix, blocks
    k2_weights: str | dict | None
    k2_after: dict | None = None
    k1_key: KdaPreBuild | None = None
    dense_after: dict | None = None  # dense layer: {"out": MLP output (next layer's delta), "prefix"}
    k1_in: dict | None = None  # prefix, delta, blocks, conv_state, rstate (compact), st_idx (orig), num_acc
    k1_weights: str | dict | None = None
    k1_after: dict | None = None
    slot_map: torch.Tensor | None = None
    conv_slots: int | None = None  # slot counts of the original caches
    rec_slots: int | None = None
    conv_layout: str = "csl"
    cfg: Config | None = None
    dims: dict | None = None  # when cfg is None: dims inferred from the tensors
    meta: dict = field(default_factory=dict)
    after: bool = True  # store what the producer's kernels wrote (k1.after.*, k2.after.*)


def _weights_entry(w, rel: str) -> dict | None:
    if w is None:
        return None
    if isinstance(w, str):
        return {"source": "stored", "sha256": w, "file": f"{rel}/{w}.safetensors"}
    if not isinstance(w, dict):
        raise TypeError(f"weights: a stored address or a source entry, got {type(w).__name__}")
    if w.get("source", "stored") == "stored" and "file" not in w:
        return dict(w, source="stored", file=f"{rel}/{w['sha256']}.safetensors")
    return dict(w)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    return t[:, :n]


def _slots(t: torch.Tensor, at: list[int]) -> torch.Tensor:
    return t.index_select(0, torch.tensor(at, dtype=torch.int64, device=t.device))


def write_capture(root, rec: StepRecord, producer_info: dict) -> Path:
    """Write one capture file (schema 2); refuse to replace an existing one. Returns its path."""
    path = capture_path(root, rec.step, rec.layer, rec.rank)
    if path.exists():
        raise InputError("out", "a capture already exists here; nothing written over it", str(path))
    if rec.kind not in KINDS:
        raise ValueError(f"kind: {rec.kind!r}")
    named: list[tuple[str, torch.Tensor]] = []

    def add(prefix: str, d: dict | None, fix=None):
        for n, t in (d or {}).items():
            if t is not None:
                named.append((prefix + n, (fix or {}).get(n, lambda x: x)(t)))

    state = None
    bank = (rec.k1_in or rec.k2_in)["blocks"].shape[1]
    if rec.kind in K1_KINDS:
        key, smap = rec.k1_key, rec.slot_map.to(torch.int64).cpu()
        sl = step_slots(rec.k1_in["st_idx"], rec.k1_in["num_acc"], key.qlen)
        pos = {k: positions(smap.tolist(), v) for k, v in sl.items()}
        rows_after = min(bank, key.nblocks + (key.write_idx >= 0))
        add("k1.in.", rec.k1_in, {"blocks": lambda t: _rows(t, key.nblocks),
                                  "conv_state": lambda t: _slots(t, pos["conv_read"]),
                                  "rstate": lambda t: _slots(t, pos["rstate_read"])})
        if rec.after:
            add("k1.after.", rec.k1_after, {"blocks": lambda t: _rows(t, rows_after),
                                            "conv_state": lambda t: _slots(t, pos["conv_written"]),
                                            "rstate": lambda t: _slots(t, pos["rstate_written"])})
        named.append((SLOT_MAP, smap))
        state = {"slot_map": SLOT_MAP, "conv_slots": rec.conv_slots, "rec_slots": rec.rec_slots,
                 "conv_layout": rec.conv_layout, **sl}
    if rec.kind == "dense":
        add("dense.after.", rec.dense_after)
    else:
        nb = rec.k2_key.nblocks
        add("k2.in.", rec.k2_in, {"blocks": lambda t: _rows(t, nb)})
        if rec.after:
            add("k2.after.", rec.k2_after, {"blocks": lambda t: _rows(t, nb)})
    entries, alias, data, seen = {}, {}, {}, {}
    for name, t in named:
        t = t.detach().cpu().contiguous()
        e = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "sha256": tensor_sha256(t)}
        entries[name] = e
        k = (e["dtype"], tuple(e["shape"]), e["sha256"])
        if k in seen:  # bit-identical to an earlier tensor: stored once
            alias[name] = seen[k]
        else:
            seen[k] = name
            data[name] = t
    rel = os.path.relpath(Path(root) / "weights", path.parent)
    man = {
        "format": FORMAT, "schema": SCHEMA,
        "layer": rec.layer, "kind": rec.kind, "step": rec.step, "rank": rec.rank, "world": rec.world,
        "config": {"name": rec.cfg.name if rec.cfg else None,
                   "dims": rec.cfg.dims() if rec.cfg else (rec.dims or {})},
        "k1_key": key_to_dict(rec.k1_key) if rec.k1_key is not None else None,
        "k2_key": key_to_dict(rec.k2_key) if rec.k2_key is not None else None,
        "experts": rec.fmt, "weight_layout": WEIGHT_LAYOUT,
        "producer": producer_info,
        "weights": {"k1": _weights_entry(rec.k1_weights, rel), "k2": _weights_entry(rec.k2_weights, rel)},
        "tensors": entries, "alias": alias, "state": state, "bank_rows": int(bank), "after": bool(rec.after),
        "meta": rec.meta,
    }
    write_new(path, data, man)
    return path


def capture_bytes(path) -> int:
    """Bytes a capture file takes on disk."""
    return Path(path).stat().st_size


__all__ = ["StepRecord", "write_capture", "write_new", "set_dirname", "capture_path", "capture_bytes"]
