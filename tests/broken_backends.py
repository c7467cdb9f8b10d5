"""Deliberately broken backends: the replay must fail them, naming the right stage."""
import torch

import ref


class _Base:
    TAPS_K1 = ref.abi.K1_TAPS if hasattr(ref, "abi") else ()

    def available(self):
        return True, ""

    def kda_pre(self, key, **a):
        ref.kda_pre(key, **a)

    def k2_launch(self, key, **a):
        ref.k2_launch(key, **a)


class StraySlot(_Base):
    """K1 correct, then one write into the last recurrent slot (which the step never references)."""
    name = "broken-stray-slot"

    def kda_pre(self, key, **a):
        ref.kda_pre(key, **a)
        a["rstate"][-1, 0, 0, 0] += 1.0


class GatedNormScale(_Base):
    """The gated norm is 2% off; everything before it is right (so `o` is fine)."""
    name = "broken-gated-norm"

    def kda_pre(self, key, **a):
        ref.kda_pre(key, **a)
        a["core_out"].copy_((a["core_out"].float() * 1.02).to(a["core_out"].dtype))


class LatentNormNoRounding(_Base):
    """K2's latent norm skips a rounding point and drifts by 1%; upstream taps stay right."""
    name = "broken-latent"

    def k2_launch(self, key, taps=None, **a):
        t = {} if taps is None else taps
        ref.k2_launch(key, taps=t, **a)
        t["ln"] = (t["ln"].float() * 1.01).to(t["ln"].dtype)
        a["out"].copy_((a["out"].float() * 1.01).to(a["out"].dtype))


class NoWrite(_Base):
    """Forgets to write core_out (the poisoned NaN stays)."""
    name = "broken-no-write"

    def kda_pre(self, key, **a):
        keep = a["core_out"].clone()
        ref.kda_pre(key, **a)
        a["core_out"].copy_(keep)


STRAY = StraySlot()
GATED = GatedNormScale()
LATENT = LatentNormNoRounding()
NOWRITE = NoWrite()
