"""Stand-in of `mono/stages/moe.py`'s constants (the K2b latent MoE), at the tiny preset:
top-k, the SiTU betas and the expert format are the kernel's, not the build key's."""
from ref.config import get_config

_C = get_config("tiny")
TP = _C.world
HIDDEN = _C.hidden
LAT = _C.lat
E = _C.experts
TOPK = _C.topk
RI = _C.ri
SI = _C.si
BETA, LBETA = _C.situ_beta, _C.situ_linear_beta
UP_N = HIDDEN // TP
EXPERTS = "mxfp4"  # gfx950: MXFP4 experts, the latent quantized to MXFP4 (a4w4)
