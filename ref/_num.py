"""Where the reference rounds: one object that knows the mode.

exact  — fp32 compute, `bf()` rounds to bf16 (round-to-nearest-even) at the
         contract's rounding points;
oracle — float64 compute, `bf()` is the identity (no bf16 rounding at all);
perturb=seed (exact only) — split-K chunk order of every GEMM and the chunk order of
         every other fp32 reduction (AttnRes, norms, conv taps, recurrence dots), drawn
         from the seed, and every GEMM output moved by a relative N(0, 2^-20) jitter (the
         order of a K = 7168 fp32 dot moves it by up to ~√K·2^-24 of Σ|terms|): what a
         correct fused kernel may change, to measure the reference's own spread. Orders the
         contract fixes (the rank order of the reductions, the pick order of the routed sum)
         are left alone.
"""
from __future__ import annotations

import torch

MODES = ("exact", "oracle")
JITTER = 2.0 ** -20  # relative std of the GEMM-output jitter under perturb


class Num:
    def __init__(self, mode: str = "exact", perturb: int | None = None):
        if mode not in MODES:
            raise ValueError(f"mode: {mode!r} not in {MODES}")
        if perturb is not None and mode != "exact":
            raise ValueError("perturb: only in exact mode")
        self.mode = mode
        self.perturb = perturb
        self.dtype = torch.float64 if mode == "oracle" else torch.float32
        self._gen = None
        if perturb is not None:
            self._gen = torch.Generator()
            self._gen.manual_seed(int(perturb))

    @property
    def oracle(self) -> bool:
        return self.mode == "oracle"

    def f(self, x: torch.Tensor) -> torch.Tensor:
        """Upcast to the compute dtype (exact for bf16/fp32 inputs)."""
        return x.to(self.dtype)

    def bf(self, x: torch.Tensor) -> torch.Tensor:
        """A contract rounding point: bf16 in exact mode, nothing in oracle mode."""
        return x if self.oracle else x.to(torch.bfloat16)

    def perm(self, n: int) -> list[int]:
        """Identity order, or a seeded permutation under perturb."""
        if self._gen is None or n <= 1:
            return list(range(n))
        return torch.randperm(n, generator=self._gen).tolist()

    def sum(self, x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
        """Σ over `dim` in the compute dtype; under perturb, chunk partial sums in a seeded order."""
        if self._gen is None or x.shape[dim] < 4:
            return x.sum(dim, keepdim=keepdim)
        n = min(8, x.shape[dim] // 2)
        chunks = torch.tensor_split(x, n, dim=dim)
        acc = None
        for i in self.perm(n):
            part = chunks[i].sum(dim, keepdim=keepdim)
            acc = part if acc is None else acc + part
        return acc

    def mean(self, x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
        return self.sum(x, dim, keepdim) / x.shape[dim]

    def mm(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """a [M, K] @ w[N, K]^T accumulated in the compute dtype (fp32 / f64).

        Under perturb the K dim is split into chunks summed in a seeded order.
        """
        a, w = self.f(a), self.f(w)
        if self._gen is None:
            return _no_tf32(lambda: a @ w.transpose(-1, -2))
        k = a.shape[-1]
        n = max(1, min(8, k // 16))
        bounds = [round(i * k / n) for i in range(n + 1)]
        acc = None
        for i in self.perm(n):
            lo, hi = bounds[i], bounds[i + 1]
            part = _no_tf32(lambda: a[..., lo:hi] @ w[..., lo:hi].transpose(-1, -2))
            acc = part if acc is None else acc + part
        jit = torch.randn(acc.shape, generator=self._gen, dtype=acc.dtype) * JITTER
        return acc * (1 + jit.to(acc.device))


def _no_tf32(fn):
    """fp32 GEMMs must stay fp32 on CUDA to be the contract: refuse TF32."""
    if torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest":
        raise RuntimeError("reference: TF32 matmul is enabled (torch.backends.cuda.matmul.allow_tf32 / "
                           "set_float32_matmul_precision); the contract needs full fp32 GEMMs")
    return fn()
