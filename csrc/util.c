/* util.c — what every module shares: status strings, the per-thread error message, the log
 * callback, aligned memory, the clock and the checksum (CRC-32C). Nothing here knows about models. */
#include "internal.h"
#include "smoe_testing.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <errno.h>
#include <unistd.h>
#include <sys/stat.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

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

/* Zeroed. On Linux the whole pages of a large buffer are not written but handed back to the kernel
 * (MADV_DONTNEED: malloc's memory is private and anonymous, so each reads as zeros and is mapped
 * only when first touched); only the ends that share a page with other memory are written. A
 * session's planes (72 MB for a3b at a 256-token chunk) were written at creation, 21-35 ms of page
 * faults and every page resident, though a short prompt touches a few of them (bench/RESULTS.md,
 * "A session's planes"). */
void *smoe_alloc(size_t bytes, size_t align) {
    if (bytes == 0) bytes = 1; /* as smoe_alloc_untouched takes it: the byte it gives is zeroed too */
    void *p = smoe_alloc_untouched(bytes, align);
    if (!p) return NULL;
#if defined(__linux__) && defined(MADV_DONTNEED)
    enum { LAZY_MIN = 256 * 1024 };
    if (bytes >= LAZY_MIN) {
        const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE), a = (uintptr_t)p, end = a + bytes;
        const uintptr_t lo = (a + pg - 1) & ~(pg - 1), hi = end & ~(pg - 1);
        if (pg && !(pg & (pg - 1)) && madvise((void *)lo, hi - lo, MADV_DONTNEED) == 0) {
            memset(p, 0, lo - a);
            memset((void *)hi, 0, end - hi);
            return p;
        }
    }
#endif
    memset(p, 0, bytes);
    return p;
}

void *smoe_alloc_untouched(size_t bytes, size_t align) {
    if (align < sizeof(void *)) align = sizeof(void *);
    if (align & (align - 1)) return NULL;
    if (bytes == 0) bytes = 1; /* a unique pointer, so NULL always means failure */
    void *p = NULL;
    if (posix_memalign(&p, align, bytes) != 0) return NULL;
    return p;
}

/* ------------------------------------------------------- memory this process can still take */

/* A number read from a file (its first field), or UINT64_MAX where it says "max" or cannot be read. */
static uint64_t file_u64(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return UINT64_MAX;
    unsigned long long x = 0;
    const int ok = fscanf(f, "%llu", &x) == 1;
    fclose(f);
    return ok ? (uint64_t)x : UINT64_MAX;
}

/* The value of `key` in a file of "key value" lines (memory.stat), or UINT64_MAX. */
static uint64_t stat_u64(const char *path, const char *key) {
    FILE *f = fopen(path, "r");
    if (!f) return UINT64_MAX;
    char line[256], k[128];
    unsigned long long x;
    uint64_t out = UINT64_MAX;
    while (out == UINT64_MAX && fgets(line, sizeof line, f))
        if (sscanf(line, "%127s %llu", k, &x) == 2 && strcmp(k, key) == 0) out = (uint64_t)x;
    fclose(f);
    return out;
}

/* cgroup v1 writes "no limit" as 2^63 less a page */
#define NO_LIMIT ((uint64_t)1 << 62)

/* The room below one cgroup's limits (folder dir): the least limit (v2: memory.max, memory.high;
 * v1: memory.limit_in_bytes) less its usage plus its inactive file pages, the page cache reclaim
 * takes first; UINT64_MAX where it has no limit or says nothing readable. */
