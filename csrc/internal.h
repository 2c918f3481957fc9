/* internal.h — what every private module of libsmoe shares: errors, logging, memory, time. */
#ifndef SMOE_INTERNAL_H
#define SMOE_INTERNAL_H

#include "smoe.h"

#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#define SMOE_PAGE 16384u /* Direct I/O alignment: macOS pages are 16 KiB */
#define SMOE_HUGE ((size_t)2 << 20) /* a transparent huge page (x86-64, arm64 with 4 KiB pages) */

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
/* The same, not zeroed: for buffers never read before they are written (the KV cache), whose
 * pages the OS then maps only as they are first written. Freed with smoe_free. */
void *smoe_alloc_untouched(size_t bytes, size_t align);
/* Untouched too, for the cache's slots, which the products stream through: aligned to SMOE_HUGE,
 * whole huge pages, and on Linux marked for transparent huge pages (madvise MADV_HUGEPAGE: the
 * kernel's "madvise" setting, the one most distributions ship, gives them only to regions that
 * ask) where memory is not tight (util.c says when). SMOE_HUGE_PAGES=0 in the environment: never;
 * 1: always. Freed with smoe_free. */
void *smoe_alloc_huge(size_t bytes);
void smoe_free(void *p);

double smoe_now(void); /* monotonic seconds */

/* Reads up to n bytes at off into buf, looping over short reads and EINTR. Returns the bytes
 * read (fewer than n only at end of file) or −1 with errno set. */
int64_t smoe_pread_full(int fd, void *buf, uint64_t n, uint64_t off);
/* Starts one of the library's own threads (pool workers, I/O threads, the dense loaders): every
 * signal blocked in it, so that a process-directed signal reaches the host's threads (Python's
 * SIGINT, a server's sigwait) and never interrupts the library's reads; a stack of at least
 * min_stack bytes (0: the platform's default); named `name` where the OS names threads (Linux:
 * what top -H and gdb show; 15 characters at most). Returns pthread_create's error (0: started).
 * The creating thread's own mask is as it was. */
int smoe_thread_start(pthread_t *thread, const char *name, size_t min_stack, void *(*fn)(void *), void *arg);
/* This process's id, for a handle to record at its creation: a vault or session used after a
 * fork() in the child has none of its threads there (smoe.h, "Processes"). */
int smoe_process_id(void);

/* CRC-32C (Castagnoli), continued from crc (start with 0: smoe_crc32c(0, "123456789", 9) is
 * 0xE3069283); the fastest implementation this CPU has. */
uint32_t smoe_crc32c(uint32_t crc, const void *data, size_t n);
/* smoe_checksum's parts, for callers that read a region piece by piece: the bounds of its 4
 * lanes for n bytes (lane i is [b[i], b[i+1])), and the checksum from the lanes' CRC-32Cs. */
void smoe_checksum_lanes(uint64_t n, uint64_t b[5]);
uint32_t smoe_checksum_combine(const uint32_t lane_crc[4]);
/* Tests and benchmarks: one implementation on purpose (SMOE_CRC_BEST = what smoe_checksum runs),
 * and the name of the one in use ("sse4.2", "armv8-crc" or "table"). */
enum { SMOE_CRC_BEST = 0, SMOE_CRC_TABLE = 1 };
uint32_t smoe_checksum_with(int which, const void *data, size_t n);
uint32_t smoe_crc32c_with(int which, uint32_t crc, const void *data, size_t n);
const char *smoe_checksum_impl(void);

static inline uint64_t smoe_align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

#endif
