"""The eager reference as a backend (exact mode)."""
from __future__ import annotations

import ref
from ref.abi import K1_TAPS, K2_TAPS


class RefBackend:
    name = "ref"
    version = ref.__version__
    TAPS_K1 = K1_TAPS
    TAPS_K2 = K2_TAPS

    def available(self):
        return True, ""

    def kda_pre(self, key, **abi):
        ref.kda_pre(key, **abi)

    def k2_launch(self, key, **abi):
        ref.k2_launch(key, **abi)


BACKEND = RefBackend()