static uint64_t group_room(const char *dir, bool v1) {
    char p[1280];
    uint64_t limit;
    if (v1) {
        snprintf(p, sizeof p, "%s/memory.limit_in_bytes", dir);
        limit = file_u64(p);
    } else {
        snprintf(p, sizeof p, "%s/memory.max", dir);
        limit = file_u64(p);
        snprintf(p, sizeof p, "%s/memory.high", dir);
        const uint64_t high = file_u64(p);
        if (high < limit) limit = high;
    }
    if (limit >= NO_LIMIT) return UINT64_MAX;
    snprintf(p, sizeof p, "%s/%s", dir, v1 ? "memory.usage_in_bytes" : "memory.current");
    const uint64_t usage = file_u64(p);
    if (usage == UINT64_MAX) return UINT64_MAX;
    snprintf(p, sizeof p, "%s/memory.stat", dir);
    uint64_t inactive = v1 ? stat_u64(p, "total_inactive_file") : UINT64_MAX;
    if (inactive == UINT64_MAX) inactive = stat_u64(p, "inactive_file");
    if (inactive >= NO_LIMIT) inactive = 0;
    return limit + inactive > usage ? limit + inactive - usage : 0;
}

/* The least room of the cgroup at `path` under `base` and of each parent up to base, those whose
 * folders exist (in a container without a cgroup namespace the process's path is not under the
 * mount, whose root is then the container's group); its folder into where. */
static uint64_t tree_room(const char *base, const char *path, bool v1, char *where, size_t cap) {
    char cg[512], dir[1100];
    snprintf(cg, sizeof cg, "%s", path);
    uint64_t best = UINT64_MAX;
    for (;;) {
        size_t len = strlen(cg);
        while (len > 0 && cg[len - 1] == '/') cg[--len] = 0;
        snprintf(dir, sizeof dir, "%s%s", base, cg);
        struct stat st;
        if (stat(dir, &st) == 0 && S_ISDIR(st.st_mode)) {
            const uint64_t room = group_room(dir, v1);
            if (room < best) {
                best = room;
                if (where && cap) snprintf(where, cap, "cgroup %s limit of %s", v1 ? "v1" : "v2", dir);
            }
        }
        char *slash = strrchr(cg, '/');
        if (!len || !slash) return best;
        *slash = 0;
    }
}

smoe_status smoe_memory_available_at(const char *meminfo, const char *proc_cgroup, const char *cgroup_root,
                                     uint64_t *bytes, char *where, size_t cap) {
    if (!bytes) return smoe_fail(SMOE_ERR_INVALID_ARG, "smoe_memory_available: bytes is NULL");
    if (where && cap) where[0] = 0;
    uint64_t best = UINT64_MAX;
    FILE *f = fopen(meminfo, "r");
    if (f) {
        char line[256];
        unsigned long long kb;
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) {
                best = (uint64_t)kb * 1024;
                if (where && cap) snprintf(where, cap, "MemAvailable");
            }
        fclose(f);
    }
#if defined(_SC_PHYS_PAGES)
    if (best == UINT64_MAX) { /* macOS and other Unixes: no MemAvailable; half the physical memory */
        const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
        if (pages > 0 && page > 0) {
            best = (uint64_t)pages * (uint64_t)page / 2;
            if (where && cap) snprintf(where, cap, "half the RAM");
        }
    }
#endif
    f = fopen(proc_cgroup, "r");
    if (f) {
        char line[640], v1base[1024], room_where[1280];
        snprintf(v1base, sizeof v1base, "%s/memory", cgroup_root);
        while (fgets(line, sizeof line, f)) {
            line[strcspn(line, "\n")] = 0;
            /* "ID:CONTROLLERS:PATH": v2's is "0::PATH", v1's memory controller one of a list */
            char *ctl = strchr(line, ':'), *path = ctl ? strchr(ctl + 1, ':') : NULL;
            if (!path) continue;
            *ctl++ = 0;
            *path++ = 0;
            uint64_t room = UINT64_MAX;
            if (strcmp(line, "0") == 0 && !*ctl) {
                room = tree_room(cgroup_root, path, false, room_where, sizeof room_where);
            } else {
                char *save = NULL;
                for (char *c = strtok_r(ctl, ",", &save); c; c = strtok_r(NULL, ",", &save))
                    if (strcmp(c, "memory") == 0)
                        room = tree_room(v1base, path, true, room_where, sizeof room_where);
            }
            if (room < best) {
                best = room;
                if (where && cap) snprintf(where, cap, "%s", room_where);
            }
        }
        fclose(f);
    }
    if (best == UINT64_MAX) {
        *bytes = 0;
        return smoe_fail(SMOE_ERR_UNSUPPORTED, "no measure of available memory on this system");
    }
    *bytes = best;
    return SMOE_OK;
}

