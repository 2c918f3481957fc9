/* fault_shim.c — an LD_PRELOAD library that makes pread() and preadv() fail on demand. Tests only.
 *
 * It wraps pread, pread64, preadv and preadv64 for the whole process. Reads shorter than
 * min_bytes pass through untouched, so only expert blob reads (one pread of a whole blob, or one
 * preadv of a run of adjacent blobs, see streamer.c) are candidates when min_bytes is the vault's
 * blob size; the header probe and the dense region are never touched. A candidate read fails
 *   - at random, with probability rate_ppm / 10^6, with a kind drawn from the enabled kinds;
 *   - or, after smoe_fault_fail_nth(n, kind), as the n-th candidate read from then on.
 * Kinds:
 *   FAULT_EIO    returns −1 with errno EIO;
 *   FAULT_SHORT  reads a 4 KiB-aligned prefix (O_DIRECT takes it) and then reports end of file
 *                to the same thread's next read at that offset, so smoe_pread_full's loop over
 *                short reads ends short: a "file truncated" error;
 *   FAULT_FLIP   reads, then flips one bit of what was read (only a checksum can tell).
 *
 * Build and use (tests/test_faults.py does this):
 *   cc -shared -fPIC -O2 tests/c/fault_shim.c -ldl -o fault_shim.so
 *   LD_PRELOAD=./fault_shim.so python ...   then ffi.dlopen("./fault_shim.so") reaches the
 *   controls below (the same loaded copy). Under ASan the sanitizer runtimes come first in
 *   LD_PRELOAD; their pread interceptor then calls this one, which calls libc's.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

enum { FAULT_EIO = 1, FAULT_SHORT = 2, FAULT_FLIP = 4 };

static _Atomic uint64_t min_bytes = UINT64_MAX; /* off until configured */
static _Atomic uint32_t rate_ppm, kinds_mask;
static _Atomic uint64_t seed, draws;
static _Atomic int64_t countdown; /* > 0: the countdown-th candidate read from now fails */
static _Atomic uint32_t countdown_kind;
static _Atomic uint64_t injected[3]; /* per kind: EIO, SHORT, FLIP */

static _Thread_local int eof_fd = -1; /* FAULT_SHORT's pending end of file, per thread */
static _Thread_local off_t eof_at;

void smoe_fault_config(uint64_t min_bytes_, uint32_t rate_ppm_, uint32_t kinds_, uint64_t seed_) {
    atomic_store(&rate_ppm, 0);
    atomic_store(&seed, seed_);
    atomic_store(&kinds_mask, kinds_ & 7u);
    atomic_store(&min_bytes, min_bytes_);
    atomic_store(&rate_ppm, rate_ppm_);
}

void smoe_fault_fail_nth(int64_t n, uint32_t kind) {
    atomic_store(&countdown_kind, kind);
    atomic_store(&countdown, n);
}

/* Faults injected so far of a kind (FAULT_EIO, FAULT_SHORT or FAULT_FLIP), 0 for others. */
uint64_t smoe_fault_injected(uint32_t kind) {
    switch (kind) {
    case FAULT_EIO: return atomic_load(&injected[0]);
    case FAULT_SHORT: return atomic_load(&injected[1]);
    case FAULT_FLIP: return atomic_load(&injected[2]);
    }
    return 0;
}

