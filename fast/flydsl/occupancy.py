"""Occupancy (waves per SIMD) of a compiled kernel from the resources its ISA metadata
records, under the rules of gfx942 (CDNA3) and gfx950 (CDNA4).

The rule, and where each part comes from (LLVM's AMDGPU backend, lib/Target/AMDGPU/
Utils/AMDGPUBaseInfo.cpp, IsaInfo; AMDGPUSubtarget.cpp):

- VGPRs: both archs have GFX90A instructions, so a SIMD lane has 512 registers in one
  unified file shared by arch VGPRs and AGPRs (`getTotalNumVGPRs` = 512), allocated in
  granules of 8 (`getVGPRAllocGranule`), at most 8 waves (`getMaxWavesPerEU`):
  waves = min(8, 512 // alignTo(total, 8)) (`getNumWavesPerEUWithNumVGPRs`). The
  metadata's `.vgpr_count` is already that unified total, alignTo(arch VGPRs, 4) +
  AGPRs (LLVM test CodeGen/AMDGPU/agpr-register-count.ll: 9 VGPRs + 32 AGPRs -> 44).
- SGPRs (`getOccupancyWithNumSGPRs`, GFX8-GFX9 table; `.sgpr_count` includes VCC and
  the other extra SGPRs): ≤ 80 -> 10, ≤ 88 -> 9, ≤ 100 -> 8, else 7; capped at 8.
- LDS: 64 KiB per CU on gfx942, 160 KiB on gfx950 (CDNA3 / CDNA4 ISA guides); at most
  LDS // group_segment workgroups per CU.
- Workgroups (`getMaxWorkGroupsPerCU`): a CU has 4 SIMDs and 32 wave slots; a
  workgroup of more than one wave takes a barrier, 16 per CU; a workgroup is resident
  whole, its waves spread over the 4 SIMDs.

Put together: WG per CU = min(4·regs // W, LDS // lds, max WG), W = waves per workgroup
and regs = min(VGPR waves, SGPR waves); waves per SIMD = WG per CU · W // 4, at most 8.
`limit` names what binds: vgpr, sgpr, lds, wg (the workgroup shape), or max (8 waves).
"""
from __future__ import annotations

WAVE = 64
SIMDS_PER_CU = 4
MAX_WAVES = 8  # per SIMD, gfx90a and later
VGPR_FILE = 512  # per SIMD lane, arch VGPRs + AGPRs
VGPR_GRANULE = 8
BARRIERS_PER_CU = 16
LDS_PER_CU = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}


def vgpr_waves(vgpr_total: int) -> int:
    if vgpr_total < VGPR_GRANULE:
        return MAX_WAVES
    rounded = -(-vgpr_total // VGPR_GRANULE) * VGPR_GRANULE
    return min(MAX_WAVES, max(1, VGPR_FILE // rounded))


def sgpr_waves(sgpr: int) -> int:
    w = 10 if sgpr <= 80 else 9 if sgpr <= 88 else 8 if sgpr <= 100 else 7
    return min(MAX_WAVES, w)


def occupancy(arch: str, vgpr_total: int, sgpr: int, lds: int, wg_size: int) -> tuple[int, str]:
    """(waves per SIMD, the limiting resource) of a kernel with a workgroup of wg_size threads."""
    if arch not in LDS_PER_CU:
        raise ValueError(f"occupancy: unknown arch {arch!r}")
    per_wg = -(-wg_size // WAVE)
    max_wg = SIMDS_PER_CU * MAX_WAVES if per_wg == 1 else min(SIMDS_PER_CU * MAX_WAVES // per_wg, BARRIERS_PER_CU)
    vw, sw = vgpr_waves(vgpr_total), sgpr_waves(sgpr)
    by = {"wg": max_wg}  # workgroups per CU each resource allows (those below the arch's maximum)
    if vw < MAX_WAVES:
        by["vgpr"] = SIMDS_PER_CU * vw // per_wg
    if sw < MAX_WAVES:
        by["sgpr"] = SIMDS_PER_CU * sw // per_wg
    if lds:
        by["lds"] = LDS_PER_CU[arch] // lds
    limit = min(by, key=lambda k: (by[k], ("vgpr", "sgpr", "lds", "wg").index(k)))
    waves = min(MAX_WAVES, by[limit] * per_wg // SIMDS_PER_CU)
    return waves, "max" if waves == MAX_WAVES else limit