/* Memory already promised and not yet touched: a deferred lm_head's buffer before its read lands
 * (vault.c). A session sized right after the open would otherwise count it as free. */
static _Atomic uint64_t promised;

uint64_t smoe_memory_promised(int64_t delta) {
    if (delta >= 0) return atomic_fetch_add(&promised, (uint64_t)delta) + (uint64_t)delta;
    return atomic_fetch_sub(&promised, (uint64_t)-delta) - (uint64_t)-delta;
}

smoe_status smoe_memory_available(uint64_t *bytes, char *where, size_t cap) {
    const smoe_status st =
        smoe_memory_available_at("/proc/meminfo", "/proc/self/cgroup", "/sys/fs/cgroup", bytes, where, cap);
    const uint64_t p = atomic_load(&promised);
    if (st == SMOE_OK) *bytes = *bytes > p ? *bytes - p : 0;
    return st;
}

/* A decode step reads every weight it uses once, ~0.7 GB for a3b cut to 8 layers: on 4 KiB pages that
 * is a TLB miss and a page walk every 4 KiB, which the hardware prefetchers do not cross. The
 * cache's slots on 2 MiB pages: with a 10 % cache a step went from 110-116 to 95-97 ms on the Xeon,
 * with every expert cached from 33.5-34.3 to 35.7-36.1 tok/s, a cold first pass no slower
 * (bench/RESULTS.md, "Huge pages"). But where memory is tight they cost: in a cgroup as large as
 * the cache plus the dense weights (the same memory as llama.cpp) a cold 256-token pass took 2.4-2.6
 * s against 1.65 and decode fell 9.2-9.5 -> 6.4-7.3 tok/s (each huge page charged at the limit means
 * reclaim). So the advice is given only where the buffer is at most half the memory free to this
 * process (smoe_memory_available). The dense weights stay on small pages: that VM maps a fresh huge
 * page at 0.3-0.9 GB/s against 2.3-3.3 for small ones, which cost a cold 256-token TTFT ~0.5 s whether they
 * were marked at once or collapsed once read. Whole huge pages: the size rounded up to SMOE_HUGE
 * (under 2 MiB more, for a cache of hundreds). The advice is a hint: where the kernel has none to
 * give, the pages are small. */
void *smoe_alloc_huge(size_t bytes) {
    if (bytes < SMOE_HUGE) return smoe_alloc_untouched(bytes, SMOE_PAGE);
    const size_t whole = (bytes + SMOE_HUGE - 1) & ~(size_t)(SMOE_HUGE - 1);
    if (whole < bytes) return NULL; /* wrapped */
    void *p = smoe_alloc_untouched(whole, SMOE_HUGE);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const char *env = getenv("SMOE_HUGE_PAGES"); /* "0": never advise; "1": always (to measure, or to choose) */
    const bool off = env && strcmp(env, "0") == 0, on = env && strcmp(env, "1") == 0;
    uint64_t room = 0; /* read only when it decides: the files under /proc and /sys are not free */
    if (p && !off && (on || (smoe_memory_available(&room, NULL, 0) == SMOE_OK && room / 2 >= whole)))
        (void)madvise(p, whole, MADV_HUGEPAGE);
#endif
    return p;
}

void smoe_free(void *p) { free(p); }

double smoe_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ------------------------------------------------------------------------------- checksum */