static uint64_t mix(uint64_t x) { /* splitmix64's finaliser */
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* The fault for this candidate read (0 = none) and a random word for its details. */
static uint32_t draw(uint64_t *r) {
    *r = mix(atomic_load(&seed) ^ mix(atomic_fetch_add(&draws, 1)));
    if (atomic_load(&countdown) > 0 && atomic_fetch_sub(&countdown, 1) == 1)
        return atomic_load(&countdown_kind);
    uint32_t mask = atomic_load(&kinds_mask);
    if (!mask || *r % 1000000u >= atomic_load(&rate_ppm))
        return 0;
    uint32_t pick = (uint32_t)(*r >> 40) % (uint32_t)__builtin_popcount(mask);
    for (uint32_t k = 1; k <= 4; k <<= 1)
        if ((mask & k) && pick-- == 0)
            return k;
    return 0;
}

typedef ssize_t (*pread_fn)(int, void *, size_t, off_t);
typedef ssize_t (*preadv_fn)(int, const struct iovec *, int, off_t);

/* The next reader down: preadv, or pread (then the request is one buffer). */
typedef struct {
    pread_fn p;
    preadv_fn v;
} real_fn;

static ssize_t call_real(real_fn f, int fd, const struct iovec *iov, int cnt, off_t off) {
    return f.v ? f.v(fd, iov, cnt, off) : f.p(fd, iov[0].iov_base, iov[0].iov_len, off);
}

/* The faults over a whole request (a short one keeps a 4 KiB-aligned prefix of it; a flip lands
 * in any of its buffers). */
static ssize_t faulty(real_fn real, int fd, const struct iovec *iov, int cnt, off_t off) {
    if (fd == eof_fd && off == eof_at) {
        eof_fd = -1;
        return 0;
    }
    size_t n = 0;
    for (int i = 0; i < cnt; i++)
        n += iov[i].iov_len;
    if (n < atomic_load(&min_bytes) || cnt > 1024)
        return call_real(real, fd, iov, cnt, off);
    uint64_t r;
    switch (draw(&r)) {
    case FAULT_EIO:
        atomic_fetch_add(&injected[0], 1);
        errno = EIO;
        return -1;
    case FAULT_SHORT: {
        size_t k = (size_t)((r >> 20) % (n / 4096 ? n / 4096 : 1)) * 4096;
        atomic_fetch_add(&injected[1], 1);
        if (k == 0)
            return 0;
        struct iovec part[1024];
        int m = 0;
        for (size_t left = k; left > 0 && m < cnt; m++) {
            part[m] = iov[m];
            if (part[m].iov_len > left)
                part[m].iov_len = left;
            left -= part[m].iov_len;
        }
        ssize_t got = call_real(real, fd, part, m, off);
        if (got == (ssize_t)k) {
            eof_fd = fd;
            eof_at = off + (off_t)k;
        }
        return got;
    }
    case FAULT_FLIP: {
        ssize_t got = call_real(real, fd, iov, cnt, off);
        if (got > 0) {
            uint64_t at = (r >> 8) % (uint64_t)got;
            int i = 0;
            while (at >= iov[i].iov_len)
                at -= iov[i++].iov_len;
            ((uint8_t *)iov[i].iov_base)[at] ^= (uint8_t)(1u << (r & 7));
            atomic_fetch_add(&injected[2], 1);
        }
        return got;
    }
    }
    return call_real(real, fd, iov, cnt, off);
}

static ssize_t faulty_pread(const char *name, _Atomic(pread_fn) *real, int fd, void *buf, size_t n, off_t off) {
    pread_fn f = atomic_load(real);
    if (!f) {
        f = (pread_fn)dlsym(RTLD_NEXT, name);
        atomic_store(real, f);
    }
    struct iovec one = {.iov_base = buf, .iov_len = n};
    return faulty((real_fn){.p = f}, fd, &one, 1, off);
}

ssize_t pread(int fd, void *buf, size_t n, off_t off) {
    static _Atomic(pread_fn) real;
    return faulty_pread("pread", &real, fd, buf, n, off);
}

ssize_t pread64(int fd, void *buf, size_t n, off_t off) {
    static _Atomic(pread_fn) real;
    return faulty_pread("pread64", &real, fd, buf, n, off);
}

ssize_t preadv(int fd, const struct iovec *iov, int cnt, off_t off) {
    static _Atomic(preadv_fn) real;
    preadv_fn f = atomic_load(&real);
    if (!f) {
        f = (preadv_fn)dlsym(RTLD_NEXT, "preadv");
        atomic_store(&real, f);
    }
    return faulty((real_fn){.v = f}, fd, iov, cnt, off);
}

ssize_t preadv64(int fd, const struct iovec *iov, int cnt, off_t off) {
    static _Atomic(preadv_fn) real;
    preadv_fn f = atomic_load(&real);
    if (!f) {
        f = (preadv_fn)dlsym(RTLD_NEXT, "preadv64");
        atomic_store(&real, f);
    }
    return faulty((real_fn){.v = f}, fd, iov, cnt, off);
}
