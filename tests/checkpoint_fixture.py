"""A small model checkpoint in Kimi-K3's Hugging Face layout (harness/capture/checkpoint.py's
`kimi-k3-hf`), written from ref.synth's weights of every rank: each HF tensor is put together
from the ranks' slices by hand here (concatenated, or one copy of a replicated tensor), so
reading it back through the plan must give every rank's ref.synth weights bit for bit.

    root = write_checkpoint(tmp_path / "ckpt", cfg, layers=[1], fmt="mxfp4")
    # root/model-0000{1,2}-of-00002.safetensors + root/model.safetensors.index.json
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ref import synth as rsynth


def _cat(parts, dim):
    return torch.cat([p.contiguous() for p in parts], dim=dim).contiguous()


def _same(parts, name):
    for p in parts[1:]:
        if not torch.equal(p, parts[0]):
            raise AssertionError(f"{name}: replicated on every rank in the checkpoint, but ref.synth's ranks differ")
    return parts[0].contiguous()


def hf_tensors(cfg, layer: int, fmt: str, seed: int = 0) -> dict:
    """{HF name: tensor} of one layer (KDA attention + latent MoE) from ref.synth's ranks."""
    R = range(cfg.world)
    k1 = [rsynth.k1_weights(cfg, layer, r, seed) for r in R]
    k2 = [rsynth.k2_weights(cfg, layer, r, fmt, seed) for r in R]
    P, NH, RK, RI, SI, W = cfg.p, cfg.nh, cfg.rank, cfg.ri, cfg.si, cfg.conv
    pf = f"language_model.layers.{layer}."
    at, moe = pf + "self_attn.", pf + "block_sparse_moe."
    out = {}
    for i, n in enumerate(("q", "k", "v", "g")):
        out[f"{at}{n}_proj.weight"] = _cat([w["w_in"][i * P:(i + 1) * P] for w in k1], 0)
    out[f"{at}f_a_proj.weight"] = _same([w["w_in"][4 * P:4 * P + RK] for w in k1], "f_a_proj")
    out[f"{at}b_proj.weight"] = _cat([w["w_in"][4 * P + RK:4 * P + RK + NH] for w in k1], 0)
    out[f"{at}f_b_proj.weight"] = _cat([w["w_fb"] for w in k1], 0)
    for i, n in enumerate("qkv"):
        out[f"{at}{n}_conv1d.weight"] = _cat([w["conv_w"][i * P:(i + 1) * P].reshape(P, 1, W) for w in k1], 0)
    out[f"{at}A_log"] = _cat([w["a_log"] for w in k1], 0)
    out[f"{at}dt_bias"] = _cat([w["dt_bias"] for w in k1], 0)
    out[f"{at}o_norm.weight"] = _same([w["on_w"] for w in k1], "o_norm")
    out[f"{pf}self_attention_res_norm.weight"] = _same([w["ares_nw"] for w in k1], "ares_nw")
    out[f"{pf}self_attention_res_proj.weight"] = _same([w["ares_qk"] for w in k1], "ares_qk").reshape(1, -1)
    out[f"{pf}input_layernorm.weight"] = _same([w["in_nw"] for w in k1], "in_nw")
    out[f"{at}o_proj.weight"] = _cat([w["w_o"] for w in k2], 1)
    out[f"{pf}mlp_res_norm.weight"] = _same([w["ares_nw"] for w in k2], "mlp ares_nw")
    out[f"{pf}mlp_res_proj.weight"] = _same([w["ares_qk"] for w in k2], "mlp ares_qk").reshape(1, -1)
    out[f"{pf}post_attention_layernorm.weight"] = _same([w["in_nw"] for w in k2], "post ln")
    out[f"{moe}gate.weight"] = _same([w["w_gate"] for w in k2], "gate")
    out[f"{moe}gate.e_score_correction_bias"] = _same([w["bias"] for w in k2], "bias")
    out[f"{moe}routed_expert_down_proj.weight"] = _same([w["w_ld"] for w in k2], "w_ld")
    out[f"{moe}routed_expert_norm.weight"] = _same([w["ln_w"] for w in k2], "ln_w")
    out[f"{moe}routed_expert_up_proj.weight"] = _cat([w["w_up"] for w in k2], 0)
    out[f"{moe}shared_experts.gate_proj.weight"] = _cat([w["w_sgu"][:SI] for w in k2], 0)
    out[f"{moe}shared_experts.up_proj.weight"] = _cat([w["w_sgu"][SI:] for w in k2], 0)
    out[f"{moe}shared_experts.down_proj.weight"] = _cat([w["w_sd"] for w in k2], 1)
    wn, sn = ("weight", None) if fmt == "bf16" else ("weight_packed", "weight_scale")
    for e in range(cfg.experts):
        ex = f"{moe}experts.{e}."
        for key, nm in ((wn, "w13"), (sn, "w13s")):
            if key is None:
                continue
            out[f"{ex}w1.{key}"] = _cat([w[nm][e, :RI] for w in k2], 0)
            out[f"{ex}w3.{key}"] = _cat([w[nm][e, RI:] for w in k2], 0)
        for key, nm in ((wn, "w2"), (sn, "w2s")):
            if key is not None:
                out[f"{ex}w2.{key}"] = _cat([w[nm][e] for w in k2], 1)
    return out


def write_checkpoint(root, cfg, layers=(1,), fmt: str = "mxfp4", seed: int = 0, shards: int = 2,
                     index: bool = True) -> Path:
    """Write the layers' HF tensors in `shards` safetensors files (+ the index); return root."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    ts = {}
    for layer in layers:
        ts.update(hf_tensors(cfg, layer, fmt, seed))
    names = sorted(ts)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    wm = {}
    for i, f in enumerate(files):
        part = {n: ts[n] for n in names[i::shards]}
        save_file(part, str(root / f))
        wm.update({n: f for n in part})
    if index:
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return root