/* CRC-32C (Castagnoli; reflected polynomial 0x82F63B78, init and final xor 0xFFFFFFFF) three
 * ways that give the same bits: the SSE4.2 `crc32` instruction (x86-64, chosen at run time), the
 * ARMv8 CRC instructions (arm64 built with them: __ARM_FEATURE_CRC32, as on Apple silicon and
 * -march=armv8.1-a and later), and a portable slicing-by-8 table.
 *
 * smoe_checksum (docs/vault.md, "Checksums") splits n bytes into 4 lanes — m = (n / 32) · 8,
 * lanes 0..2 cover [i·m, (i+1)·m), lane 3 covers [3·m, n) — and returns the CRC-32C of the four
 * lane CRCs written little-endian. The crc32 instruction has a latency of about 3 cycles and a
 * throughput of one per cycle, so one chain runs at 8 bytes per 3 cycles; the hardware paths
 * interleave the four independent chains and come near 8 bytes per cycle. The portable path
 * computes the same lanes one after the other. */

static uint32_t crc32c_table[8][256];
static pthread_once_t crc32c_once = PTHREAD_ONCE_INIT;

static void crc32c_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? 0x82F63B78u ^ (c >> 1) : c >> 1;
        crc32c_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc32c_table[t][i] = (crc32c_table[t - 1][i] >> 8) ^ crc32c_table[0][crc32c_table[t - 1][i] & 0xFF];
}

/* The raw register update (no pre/post inversion) over n bytes, slicing-by-8: table k holds the
 * CRC of a byte followed by k zero bytes, so eight bytes fold in with eight independent lookups. */
static uint32_t crc32c_raw_table(uint32_t c, const uint8_t *p, size_t n) {
    while (n >= 8) {
        /* Bytes assembled explicitly: little-endian on any host, no aliasing or alignment questions. */
        uint32_t lo = c ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
        c = crc32c_table[7][lo & 0xFF] ^ crc32c_table[6][(lo >> 8) & 0xFF] ^ crc32c_table[5][(lo >> 16) & 0xFF] ^
            crc32c_table[4][lo >> 24] ^ crc32c_table[3][p[4]] ^ crc32c_table[2][p[5]] ^ crc32c_table[1][p[6]] ^
            crc32c_table[0][p[7]];
        p += 8;
        n -= 8;
    }
    while (n--) c = crc32c_table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c;
}

static void put32_le(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* Lane bounds of smoe_checksum for n bytes: lane i is [b[i], b[i+1]). */
void smoe_checksum_lanes(uint64_t n, uint64_t b[5]) {
    uint64_t m = n / 32 * 8;
    for (int i = 0; i < 4; i++) b[i] = (uint64_t)i * m;
    b[4] = n;
}

uint32_t smoe_checksum_combine(const uint32_t lane_crc[4]) {
    uint8_t buf[16];
    for (int i = 0; i < 4; i++) put32_le(buf + 4 * i, lane_crc[i]);
    return smoe_crc32c(0, buf, sizeof buf);
}

static uint32_t checksum_table(const uint8_t *p, size_t n) {
    uint64_t b[5];
    smoe_checksum_lanes(n, b);
    uint32_t c[4];
    for (int i = 0; i < 4; i++) c[i] = ~crc32c_raw_table(0xFFFFFFFFu, p + b[i], (size_t)(b[i + 1] - b[i]));
    return smoe_checksum_combine(c);
}

#if defined(__x86_64__) && !defined(SMOE_NO_HW_CRC)
#include <nmmintrin.h>
#define CRC_HW "sse4.2"
#define CRC_HW_ATTR __attribute__((target("sse4.2")))
#define CRC_STEP64(c, v) ((uint32_t)_mm_crc32_u64((c), (v)))
#define CRC_STEP8(c, v) _mm_crc32_u8((c), (v))
static bool crc_hw_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2");
}
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32) && !defined(SMOE_NO_HW_CRC)
#include <arm_acle.h>
#define CRC_HW "armv8-crc"
#define CRC_HW_ATTR
#define CRC_STEP64(c, v) __crc32cd((c), (v))
#define CRC_STEP8(c, v) __crc32cb((c), (v))
static bool crc_hw_available(void) { return true; } /* the build requires the extension */
#endif

#ifdef CRC_HW
static uint64_t load64_le(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8); /* both hosts with a CRC instruction here (x86-64, arm64) are little-endian */
    return v;
}

