/* cpu.h — does this CPU run what this build of libsmoe was compiled for? */
#ifndef SMOE_CPU_H
#define SMOE_CPU_H

#include "smoe.h"

/* SMOE_OK, or SMOE_ERR_UNSUPPORTED with a message saying how to get a build that runs. Called
 * first thing by smoe_open_vault and smoe_session_new, before any code that may use AVX2. */
smoe_status smoe_cpu_check(void);

/* What of AVX-512 the kernels may use here: SMOE_CPU_AVX512 where cpuid has AVX-512 F, BW and VL
 * and the OS saves the mask and ZMM registers (XCR0, by xgetbv), plus SMOE_CPU_AVX512VNNI where
 * cpuid also has AVX512-VNNI; 0 elsewhere and in builds without kernels_avx512.c. The
 * environment can only take away: SMOE_NO_AVX512=1 gives 0, SMOE_NO_VNNI=1 drops the VNNI bit.
 * Read once and cached; cheap enough to call per product. smoe_cpu_avx512_hw: the same without
 * the environment (for the tests). */
enum { SMOE_CPU_AVX512 = 1, SMOE_CPU_AVX512VNNI = 2 };
unsigned smoe_cpu_avx512(void);
unsigned smoe_cpu_avx512_hw(void);

/* Whether the AMX-INT8 kernel (kernels_avx512_amx.h) may run here: AVX-512 as above, cpuid's
 * AMX-TILE and AMX-INT8, XCR0's tile state, and Linux's permission for this process to use the
 * tile data (arch_prctl ARCH_REQ_XCOMP_PERM, asked once: a process-wide grant). SMOE_NO_AMX=1 (or
 * SMOE_NO_AVX512=1) gives false. Cached. smoe_cpu_amx_hw: without the environment. */
bool smoe_cpu_amx(void);
bool smoe_cpu_amx_hw(void);

/* Whether the NEON dot-product instance (kernels_isa.h, SMOE_HAVE_NEON_DOT) may run here: the CPU
 * has ARMv8.2's SDOT (Linux: AT_HWCAP's ASIMDDP; elsewhere only where the build's target has it).
 * SMOE_NO_DOTPROD=1 gives false. Cached; false in builds without that instance.
 * smoe_cpu_neon_dot_hw: without the environment. */
bool smoe_cpu_neon_dot(void);
bool smoe_cpu_neon_dot_hw(void);

/* The bytes of L2 one hardware thread has: cpu0's L2 over the CPUs that share it (Linux's sysfs:
 * two SMT siblings share one core's L2), so that a kernel's per-thread tile fits beside its
 * sibling's; 0 where unknown. Read once and cached. Only tile sizes follow it, never a value. */
uint32_t smoe_cpu_l2_per_thread(void);

#ifdef SMOE_CPU_TEST_HOOKS
extern int smoe_cpu_test_lacks_isa; /* tests only: 1 = pretend the CPU lacks what the build needs */
#ifdef __linux__
uint32_t smoe_cpu_test_list_count(const char *list); /* tests only: the CPUs a sysfs list names, 0 if malformed */
#endif
#endif

#endif
