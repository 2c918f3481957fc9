/* cpu.h — does this CPU run what this build of libsmoe was compiled for? */
#ifndef SMOE_CPU_H
#define SMOE_CPU_H

#include "smoe.h"

/* SMOE_OK, or SMOE_ERR_UNSUPPORTED with a message saying how to get a build that runs. Called
 * first thing by smoe_open_vault and smoe_session_new, before any code that may use AVX2. */
smoe_status smoe_cpu_check(void);

#ifdef SMOE_CPU_TEST_HOOKS
extern int smoe_cpu_test_lacks_isa; /* tests only: 1 = pretend the CPU lacks what the build needs */
#endif

#endif
