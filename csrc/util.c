/* util.c — what every module shares: status strings, the per-thread error message, the log
 * callback, aligned memory, the clock and CRC-32. Nothing here knows about models. */
#include "internal.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <errno.h>
#include <unistd.h>

/* ------------------------------------------------------------------------ status, version */

const char *smoe_status_str(smoe_status status) {
    switch (status) {
    case SMOE_OK: return "ok";
    case SMOE_ERR_INVALID_ARG: return "invalid argument";
    case SMOE_ERR_BAD_TOKEN: return "token id out of range";
    case SMOE_ERR_CONTEXT_FULL: return "context full";
    case SMOE_ERR_VAULT: return "bad vault";
    case SMOE_ERR_IO: return "read failed";
    case SMOE_ERR_NOMEM: return "out of memory";
    case SMOE_ERR_SESSION_BROKEN: return "session broken";
    case SMOE_ERR_UNSUPPORTED: return "unsupported";
    case SMOE_ERR_INTERNAL: return "internal error";
    case SMOE_ERR_BUSY: return "another call is running on this session";
    case SMOE_ERR_CANCELLED: return "cancelled";
    }
    return "unknown status";
}

const char *smoe_version(void) { return SMOE_VERSION_STRING; }

int smoe_abi_version(void) { return SMOE_ABI_VERSION; }

/* ------------------------------------------------------------------------- errors, logging */

/* One message per thread, so that concurrent sessions never see each other's failures. */
static _Thread_local char last_error[1024];

smoe_status smoe_fail(smoe_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return status;
}

const char *smoe_last_error(void) { return last_error; }

/* fn and user change together, so they are read and written under one lock; the callback itself
 * runs outside it (it may be slow: Python's logging). */
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static smoe_log_fn log_fn;
static void *log_user;

void smoe_set_log_callback(smoe_log_fn fn, void *user) {
    pthread_mutex_lock(&log_lock);
    log_fn = fn;
    log_user = user;
    pthread_mutex_unlock(&log_lock);
}

void smoe_log(int level, const char *fmt, ...) {
    pthread_mutex_lock(&log_lock);
    smoe_log_fn fn = log_fn;
    void *user = log_user;
    pthread_mutex_unlock(&log_lock);
    if (!fn) return;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fn(level, msg, user);
}

/* ---------------------------------------------------------------------------------- memory */

void *smoe_alloc(size_t bytes, size_t align) {
    if (align < sizeof(void *)) align = sizeof(void *);
    if (align & (align - 1)) return NULL;
    if (bytes == 0) bytes = 1; /* a unique pointer, so NULL always means failure */
    void *p = NULL;
    if (posix_memalign(&p, align, bytes) != 0) return NULL;
    memset(p, 0, bytes);
    return p;
}

void smoe_free(void *p) { free(p); }

double smoe_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ------------------------------------------------------------------------------------ CRC */

/* Slicing-by-8 (Intel's, as in zlib's crc32_little): table k holds the CRC of a byte followed
 * by k zero bytes, so eight input bytes fold in with eight lookups and no carried dependency
 * between them. Reflected polynomial 0xEDB88320; the result equals zlib.crc32. */
static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
}

uint32_t smoe_crc32(uint32_t crc, const void *data, size_t n) {
    pthread_once(&crc_once, crc_init);
    const uint8_t *p = data;
    uint32_t c = ~crc;
    while (n >= 8) {
        /* Bytes assembled explicitly: little-endian on any host, no aliasing questions. */
        uint32_t lo = c ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
        c = crc_table[7][lo & 0xFF] ^ crc_table[6][(lo >> 8) & 0xFF] ^ crc_table[5][(lo >> 16) & 0xFF] ^
            crc_table[4][lo >> 24] ^ crc_table[3][p[4]] ^ crc_table[2][p[5]] ^ crc_table[1][p[6]] ^
            crc_table[0][p[7]];
        p += 8;
        n -= 8;
    }
    while (n--) c = crc_table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return ~c;
}

/* Reads up to n bytes at off, looping over short reads and EINTR. Returns the bytes read (less
 * than n only at end of file) or -1 with errno set. */
int64_t smoe_pread_full(int fd, void *buf, uint64_t n, uint64_t off) {
    uint8_t *p = buf;
    uint64_t done = 0;
    while (done < n) {
        uint64_t want = n - done;
        if (want > (1u << 30)) want = 1u << 30; /* Linux caps one read near 2 GiB */
        ssize_t r = pread(fd, p + done, (size_t)want, (off_t)(off + done));
        if (r < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (r == 0) break;
        done += (uint64_t)r;
    }
    return (int64_t)done;
}
