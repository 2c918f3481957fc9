/* check.h — the assertion of the C test programs: reports and counts a failure, goes on (up to
 * 20), so one run shows every broken case. main returns `failures != 0`. */
#ifndef SMOE_TEST_CHECK_H
#define SMOE_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>

static int failures;

#define CHECK(cond, ...)                                                                   \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond);      \
            fprintf(stderr, __VA_ARGS__);                                                  \
            fprintf(stderr, "\n");                                                         \
            if (++failures > 20) exit(1);                                                  \
        }                                                                                  \
    } while (0)

#endif
