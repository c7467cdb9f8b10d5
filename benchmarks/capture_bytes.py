"""Bytes a schema-2 capture takes at a config's real shapes, without running the model.

    PYTHONPATH=. python benchmarks/capture_bytes.py [--config k3-tp8] [--layers 1-2] [--requests 1]
        [--num-spec 3] [--steps 8] [--after no|yes] [--weights recipe|stored]

Writes one capture per (layer, rank) of one decode step with random tensors of the shapes the
launches have (S = requests × (num_spec + 1)), and the weights named as synth names them
(recipe entries, or stored: the weight files' sizes counted from the shapes), then prints the
bytes per capture and the total of a corpus of `steps` steps. Random content: safetensors
stores raw bytes, so the size depends on shapes and dtypes only.
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _entry(cfg, layer, rank, fmt, which, seed=0) -> tuple[dict, int]:
    """A recipe entry of the generator's shapes (meta tensors; a digest of the real length) and
    the bytes its tensors hold."""
    from harness import capture as cap
    from ref import synth as rsynth

    dev = "cpu" if which == "k1" else "meta"  # k1's generator reads a_log on the host; it is small
    ts = {n: t for n, t in rsynth.weights(which, cfg, layer, rank, fmt, seed, dev).items() if t is not None}
    e = {"source": "recipe", "generator": rsynth.GENERATOR, "version": rsynth.VERSION, "seed": seed,
         "config": {"name": cfg.name, "dims": cfg.dims()}, "layer": layer, "rank": rank, "world": cfg.world,
         "which": which, "format": fmt if which == "k2" else None,
         "tensors": {n: {"dtype": cap.dtype_name(t.dtype), "shape": list(t.shape), "digest": "k3mix32x4:" + "0" * 64}
                     for n, t in sorted(ts.items())}}
    return e, sum(t.numel() * t.element_size() for t in ts.values())


def main(argv=None) -> int:
    from harness import capture as cap
    from harness.synth import parse_layers
    from ref.config import get_config, k1_build, k2_build

    p = argparse.ArgumentParser()
    p.add_argument("--config", default="k3-tp8")
    p.add_argument("--layers", default="1-2")
    p.add_argument("--requests", type=int, default=1)
    p.add_argument("--num-spec", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--experts", default="mxfp4")
    p.add_argument("--after", default="no", choices=("yes", "no"))
    a = p.parse_args(argv)
    cfg = get_config(a.config)
    R, L = a.requests, a.num_spec + 1
    S, SL = R * L, cfg.conv - 2 + L
    g = torch.Generator().manual_seed(0)
    bf = lambda *sh: torch.randn(*sh, generator=g).to(torch.bfloat16)  # noqa: E731
    slots = 1 + 2 * R * L
    st = torch.arange(1, 1 + R * L, dtype=torch.int32).reshape(R, L)
    na = torch.full((R,), L, dtype=torch.int32)
    smap = cap.slot_map_for(st, L)
    rows, weights_bytes = [], 0
    with tempfile.TemporaryDirectory() as d:
        for layer in parse_layers(a.layers, cfg):
            kind = cfg.kind(layer)
            for r in range(cfg.world):
                k1e = k2e = None
                rec = dict(step=0, layer=layer, rank=r, world=cfg.world, kind=kind, fmt=a.experts, cfg=cfg,
                           after=a.after == "yes", k2_key=None, k2_in=None, k2_weights=None)
                nb = cfg.nbmax
                if cfg.has_k1(layer):
                    k1e, b1 = _entry(cfg, layer, r, None, "k1")
                    weights_bytes += b1
                    n = len(smap)
                    k1_in = dict(prefix=bf(S, cfg.hidden), delta=bf(S, cfg.hidden) if layer else None,
                                 blocks=bf(S, nb, cfg.hidden), conv_state=bf(n, cfg.qkv, SL),
                                 rstate=torch.randn(n, cfg.nh, cfg.hd, cfg.hd, generator=g), st_idx=st, num_acc=na)
                    k1_after = dict(prefix=bf(S, cfg.hidden), blocks=bf(S, nb, cfg.hidden),
                                    conv_state=bf(n, cfg.qkv, SL), rstate=torch.randn(n, cfg.nh, cfg.hd, cfg.hd),
                                    core_out=bf(S, cfg.p))
                    rec.update(k1_key=k1_build(cfg, layer, S, L, layer > 0, SL), k1_in=k1_in, k1_after=k1_after,
                               k1_weights=k1e, slot_map=smap, conv_slots=slots, rec_slots=slots)
                if cfg.has_k2(layer):
                    k2e, b2 = _entry(cfg, layer, r, a.experts, "k2")
                    weights_bytes += b2
                    core = rec["k1_after"]["core_out"] if cfg.has_k1(layer) else bf(S, cfg.p)
                    rec.update(k2_key=k2_build(cfg, layer, S, a.experts), k2_weights=k2e,
                               k2_in=dict(core=core, prefix=bf(S, cfg.hidden), blocks=bf(S, nb, cfg.hidden)),
                               k2_after=dict(prefix=bf(S, cfg.hidden), out=bf(S, cfg.hidden),
                                             blocks=bf(S, nb, cfg.hidden)))
                else:
                    rec["dense_after"] = dict(prefix=bf(S, cfg.hidden), out=bf(S, cfg.hidden))
                path = cap.write_capture(d, cap.StepRecord(**rec), cap.producer("capture_bytes", git=False))
                rows.append((layer, kind, r, path.stat().st_size))
    per = [b for *_, b in rows]
    total = sum(per) * a.steps
    print(f"config {cfg.name}, layers {a.layers}, S = {R} × {L}, world {cfg.world}, after={a.after}:")
    for layer in sorted({x[0] for x in rows}):
        bs = [b for lay, _, _, b in rows if lay == layer]
        print(f"  layer {layer} ({rows[[x[0] for x in rows].index(layer)][1]}): {min(bs)}..{max(bs)} bytes per capture")
    print(f"  one step: {sum(per)} bytes in {len(per)} captures; {a.steps} steps: {total} bytes "
          f"({total / 1e6:.1f} MB) with recipe weights; stored weights would add {weights_bytes / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
