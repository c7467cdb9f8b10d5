"""Stand-in of `mono/common/abi.py`: a kernel's argument list, named once; the host packs by name."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelAbi:
    names: tuple[str, ...]

    def pack(self, values: dict) -> list:
        """`values` (every name, nothing else) in ABI order."""
        extra = sorted(set(values) - set(self.names))
        missing = sorted(set(self.names) - set(values))
        if extra or missing:
            raise TypeError(f"ABI mismatch: missing {missing}, unexpected {extra}")
        return [values[n] for n in self.names]

    def unpack(self, args) -> dict:
        """The kernel's side: positional arguments back to names."""
        if len(args) != len(self.names):
            raise TypeError(f"{len(args)} arguments for an ABI of {len(self.names)}")
        return dict(zip(self.names, args))
