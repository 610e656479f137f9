"""The "flags" line of /proc/cpuinfo on real CPUs, for the kernel path selection tests.

Each is the line as Linux prints it on that CPU (a cloud VM's guest view where noted: the
hypervisor passes the vector flags through). They differ where it matters here: AVX-512 VNNI
without AVX-VNNI (Zen 4, Ice Lake), AVX-VNNI without AVX-512 (Alder Lake), both plus AMX
(Sapphire Rapids), AVX2 alone (Zen 3), and AVX without AVX2 (Sandy Bridge).
"""

from __future__ import annotations

_COMMON = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse "
    "sse2 ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid "
    "pni pclmulqdq ssse3 cx16 pcid sse4_1 sse4_2 x2apic popcnt aes xsave hypervisor lahf_lm"
)

CPUS: dict[str, str] = {
    # AMD EPYC 7763 (Zen 3, Milan): AVX2, no AVX-512, no VNNI of either kind.
    "zen3": _COMMON + " mmxext fxsr_opt movbe fma avx f16c rdrand cmp_legacy abm sse4a "
    "misalignsse 3dnowprefetch topoext perfctr_core invpcid_single ssbd ibrs ibpb stibp vmmcall "
    "fsgsbase bmi1 avx2 smep bmi2 erms invpcid rdseed adx smap clflushopt clwb sha_ni xsaveopt "
    "xsavec xgetbv1 xsaves clzero xsaveerptr rdpru wbnoinvd arat npt nrip_save umip pku ospke "
    "vaes vpclmulqdq rdpid fsrm",
    # AMD EPYC 9R14 (Zen 4, Genoa): AVX-512 with VNNI and BF16, but NOT the VEX AVX-VNNI, no AMX.
    "zen4": _COMMON + " mmxext fxsr_opt movbe fma avx f16c rdrand cmp_legacy abm sse4a "
    "misalignsse 3dnowprefetch topoext perfctr_core invpcid_single ssbd ibrs ibpb stibp vmmcall "
    "fsgsbase bmi1 avx2 smep bmi2 erms invpcid avx512f avx512dq rdseed adx smap avx512ifma "
    "clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx512_bf16 "
    "clzero xsaveerptr rdpru wbnoinvd arat npt nrip_save avx512vbmi umip pku ospke avx512_vbmi2 "
    "gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid fsrm",
    # Intel Xeon Platinum 8375C (Ice Lake server): AVX-512 VNNI, no AVX512-BF16, no AVX-VNNI.
    "icelake_server": _COMMON + " movbe fma avx f16c rdrand tsc_deadline_timer abm "
    "3dnowprefetch invpcid_single ssbd ibrs ibpb stibp ibrs_enhanced fsgsbase tsc_adjust bmi1 "
    "avx2 smep bmi2 erms invpcid avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb "
    "avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves wbnoinvd ida arat avx512vbmi "
    "pku ospke avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg tme avx512_vpopcntdq "
    "rdpid md_clear flush_l1d arch_capabilities",
    # Intel Core i7-12700K (Alder Lake): AVX-VNNI; AVX-512 is fused off.
    "alder_lake": _COMMON + " monitor movbe fma avx f16c rdrand tsc_deadline_timer abm "
    "3dnowprefetch cpuid_fault invpcid_single ssbd ibrs ibpb stibp ibrs_enhanced fsgsbase "
    "tsc_adjust bmi1 avx2 smep bmi2 erms invpcid rdseed adx smap clflushopt clwb intel_pt sha_ni "
    "xsaveopt xsavec xgetbv1 xsaves split_lock_detect avx_vnni dtherm ida arat pln pts hwp umip "
    "pku ospke waitpkg gfni vaes vpclmulqdq rdpid movdiri movdir64b fsrm md_clear serialize "
    "arch_lbr flush_l1d arch_capabilities",
    # Intel Xeon Platinum 8480+ (Sapphire Rapids): everything here plus AMX (no path uses AMX).
    "sapphire_rapids": _COMMON + " monitor movbe fma avx f16c rdrand tsc_deadline_timer abm "
    "3dnowprefetch invpcid_single ssbd ibrs ibpb stibp ibrs_enhanced fsgsbase tsc_adjust bmi1 "
    "avx2 smep bmi2 erms invpcid avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb "
    "avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx_vnni avx512_bf16 "
    "wbnoinvd ida arat avx512vbmi umip pku ospke waitpkg avx512_vbmi2 gfni vaes vpclmulqdq "
    "avx512_vnni avx512_bitalg tme avx512_vpopcntdq la57 rdpid cldemote movdiri movdir64b "
    "enqcmd fsrm md_clear serialize tsxldtrk amx_bf16 avx512_fp16 amx_tile amx_int8 flush_l1d "
    "arch_capabilities",
    # Intel Xeon E5-2670 (Sandy Bridge): AVX without AVX2, FMA or F16C.
    "sandy_bridge": _COMMON + " monitor ds_cpl vmx smx est tm2 xtpr pdcm dca tsc_deadline_timer "
    "avx epb pti ssbd ibrs ibpb stibp tpr_shadow vnmi flexpriority ept vpid xsaveopt dtherm ida "
    "arat pln pts md_clear flush_l1d",
}


def cpuinfo(name: str) -> str:
    """A /proc/cpuinfo excerpt for the recorded CPU (what cpu_features.parse_cpuinfo reads)."""
    return f"processor\t: 0\nvendor_id\t: test\nflags\t\t: {CPUS[name]}\nbugs\t\t: none\n"