CRC_HW_ATTR static uint32_t crc32c_raw_hw(uint32_t c, const uint8_t *p, size_t n) {
    for (; n >= 8; p += 8, n -= 8) c = CRC_STEP64(c, load64_le(p));
    for (; n; p++, n--) c = CRC_STEP8(c, *p);
    return c;
}

/* The four lanes advance together, 8 bytes each per round: four independent dependency chains
 * keep the CRC unit busy. Lanes 0..2 are m bytes (a multiple of 8); lane 3 is m plus the rest. */
CRC_HW_ATTR static uint32_t checksum_hw(const uint8_t *p, size_t n) {
    uint64_t b[5];
    smoe_checksum_lanes(n, b);
    size_t m = (size_t)b[1];
    const uint8_t *p0 = p, *p1 = p + m, *p2 = p + 2 * m, *p3 = p + 3 * m;
    uint32_t c0 = 0xFFFFFFFFu, c1 = c0, c2 = c0, c3 = c0;
    for (size_t i = 0; i < m; i += 8) {
        c0 = CRC_STEP64(c0, load64_le(p0 + i));
        c1 = CRC_STEP64(c1, load64_le(p1 + i));
        c2 = CRC_STEP64(c2, load64_le(p2 + i));
        c3 = CRC_STEP64(c3, load64_le(p3 + i));
    }
    c3 = crc32c_raw_hw(c3, p3 + m, n - 4 * m);
    uint32_t c[4] = {~c0, ~c1, ~c2, ~c3};
    return smoe_checksum_combine(c);
}
#endif

typedef struct {
    uint32_t (*raw)(uint32_t, const uint8_t *, size_t);
    uint32_t (*lanes)(const uint8_t *, size_t);
    const char *name;
} crc_impl;

static crc_impl crc_chosen;
static pthread_once_t crc_choose_once = PTHREAD_ONCE_INIT;

static void crc_choose(void) {
    pthread_once(&crc32c_once, crc32c_init);
    crc_chosen = (crc_impl){crc32c_raw_table, checksum_table, "table"};
#ifdef CRC_HW
    if (crc_hw_available()) crc_chosen = (crc_impl){crc32c_raw_hw, checksum_hw, CRC_HW};
#endif
}

static const crc_impl *crc_get(int which) {
    pthread_once(&crc_choose_once, crc_choose);
    static const crc_impl table = {crc32c_raw_table, checksum_table, "table"};
    return which == SMOE_CRC_TABLE ? &table : &crc_chosen;
}

uint32_t smoe_crc32c(uint32_t crc, const void *data, size_t n) {
    return ~crc_get(SMOE_CRC_BEST)->raw(~crc, data, n);
}

uint32_t smoe_checksum(const void *data, size_t n) { return crc_get(SMOE_CRC_BEST)->lanes(data, n); }

uint32_t smoe_checksum_with(int which, const void *data, size_t n) { return crc_get(which)->lanes(data, n); }

uint32_t smoe_crc32c_with(int which, uint32_t crc, const void *data, size_t n) {
    return ~crc_get(which)->raw(~crc, data, n);
}

const char *smoe_checksum_impl(void) { return crc_get(SMOE_CRC_BEST)->name; }

int smoe_process_id(void) { return (int)getpid(); }

int smoe_thread_start(pthread_t *thread, const char *name, size_t min_stack, void *(*fn)(void *), void *arg) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* the new thread inherits it */
    pthread_attr_t attr;
    int err = pthread_attr_init(&attr);
    if (!err) {
        size_t stack = 0;
        if (min_stack && pthread_attr_getstacksize(&attr, &stack) == 0 && stack < min_stack)
            pthread_attr_setstacksize(&attr, min_stack);
        err = pthread_create(thread, &attr, fn, arg);
        pthread_attr_destroy(&attr);
#ifdef __linux__
        if (!err && name) pthread_setname_np(*thread, name); /* a name is a courtesy: its failure is not one */
#else
        (void)name;
#endif
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return err;
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
