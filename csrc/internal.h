/* internal.h — what every private module of libsmoe shares: errors, logging, memory, time. */
#ifndef SMOE_INTERNAL_H
#define SMOE_INTERNAL_H

#include "smoe.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#define SMOE_PAGE 16384u /* Direct I/O alignment: macOS pages are 16 KiB */

#if defined(__GNUC__)
#define SMOE_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define SMOE_PRINTF(a, b)
#endif

/* Records a message for smoe_last_error() on this thread and returns status, so a failure is
 * one line: `return smoe_fail(SMOE_ERR_VAULT, "blob %u: offset out of range", i);`. */
smoe_status smoe_fail(smoe_status status, const char *fmt, ...) SMOE_PRINTF(2, 3);
/* Sends a message to the log callback, if one is set. */
void smoe_log(int level, const char *fmt, ...) SMOE_PRINTF(2, 3);

/* Zeroed, aligned allocation (align a power of two ≥ sizeof(void*)); NULL on failure. */
void *smoe_alloc(size_t bytes, size_t align);
void smoe_free(void *p);

double smoe_now(void); /* monotonic seconds */

/* Reads up to n bytes at off into buf, looping over short reads and EINTR. Returns the bytes
 * read (fewer than n only at end of file) or −1 with errno set. */
int64_t smoe_pread_full(int fd, void *buf, uint64_t n, uint64_t off);

/* CRC-32 (IEEE 802.3, the one zlib's crc32 computes); start with crc = 0. */
uint32_t smoe_crc32(uint32_t crc, const void *data, size_t n);

static inline uint64_t smoe_align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

#endif
