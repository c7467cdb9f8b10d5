"""Eager PyTorch reference of the Kimi-K3 K1/K2 decode kernels (DESIGN §5).

`kda_pre` and `k2_launch` take exactly the keyword names of the launch ABI and write
their outputs in place; `mode="oracle"` is the float64 dataflow with no bf16 rounding
(quantization kept); `perturb=seed` permutes reduction orders.
"""
from .comm import DistComm, SimWorld
from .config import PRESETS, Config, K2Build, KdaPreBuild, get_config, k1_build, k2_build
from .k2_launch import k2_launch, k2_world, upcast
from .kda_pre import kda_pre

__version__ = "0.1.0"

__all__ = ["Config", "KdaPreBuild", "K2Build", "kda_pre", "k2_launch", "k2_world", "upcast", "SimWorld",
           "DistComm", "PRESETS", "get_config", "k1_build", "k2_build", "__version__"]
