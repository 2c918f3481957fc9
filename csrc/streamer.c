/* streamer.c — expert blobs from NVMe into pre-allocated slots, and the retention cache.
 *
 * The pipeline
 * ------------
 * The session's compute thread routes tokens and, the moment an expert enters a layer's union,
 * calls smoe_streamer_acquire(layer, expert). If the blob is retained (read earlier, or being
 * read now) that is a hit: the slot is pinned and returned. Otherwise it is a miss: a victim slot
 * is chosen, re-keyed, marked LOADING, and its index is pushed onto the request ring (with
 * coalescing on, held until smoe_streamer_submit, which queues runs of adjacent blobs as one
 * request each: see "coalesced reads" below). One of io_threads I/O threads pops it and does one
 * pread() of the whole blob into the slot's buffer (one preadv() into the slots of a run), then
 * publishes READY (or FAILED) with a store-release. Compute later calls
 * smoe_streamer_wait(slot) (or wait_any over a set, to consume blobs in the order they land),
 * reads the weights where pread put them, and releases the slot. Nothing is copied; nothing is
 * read that was not acquired (no speculation, no readahead).
 *
 *   compute thread                          I/O threads (io_threads of them)
 *   acquire ─► victim, key, LOADING ─► ring ─► pop ─► pread(blob) ─► checksum ─► READY/FAILED
 *   wait / wait_any ◄─────────────────────────────── completion counter (futex) ◄─┘
 *   use bytes, release (unpin)
 *
 * Slot states (C11 atomics, one 32-bit word per slot)
 *   EMPTY ──acquire (miss)──► LOADING ──I/O thread──► READY  (retained until evicted)
 *                                      └─────────────► FAILED (unpinned FAILED = EMPTY)
 * Only the compute thread moves a slot out of EMPTY, READY or FAILED; only an I/O thread moves
 * it out of LOADING. So each transition has one writer, and everything else about a slot — its
 * key, pin count, LRU stamp, the key→slot index and per-layer counts — is touched by the compute
 * thread alone and needs no lock. The I/O thread writes the slot's buffer and its error fields
 * before its store-release of the state; compute reads them after a load-acquire. A slot that is
 * pinned or LOADING is never a victim. acquire returns −1 when every slot is pinned or loading:
 * the caller releases (or waits for and consumes) something and tries again.
 *
 * The request ring is single-producer (compute) multi-consumer (I/O): the producer writes the
 * entry and store-releases tail; a consumer loads tail, reads the entry and claims it with a CAS
 * on head. Every queued request belongs to a LOADING slot, so at most n_slots are queued and a
 * ring of the next power of two ≥ n_slots never overflows. Idle I/O threads sleep on a futex
 * (Linux) or a condition variable (elsewhere) keyed on a sequence word bumped per push; the
 * producer issues a wake only when some thread has declared itself asleep. Completions bump a
 * second counter that a waiting compute thread sleeps on, after a short spin. The sleeper flags
 * and counters are seq_cst so that "declare asleep, re-check" and "publish, check for sleepers"
 * cannot both miss each other.
 *
 * Retention policy
 * ----------------
 * Layers are visited in a cycle, 0..L−1 for every token. Plain global LRU thrashes on a cycle
 * whenever the budget is smaller than the working set: the blob needed next is always the one
 * used longest ago, so LRU evicts exactly what is about to be asked for and every access misses.
 * So the budget is shared out over the sparse layers: quota = n_slots / n_sparse_layers (integer
 * division; 0 when there are more layers than slots). On a miss in layer R the victim is
 *   1. an EMPTY slot (or an unpinned FAILED one), if any;
 *   2. otherwise an unpinned READY slot, chosen by, in turn:
 *      a. its layer's excess, count_in_layer − quota: the largest;
 *      b. at equal excess, a layer other than R: R's unpinned blobs are the ones its current
 *         visit may still ask for;
 *      c. then the layer used most recently: in a cycle that layer is needed again furthest in
 *         the future (Belady), whereas the least recently used layer is the next one visited;
 *      d. within the layer, the order of retention.c (smoe_retention_before): by default LRFU,
 *         the smallest use count decayed per visit of the layer, then the least recently used;
 *         SMOE_RETENTION=lru gives the least recently used alone (the policy before LRFU).
 * Each layer thus keeps about its quota of blobs across the cycle, and those score hits on the
 * next token when routing repeats (adjacent tokens share about half their experts); a layer
 * that grows past its quota (a prefill union) gives back its own oldest blobs first.
 * This refines "most over quota (the requester counting its new entry), ties to the globally
 * LRU", which still thrashes when every layer sits at its quota: the requester is then the one
 * over, evicts its own oldest blob, and that is the next one its visit asks for. In a model
 * over random top-8 routing, 48 layers, 50% overlap between tokens (hit rates; global LRU,
 * that rule, this one): 96 slots 0 / 0.031 / 0.085; 200 slots 0 / 0.163 / 0.204; 400 slots
 * (more than the 384 one token needs) 0.524 / 0.437 / 0.486; 1000 slots 0.604 / 0.611 / 0.616.
 * Recency is a per-slot stamp (and a per-layer one) from a 64-bit clock bumped on every
 * acquire. The victim search is a linear scan over the slots: it runs only on a miss, which
 * costs a multi-megabyte read, so a few thousand compares are noise and a heap would only add
 * state.
 *
 * Accounting: a hit or miss per acquire (a LOADING slot asked for again is a hit: it was
 * requested once); blob_reads and bytes_read count when a read is issued (compute thread, no
 * atomics), so a read that fails still counts — it went to the disk. io_wait_s is the time
 * wait/wait_any spent on slots that were still LOADING.
 *
 * Checking: with params.verify (the session default) the I/O thread computes smoe_checksum of
 * every blob right after its pread and before publishing READY, so compute never sees bytes that
 * do not match the blob table; a mismatch is a FAILED slot (SMOE_ERR_IO from wait), read again
 * by the next acquire. Hardware CRC32C runs at several GB/s per core, far above the disk, and the
 * I/O threads are otherwise idle while pread sleeps (bench/RESULTS.md measures the cost).
 *
 * Which file: the streamer never reopens vault.bin by path when it can help it. The buffered
 * descriptor is a dup of the vault's; on Linux the O_DIRECT one reopens /proc/self/fd/N, which
 * follows the open file, not the name. Elsewhere (or without /proc) the path is opened and its
 * device and inode compared with the vault's descriptor: a different file is refused.
 *
 * Direct I/O: with params.direct_io the file is opened O_DIRECT (Linux) or F_NOCACHE (macOS)
 * next to an ordinary buffered descriptor. Slots are 16 KiB aligned and blob offsets and sizes
 * are multiples of 16 KiB, as O_DIRECT requires. If the O_DIRECT open fails, or an O_DIRECT read
 * fails with EINVAL (a filesystem that accepts the flag but not the I/O), the streamer logs a
 * warning and uses the buffered descriptor from then on; stats report which is in force. A probe
 * read of the file's first page at creation settles this before any blob is read.
 */
#include "streamer.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#if defined(__linux__) && !defined(SMOE_NO_FUTEX)
#define SMOE_FUTEX 1
#include <linux/futex.h>
#include <sys/syscall.h>
#else
#define SMOE_FUTEX 0
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

enum { SLOT_EMPTY = 0, SLOT_LOADING = 1, SLOT_READY = 2, SLOT_FAILED = 3 };
enum { ERR_NONE = 0, ERR_ERRNO, ERR_SHORT, ERR_CRC };

#define SPIN_ITERS 2000 /* ~10–50 µs of polling before sleeping: a blob read takes milliseconds */
#define MAX_RUN 64       /* blobs in one coalesced read: its iovecs live on the I/O thread's stack */

typedef struct {
    _Atomic uint32_t state;
    /* Request, written by compute before the push, read by the I/O thread after the pop. */
    uint32_t layer, expert;
    uint64_t offset;
    uint32_t crc;
    int32_t next; /* the next slot of the same coalesced read, −1 for the last (or a lone read) */
    /* Outcome, written by the I/O thread before its store-release of state. */
    int err_kind, err_no;
    uint64_t got; /* bytes read before a short read */
    /* Compute thread only. */
    int32_t key;    /* layer × n_experts + expert, −1 when none */
    uint32_t pins;
    uint64_t stamp; /* LRU clock at the last acquire */
    uint8_t *data;  /* blob_bytes, SMOE_PAGE aligned */
} slot_t;

/* Bytes of the blob a slot holds or loads: its layer's blob length (the slot is blob_bytes). */
#define SLOT_LEN(s, sl) ((s)->p.layer_bytes ? (s)->p.layer_bytes[(sl)->layer] : (s)->p.blob_bytes)

/* A word that threads sleep on until its value changes: a futex, or a mutex + condvar. */
typedef struct {
    _Atomic uint32_t seq;
    _Atomic uint32_t sleepers;
#if !SMOE_FUTEX
    pthread_mutex_t mu;
    pthread_cond_t cv;
#endif
} waitword;

struct smoe_streamer {
    smoe_streamer_params p; /* path, blob_offset and blob_crc are the caller's (must outlive) */
    uint32_t n_keys;
    slot_t *slots;   /* (n_slots) */
    uint8_t *arena;  /* the slots' bytes, one after another (n_slots · blob_bytes) */
    int32_t *index;  /* (n_layers × n_experts) key → slot, −1 = not retained */
    uint32_t *layer_count; /* (n_layers) retained slots per layer */
    uint64_t *layer_use;   /* (n_layers) clock at the layer's last acquire */
    uint32_t quota;
    uint64_t clock;
    smoe_retention ret; /* the within-layer victim order (retention.c) */

    /* Coalescing (compute thread only): misses held until submit, then read in offset order. */
    uint32_t max_run;  /* blobs per read request; 1 = every miss is read alone at acquire */
    uint32_t *held;    /* (n_slots) LOADING slots not yet queued */
    uint32_t n_held;

    int fd_direct, fd_buffered; /* fd_direct is −1 without direct I/O */
    _Atomic bool use_direct;
    _Atomic bool warned;

    /* Request ring: single producer (compute), many consumers (I/O). */
    _Atomic uint32_t *ring; /* (ring_cap) slot indices */
    uint32_t ring_mask;
    _Atomic uint32_t head, tail;
    waitword queued;    /* bumped per push and at shutdown; idle I/O threads sleep on it */
    waitword completed; /* bumped per finished read; compute sleeps on it */
    _Atomic bool stop;

    pthread_t *threads;
    uint32_t n_threads; /* started */

    uint64_t blob_reads, bytes_read, read_requests, hits, misses;
    double io_wait_s;
};

/* ------------------------------------------------------------------------------ wait words */

static int waitword_init(waitword *w) {
    atomic_init(&w->seq, 0);
    atomic_init(&w->sleepers, 0);
#if !SMOE_FUTEX
    if (pthread_mutex_init(&w->mu, NULL) != 0) return -1;
    if (pthread_cond_init(&w->cv, NULL) != 0) {
        pthread_mutex_destroy(&w->mu);
        return -1;
    }
#endif
    return 0;
}

static void waitword_destroy(waitword *w) {
#if !SMOE_FUTEX
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
#else
    (void)w;
#endif
}

/* Sleeps while w->seq == seen. The caller has already counted itself in sleepers and re-checked
 * its condition after loading seen; spurious returns are fine (callers loop). */
static void waitword_sleep(waitword *w, uint32_t seen) {
#if SMOE_FUTEX
    syscall(SYS_futex, (uint32_t *)&w->seq, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
#else
    pthread_mutex_lock(&w->mu);
    while (atomic_load(&w->seq) == seen) pthread_cond_wait(&w->cv, &w->mu);
    pthread_mutex_unlock(&w->mu);
#endif
}

/* Bumps seq and wakes up to n sleepers (INT_MAX = all), with no syscall when none sleeps. */
static void waitword_bump(waitword *w, int n) {
    atomic_fetch_add(&w->seq, 1);
    if (atomic_load(&w->sleepers) == 0) return;
#if SMOE_FUTEX
    syscall(SYS_futex, (uint32_t *)&w->seq, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
#else
    pthread_mutex_lock(&w->mu);
    pthread_mutex_unlock(&w->mu);
    if (n == 1) pthread_cond_signal(&w->cv);
    else pthread_cond_broadcast(&w->cv);
#endif
}

/* --------------------------------------------------------------------------------- the ring */

static void ring_push(smoe_streamer *s, uint32_t slot) {
    uint32_t t = atomic_load_explicit(&s->tail, memory_order_relaxed);
    atomic_store_explicit(&s->ring[t & s->ring_mask], slot, memory_order_relaxed);
    atomic_store_explicit(&s->tail, t + 1, memory_order_release);
    waitword_bump(&s->queued, 1);
}

/* Claims one request; false when the ring is empty. */
static bool ring_pop(smoe_streamer *s, uint32_t *slot) {
    uint32_t h = atomic_load_explicit(&s->head, memory_order_relaxed);
    for (;;) {
        uint32_t t = atomic_load_explicit(&s->tail, memory_order_acquire);
        if (h == t) return false;
        /* May be stale if another consumer claims h first; then the CAS fails and h reloads. */
        uint32_t v = atomic_load_explicit(&s->ring[h & s->ring_mask], memory_order_relaxed);
        if (atomic_compare_exchange_weak_explicit(&s->head, &h, h + 1, memory_order_acquire,
                                                  memory_order_relaxed)) {
            *slot = v;
            return true;
        }
    }
}

/* ------------------------------------------------------------------------------ I/O threads */

static const char *errno_text(int e, char *buf, size_t n) {
#if defined(__GLIBC__) && defined(_GNU_SOURCE)
    return strerror_r(e, buf, n);
#else
    if (strerror_r(e, buf, n) != 0) snprintf(buf, n, "errno %d", e);
    return buf;
#endif
}

static void fall_back_to_buffered(smoe_streamer *s, int err) {
    atomic_store(&s->use_direct, false);
    if (!atomic_exchange(&s->warned, true)) {
        char eb[128];
        smoe_log(SMOE_LOG_WARN, "%s: direct I/O read failed (%s); using buffered reads", s->p.path,
                 errno_text(err, eb, sizeof eb));
    }
}

/* preadv until every iovec is full, the file ends or a read fails (EINTR is retried); iov is
 * consumed. Returns the bytes read, or −1 with errno. */
static int64_t preadv_full(int fd, struct iovec *iov, int n, uint64_t off) {
    uint64_t done = 0;
    while (n > 0) {
        ssize_t r = preadv(fd, iov, n, (off_t)(off + done));
        if (r < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (r == 0) break;
        done += (uint64_t)r;
        while (n > 0 && (size_t)r >= iov->iov_len) {
            r -= (ssize_t)iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + r;
            iov->iov_len -= (size_t)r;
        }
    }
    return (int64_t)done;
}

#ifdef SMOE_STREAMER_TEST_HOOKS
/* Tests only: 1 = the O_DIRECT open fails with EINVAL, 2 = every O_DIRECT read does. */
int smoe_streamer_test_fail_direct;
static int64_t pread_direct(int fd, uint8_t *buf, uint64_t len, uint64_t off) {
    if (smoe_streamer_test_fail_direct == 2) {
        errno = EINVAL;
        return -1;
    }
    return smoe_pread_full(fd, buf, len, off);
}
static int64_t preadv_direct(int fd, struct iovec *iov, int n, uint64_t off) {
    if (smoe_streamer_test_fail_direct == 2) {
        errno = EINVAL;
        return -1;
    }
    return preadv_full(fd, iov, n, off);
}
#else
#define pread_direct smoe_pread_full
#define preadv_direct preadv_full
#endif

/* Reads the slots of one request, run[0..k) (their blobs adjacent in the file, run[0] first),
 * with O_DIRECT when in force; falls back on EINVAL. One blob is one pread (the fault shim in
 * tests/c wraps both calls); several are one preadv straight into their slots. */
static int64_t read_run(smoe_streamer *s, slot_t *const *run, uint32_t k) {
    uint64_t n = SLOT_LEN(s, run[0]), off = run[0]->offset; /* one layer's blobs: one length */
    if (k == 1) {
        if (atomic_load_explicit(&s->use_direct, memory_order_relaxed)) {
            int64_t r = pread_direct(s->fd_direct, run[0]->data, n, off);
            if (r >= 0 || errno != EINVAL) return r;
            fall_back_to_buffered(s, errno);
        }
        return smoe_pread_full(s->fd_buffered, run[0]->data, n, off);
    }
    struct iovec iov[MAX_RUN];
    for (uint32_t i = 0; i < k; i++) iov[i] = (struct iovec){run[i]->data, (size_t)n};
    if (atomic_load_explicit(&s->use_direct, memory_order_relaxed)) {
        int64_t r = preadv_direct(s->fd_direct, iov, (int)k, off);
        if (r >= 0 || errno != EINVAL) return r;
        fall_back_to_buffered(s, errno);
        for (uint32_t i = 0; i < k; i++) iov[i] = (struct iovec){run[i]->data, (size_t)n};
    }
    return preadv_full(s->fd_buffered, iov, (int)k, off);
}

/* Does the request whose first slot is head: reads its run, then settles every blob of it on
 * its own (a failed request fails each blob; a short one fails those it did not cover; each
 * blob's checksum is checked apart), so errors still name one layer and expert. */
static void do_read(smoe_streamer *s, slot_t *head) {
    slot_t *run[MAX_RUN];
    run[0] = head;
    uint32_t k = 1;
    while (k < MAX_RUN && run[k - 1]->next >= 0) {
        run[k] = &s->slots[run[k - 1]->next];
        k++;
    }
    uint64_t n = SLOT_LEN(s, head);
    int64_t r = read_run(s, run, k);
    int err = errno;
    for (uint32_t i = 0; i < k; i++) {
        slot_t *sl = run[i];
        uint64_t before = (uint64_t)i * n;
        uint64_t got = r > 0 && (uint64_t)r > before ? (uint64_t)r - before : 0;
        uint32_t state = SLOT_READY;
        sl->err_kind = ERR_NONE;
        if (r < 0) {
            sl->err_kind = ERR_ERRNO;
            sl->err_no = err;
            state = SLOT_FAILED;
        } else if (got < n) {
            sl->err_kind = ERR_SHORT;
            sl->got = got;
            state = SLOT_FAILED;
        } else if (s->p.verify && smoe_checksum(sl->data, n) != sl->crc) {
            sl->err_kind = ERR_CRC;
            state = SLOT_FAILED;
        }
        atomic_store_explicit(&sl->state, state, memory_order_release);
    }
    waitword_bump(&s->completed, INT_MAX);
}

/* Pops and reads until stop is set and the ring is empty: requests queued before free() still
 * complete, so no slot is left LOADING behind a joined thread. */
static void *io_main(void *arg) {
    smoe_streamer *s = arg;
    for (;;) {
        uint32_t slot;
        if (ring_pop(s, &slot)) {
            do_read(s, &s->slots[slot]);
            continue;
        }
        atomic_fetch_add(&s->queued.sleepers, 1);
        uint32_t seen = atomic_load(&s->queued.seq);
        bool empty = atomic_load(&s->head) == atomic_load(&s->tail);
        if (empty && atomic_load(&s->stop)) {
            atomic_fetch_sub(&s->queued.sleepers, 1);
            return NULL;
        }
        if (empty) waitword_sleep(&s->queued, seen);
        atomic_fetch_sub(&s->queued.sleepers, 1);
    }
}

/* ------------------------------------------------------------------------- create, destroy */

static void stop_threads(smoe_streamer *s) {
    atomic_store(&s->stop, true);
    waitword_bump(&s->queued, INT_MAX);
    for (uint32_t i = 0; i < s->n_threads; i++) pthread_join(s->threads[i], NULL);
    s->n_threads = 0;
}

void smoe_streamer_free(smoe_streamer *s) {
    if (!s) return;
    if (s->held) smoe_streamer_submit(s); /* no slot is left LOADING behind the joined threads */
    stop_threads(s);
    if (s->fd_direct >= 0) close(s->fd_direct);
    if (s->fd_buffered >= 0) close(s->fd_buffered);
    smoe_free(s->arena);
    waitword_destroy(&s->completed);
    waitword_destroy(&s->queued);
    smoe_free(s->threads);
    smoe_free((void *)s->ring);
    smoe_free(s->held);
    smoe_retention_free(&s->ret);
    smoe_free(s->layer_use);
    smoe_free(s->layer_count);
    smoe_free(s->index);
    smoe_free(s->slots);
    smoe_free(s);
}

/* Opens path with flags and keeps it only if it is the same file as the vault's descriptor:
 * −1 with errno set if it cannot be opened, −2 if it is another file (closed again). */
static int open_same_file(const smoe_streamer *s, int flags) {
    int fd = open(s->p.path, flags);
    if (fd < 0) return -1;
    struct stat a, b;
    if (fstat(fd, &a) != 0 || fstat(s->p.fd, &b) != 0 || a.st_dev != b.st_dev || a.st_ino != b.st_ino) {
        close(fd);
        return -2;
    }
    return fd;
}

/* Opens the direct descriptor, if asked, and decides with one probe read whether it works.
 * SMOE_ERR_VAULT if the only way to open it finds another file at the path. */
static smoe_status open_direct(smoe_streamer *s) {
    char eb[128];
#if defined(__linux__)
    char self[64];
    snprintf(self, sizeof self, "/proc/self/fd/%d", s->p.fd);
    s->fd_direct = open(self, O_RDONLY | O_DIRECT | O_CLOEXEC); /* the open file, whatever its name now */
    if (s->fd_direct < 0 && (errno == ENOENT || errno == ENOTDIR || errno == EACCES)) /* no /proc */
        s->fd_direct = open_same_file(s, O_RDONLY | O_DIRECT | O_CLOEXEC);
#ifdef SMOE_STREAMER_TEST_HOOKS
    if (smoe_streamer_test_fail_direct == 1 && s->fd_direct >= 0) {
        close(s->fd_direct);
        s->fd_direct = -1;
        errno = EINVAL;
    }
#endif
    if (s->fd_direct == -2)
        return smoe_fail(SMOE_ERR_VAULT, "%s: vault.bin changed since it was opened (another file is there now); "
                                         "open the vault again", s->p.path);
    if (s->fd_direct < 0) {
        smoe_log(SMOE_LOG_WARN, "%s: cannot open with O_DIRECT (%s); using buffered reads", s->p.path,
                 errno_text(errno, eb, sizeof eb));
        return SMOE_OK;
    }
#elif defined(__APPLE__)
    /* F_NOCACHE belongs to the open file description: set on a dup it would change the vault's
     * own descriptor too, so the path is opened anew and checked to be the same file. */
    s->fd_direct = open_same_file(s, O_RDONLY | O_CLOEXEC);
    if (s->fd_direct == -2)
        return smoe_fail(SMOE_ERR_VAULT, "%s: vault.bin changed since it was opened (another file is there now); "
                                         "open the vault again", s->p.path);
    if (s->fd_direct >= 0 && fcntl(s->fd_direct, F_NOCACHE, 1) != 0) {
        smoe_log(SMOE_LOG_WARN, "%s: F_NOCACHE refused (%s); using buffered reads", s->p.path,
                 errno_text(errno, eb, sizeof eb));
        close(s->fd_direct);
        s->fd_direct = -1;
    }
    if (s->fd_direct < 0) return SMOE_OK;
#else
    smoe_log(SMOE_LOG_WARN, "%s: no direct I/O on this platform; using buffered reads", s->p.path);
    (void)eb;
    return SMOE_OK;
#endif
    atomic_store(&s->use_direct, true);
    /* The probe reads the file's first page (the vault header, never a blob) into slot 0. */
    if (pread_direct(s->fd_direct, s->slots[0].data, SMOE_PAGE, 0) < 0) {
        if (errno == EINVAL) fall_back_to_buffered(s, errno);
        /* Other errors will show again, with a blob's name, on the first real read. */
    }
    memset(s->slots[0].data, 0, SMOE_PAGE);
    return SMOE_OK;
}

smoe_status smoe_streamer_new(const smoe_streamer_params *p, smoe_streamer **out) {
    if (!out) return smoe_fail(SMOE_ERR_INVALID_ARG, "streamer: out is NULL");
    *out = NULL;
    if (!p || !p->path || p->fd < 0 || !p->blob_offset || !p->blob_crc)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "streamer: missing parameter");
    if (p->blob_bytes == 0 || p->blob_bytes % SMOE_PAGE != 0 || p->blob_bytes > (uint64_t)SIZE_MAX / 2)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "streamer: blob_bytes %llu is not a positive multiple of %u",
                         (unsigned long long)p->blob_bytes, SMOE_PAGE);
    if (p->n_slots < 1 || p->io_threads < 1 || p->n_layers < 1 || p->n_experts < 1 ||
        p->n_sparse_layers > p->n_layers || p->n_slots > (1u << 30) || p->io_threads > 1024 ||
        (uint64_t)p->n_layers * p->n_experts > INT32_MAX)
        return smoe_fail(SMOE_ERR_INVALID_ARG,
                         "streamer: bad sizes (slots %u, io threads %u, layers %u (%u sparse), experts %u)",
                         p->n_slots, p->io_threads, p->n_layers, p->n_sparse_layers, p->n_experts);
    uint32_t n_keys = p->n_layers * p->n_experts;
    for (uint32_t k = 0; k < n_keys; k++)
        if (p->blob_offset[k] % SMOE_PAGE != 0)
            return smoe_fail(SMOE_ERR_INVALID_ARG, "streamer: blob (%u,%u) offset %llu is not %u-aligned",
                             k / p->n_experts, k % p->n_experts, (unsigned long long)p->blob_offset[k],
                             SMOE_PAGE);

    smoe_streamer *s = smoe_alloc(sizeof *s, 64);
    if (!s) return smoe_fail(SMOE_ERR_NOMEM, "streamer: out of memory");
    s->p = *p;
    s->n_keys = n_keys;
    s->fd_direct = s->fd_buffered = -1;
    atomic_init(&s->use_direct, false);
    atomic_init(&s->warned, false);
    atomic_init(&s->head, 0);
    atomic_init(&s->tail, 0);
    atomic_init(&s->stop, false);
    if (waitword_init(&s->queued) != 0) {
        smoe_free(s);
        return smoe_fail(SMOE_ERR_NOMEM, "streamer: cannot create a condition variable");
    }
    if (waitword_init(&s->completed) != 0) {
        waitword_destroy(&s->queued);
        smoe_free(s);
        return smoe_fail(SMOE_ERR_NOMEM, "streamer: cannot create a condition variable");
    }
    s->quota = p->n_sparse_layers ? p->n_slots / p->n_sparse_layers : 0;
    uint64_t run = p->coalesce_bytes / p->blob_bytes;
    s->max_run = run < 1 ? 1 : run > MAX_RUN ? MAX_RUN : (uint32_t)run;

    uint32_t cap = 1;
    while (cap < p->n_slots) cap <<= 1;
    s->ring_mask = cap - 1;
    s->slots = smoe_alloc((size_t)p->n_slots * sizeof *s->slots, 64);
    s->index = smoe_alloc((size_t)n_keys * sizeof *s->index, 64);
    s->layer_count = smoe_alloc((size_t)p->n_layers * sizeof *s->layer_count, 64);
    s->layer_use = smoe_alloc((size_t)p->n_layers * sizeof *s->layer_use, 64);
    s->ring = smoe_alloc((size_t)cap * sizeof *s->ring, 64);
    s->threads = smoe_alloc((size_t)p->io_threads * sizeof *s->threads, 64);
    s->held = smoe_alloc((size_t)p->n_slots * sizeof *s->held, 64);
    if (!s->slots || !s->index || !s->layer_count || !s->layer_use || !s->ring || !s->threads || !s->held ||
        !smoe_retention_init(&s->ret, p->retention, p->half_life, p->n_layers, p->n_experts)) {
        smoe_streamer_free(s);
        return smoe_fail(SMOE_ERR_NOMEM, "streamer: out of memory");
    }
    for (uint32_t k = 0; k < n_keys; k++) s->index[k] = -1;
    for (uint32_t i = 0; i < cap; i++) atomic_init(&s->ring[i], 0);
    /* Untouched (a slot's bytes are read only once a read has filled them: READY): the kernel
     * maps a slot's pages when its first read lands in them, in the I/O threads, beside the
     * compute, and only for the slots a run uses. Touching every page here instead made the
     * session 0.2-0.3 s slower to create for a 608 MiB cache and load + TTFT 3-12 % slower on
     * the Xeon (bench/RESULTS.md, "The slots' pages"). One arena on huge pages (smoe_alloc_huge:
     * the products stream through the slots). */
    if (p->n_slots && (size_t)p->blob_bytes > SIZE_MAX / p->n_slots) {
        smoe_streamer_free(s);
        return smoe_fail(SMOE_ERR_NOMEM, "streamer: %u slots of %llu bytes overflow the address space", p->n_slots,
                         (unsigned long long)p->blob_bytes);
    }
    s->arena = p->n_slots ? smoe_alloc_huge((size_t)p->n_slots * (size_t)p->blob_bytes) : NULL;
    if (p->n_slots && !s->arena) {
        smoe_streamer_free(s);
        return smoe_fail(SMOE_ERR_NOMEM, "streamer: cannot allocate %u slots of %llu bytes", p->n_slots,
                         (unsigned long long)p->blob_bytes);
    }
    for (uint32_t i = 0; i < p->n_slots; i++) {
        slot_t *sl = &s->slots[i];
        atomic_init(&sl->state, SLOT_EMPTY);
        sl->key = -1;
        sl->next = -1;
        sl->data = s->arena + (size_t)i * (size_t)p->blob_bytes;
    }

    char eb[128];
    s->fd_buffered = fcntl(p->fd, F_DUPFD_CLOEXEC, 0); /* the vault's open file, not the path */
    if (s->fd_buffered < 0) {
        smoe_status st = smoe_fail(SMOE_ERR_IO, "%s: cannot duplicate the vault's descriptor: %s", p->path,
                                   errno_text(errno, eb, sizeof eb));
        smoe_streamer_free(s);
        return st;
    }
    smoe_status st = p->direct_io ? open_direct(s) : SMOE_OK;
    if (st != SMOE_OK) {
        smoe_streamer_free(s);
        return st;
    }

    for (uint32_t i = 0; i < p->io_threads; i++) {
        int e = smoe_thread_start(&s->threads[i], "smoe-io", 0, io_main, s);
        if (e != 0) {
            smoe_streamer_free(s);
            return smoe_fail(SMOE_ERR_NOMEM, "streamer: cannot start I/O thread %u of %u: %s", i + 1,
                             p->io_threads, errno_text(e, eb, sizeof eb));
        }
        s->n_threads = i + 1;
    }
    *out = s;
    return SMOE_OK;
}

/* ---------------------------------------------------------------------------- compute side */

static uint32_t state_of(const slot_t *sl) {
    return atomic_load_explicit(&((slot_t *)sl)->state, memory_order_acquire);
}

static void unmap(smoe_streamer *s, slot_t *sl) {
    if (sl->key < 0) return;
    if (s->index[sl->key] == (int32_t)(sl - s->slots)) s->index[sl->key] = -1;
    s->layer_count[(uint32_t)sl->key / s->p.n_experts]--;
    sl->key = -1;
}

/* The retention policy (see the essay at the top). −1 when every slot is pinned or loading. */
static int pick_victim(smoe_streamer *s, uint32_t layer) {
    int best = -1;
    int64_t best_excess = 0;
    bool best_other = false;
    uint64_t best_layer_use = 0;
    for (uint32_t i = 0; i < s->p.n_slots; i++) {
        slot_t *sl = &s->slots[i];
        if (sl->pins) continue;
        uint32_t st = state_of(sl);
        if (st == SLOT_EMPTY || st == SLOT_FAILED) return (int)i;
        if (st != SLOT_READY) continue;
        uint32_t l = (uint32_t)sl->key / s->p.n_experts;
        int64_t excess = (int64_t)s->layer_count[l] - (int64_t)s->quota;
        bool other = l != layer;
        uint64_t layer_use = s->layer_use[l];
        bool better;
        if (best < 0) better = true;
        else if (excess != best_excess) better = excess > best_excess;
        else if (other != best_other) better = other;
        else if (layer_use != best_layer_use) better = layer_use > best_layer_use;
        else better = smoe_retention_before(&s->ret, (uint32_t)sl->key, sl->stamp, (uint32_t)s->slots[best].key,
                                            s->slots[best].stamp);
        if (better) {
            best = (int)i;
            best_excess = excess;
            best_other = other;
            best_layer_use = layer_use;
        }
    }
    return best;
}

static void issue_read(smoe_streamer *s, uint32_t v);

int smoe_streamer_acquire(smoe_streamer *s, uint32_t layer, uint32_t expert) {
    if (!s || layer >= s->p.n_layers || expert >= s->p.n_experts) {
        smoe_fail(SMOE_ERR_INVALID_ARG, "streamer: no blob (%u,%u)", layer, expert);
        return -2;
    }
    uint32_t key = layer * s->p.n_experts + expert;
    if (s->p.blob_offset[key] == 0) {
        smoe_fail(SMOE_ERR_INVALID_ARG, "streamer: layer %u has no expert blobs", layer);
        return -2;
    }
    smoe_retention_used(&s->ret, layer, key);
    int32_t idx = s->index[key];
    if (idx >= 0) {
        slot_t *sl = &s->slots[idx];
        if (state_of(sl) != SLOT_FAILED) {
            sl->pins++;
            sl->stamp = s->layer_use[layer] = ++s->clock;
            s->hits++;
            return idx;
        }
        /* A failed read is retried by whoever asks next; the failed slot empties on release. */
        unmap(s, sl);
        if (sl->pins == 0) atomic_store_explicit(&sl->state, SLOT_EMPTY, memory_order_relaxed);
    }
    int v = pick_victim(s, layer);
    if (v < 0) return -1;
    slot_t *sl = &s->slots[v];
    unmap(s, sl);
    sl->key = (int32_t)key;
    s->index[key] = v;
    s->layer_count[layer]++;
    sl->pins = 1;
    sl->stamp = s->layer_use[layer] = ++s->clock;
    sl->layer = layer;
    sl->expert = expert;
    sl->offset = s->p.blob_offset[key];
    sl->crc = s->p.blob_crc[key];
    atomic_store_explicit(&sl->state, SLOT_LOADING, memory_order_relaxed);
    s->misses++;
    s->blob_reads++;
    s->bytes_read += SLOT_LEN(s, sl);
    issue_read(s, (uint32_t)v);
    return v;
}

/* ------------------------------------------------------------------------- coalesced reads
 *
 * Blobs of one layer lie in vault.bin in expert order, back to back (docs/vault.md), so a
 * layer's union is mostly runs of neighbours. With coalescing on (max_run ≥ 2) a miss is not
 * queued at once: submit (called by the layer after routing, and by every wait) sorts the held
 * slots by offset and queues one request per run of adjacent blobs, at most max_run long. The
 * run is chained through the slots' next fields; the I/O thread reads it with one preadv into
 * the slots where they are (they need not be neighbours in memory) and settles each blob on its
 * own. Only acquired blobs are in a run, so no byte is read that routing did not ask for. Which
 * slot a miss takes (the retention policy) is untouched: this is only when and how the read is
 * issued. */

static void issue_read(smoe_streamer *s, uint32_t v) {
    if (s->max_run > 1) {
        s->held[s->n_held++] = v; /* at most one entry per LOADING slot: never overflows */
        return;
    }
    s->slots[v].next = -1;
    s->read_requests++;
    ring_push(s, v); /* its store-release publishes the request fields */
}

void smoe_streamer_submit(smoe_streamer *s) {
    if (!s || s->n_held == 0) return;
    uint32_t *h = s->held, n = s->n_held;
    /* Shell sort by offset: in place and allocation-free; n is about a layer's union. */
    static const uint32_t gaps[] = {701, 301, 132, 57, 23, 10, 4, 1};
    for (uint32_t g = 0; g < sizeof gaps / sizeof *gaps; g++)
        for (uint32_t i = gaps[g]; i < n; i++) {
            uint32_t v = h[i], j = i;
            for (; j >= gaps[g] && s->slots[h[j - gaps[g]]].offset > s->slots[v].offset; j -= gaps[g])
                h[j] = h[j - gaps[g]];
            h[j] = v;
        }
    for (uint32_t i = 0; i < n;) {
        uint32_t j = i + 1;
        while (j < n && j - i < s->max_run && s->slots[h[j]].layer == s->slots[h[j - 1]].layer &&
               s->slots[h[j]].offset == s->slots[h[j - 1]].offset + SLOT_LEN(s, &s->slots[h[j - 1]])) {
            s->slots[h[j - 1]].next = (int32_t)h[j];
            j++;
        }
        s->slots[h[j - 1]].next = -1;
        s->read_requests++;
        ring_push(s, h[i]);
        i = j;
    }
    s->n_held = 0;
}

/* Sleeps (after a short spin) until done(s, arg) holds; done is re-checked after every
 * completion. Adds the time to io_wait_s. */
static void wait_until(smoe_streamer *s, bool (*done)(const smoe_streamer *, const void *), const void *arg) {
    smoe_streamer_submit(s); /* a held read would otherwise never finish */
    if (done(s, arg)) return;
    double t0 = smoe_now();
    for (int i = 0; i < SPIN_ITERS && !done(s, arg); i++) cpu_relax();
    while (!done(s, arg)) {
        atomic_store(&s->completed.sleepers, 1); /* one compute thread: a flag is enough */
        uint32_t seen = atomic_load(&s->completed.seq);
        if (!done(s, arg)) waitword_sleep(&s->completed, seen);
        atomic_store(&s->completed.sleepers, 0);
    }
    s->io_wait_s += smoe_now() - t0;
}

static bool slot_done(const smoe_streamer *s, const void *arg) {
    return state_of(&s->slots[*(const int *)arg]) != SLOT_LOADING;
}

typedef struct {
    const int *slots;
    uint32_t n;
} slot_set;

/* Not loading; a slot index out of range counts as settled (wait on it reports the error). */
static bool settled(const smoe_streamer *s, int slot) {
    return slot < 0 || (uint32_t)slot >= s->p.n_slots || state_of(&s->slots[slot]) != SLOT_LOADING;
}

static bool any_done(const smoe_streamer *s, const void *arg) {
    const slot_set *set = arg;
    for (uint32_t i = 0; i < set->n; i++)
        if (settled(s, set->slots[i])) return true;
    return false;
}

static bool none_loading(const smoe_streamer *s, const void *arg) {
    (void)arg;
    for (uint32_t i = 0; i < s->p.n_slots; i++)
        if (state_of(&s->slots[i]) == SLOT_LOADING) return false;
    return true;
}

smoe_status smoe_streamer_wait(smoe_streamer *s, int slot) {
    if (!s || slot < 0 || (uint32_t)slot >= s->p.n_slots)
        return smoe_fail(SMOE_ERR_INVALID_ARG, "streamer: bad slot %d", slot);
    wait_until(s, slot_done, &slot);
    slot_t *sl = &s->slots[slot];
    if (state_of(sl) == SLOT_READY) return SMOE_OK;
    if (state_of(sl) != SLOT_FAILED) return smoe_fail(SMOE_ERR_INVALID_ARG, "streamer: slot %d holds no blob", slot);
    unsigned long long off = (unsigned long long)sl->offset;
    char eb[128];
    switch (sl->err_kind) {
    case ERR_CRC:
        return smoe_fail(SMOE_ERR_IO,
                         "%s: blob (%u,%u) checksum mismatch (layer %u, expert %u, offset %llu): the file changed or "
                         "the read was corrupted; run `pysmoe verify`",
                         s->p.path, sl->layer, sl->expert, sl->layer, sl->expert, off);
    case ERR_SHORT:
        return smoe_fail(SMOE_ERR_IO,
                         "%s: short read of blob (%u,%u) (layer %u, expert %u, offset %llu): got %llu of %llu "
                         "bytes (file truncated?)",
                         s->p.path, sl->layer, sl->expert, sl->layer, sl->expert, off,
                         (unsigned long long)sl->got, (unsigned long long)SLOT_LEN(s, sl));
    default:
        return smoe_fail(SMOE_ERR_IO, "%s: read of blob (%u,%u) (layer %u, expert %u, offset %llu) failed: %s",
                         s->p.path, sl->layer, sl->expert, sl->layer, sl->expert, off,
                         errno_text(sl->err_no, eb, sizeof eb));
    }
}

uint32_t smoe_streamer_wait_any(smoe_streamer *s, const int *slots, uint32_t n) {
    if (!s || !slots || n == 0) return n;
    slot_set set = {slots, n};
    wait_until(s, any_done, &set);
    for (uint32_t i = 0; i < n; i++)
        if (settled(s, slots[i])) return i;
    return n; /* unreachable: any_done held and only compute leaves non-LOADING states */
}

bool smoe_streamer_ready(const smoe_streamer *s, int slot) {
    return s && slot >= 0 && (uint32_t)slot < s->p.n_slots && state_of(&s->slots[slot]) != SLOT_LOADING;
}

const uint8_t *smoe_streamer_data(const smoe_streamer *s, int slot) {
    if (!s || slot < 0 || (uint32_t)slot >= s->p.n_slots) return NULL;
    return s->slots[slot].data;
}

void smoe_streamer_release(smoe_streamer *s, int slot) {
    if (!s || slot < 0 || (uint32_t)slot >= s->p.n_slots) return;
    slot_t *sl = &s->slots[slot];
    if (sl->pins == 0) return;
    if (--sl->pins == 0 && state_of(sl) == SLOT_FAILED) {
        unmap(s, sl);
        atomic_store_explicit(&sl->state, SLOT_EMPTY, memory_order_relaxed);
    }
}

/* An unpinned slot not loading can be taken; an unpinned loading one (a read a cancelled or
 * failed call left in flight) will become one. */
static bool takeable_or_none_pending(const smoe_streamer *s, const void *arg) {
    (void)arg;
    bool pending = false;
    for (uint32_t i = 0; i < s->p.n_slots; i++) {
        const slot_t *sl = &s->slots[i];
        if (sl->pins) continue;
        if (state_of(sl) != SLOT_LOADING) return true;
        pending = true;
    }
    return !pending;
}

bool smoe_streamer_settle(smoe_streamer *s) {
    if (!s) return false;
    wait_until(s, takeable_or_none_pending, NULL);
    for (uint32_t i = 0; i < s->p.n_slots; i++)
        if (!s->slots[i].pins && state_of(&s->slots[i]) != SLOT_LOADING) return true;
    return false;
}

void smoe_streamer_clear(smoe_streamer *s) {
    if (!s) return;
    wait_until(s, none_loading, NULL);
    for (uint32_t i = 0; i < s->p.n_slots; i++) {
        slot_t *sl = &s->slots[i];
        if (sl->pins) continue; /* a caller bug; leave what is in use alone */
        unmap(s, sl);
        atomic_store_explicit(&sl->state, SLOT_EMPTY, memory_order_relaxed);
    }
}

void smoe_streamer_get_stats(const smoe_streamer *s, smoe_streamer_stats *out) {
    if (!s || !out) return;
    out->blob_reads = s->blob_reads;
    out->bytes_read = s->bytes_read;
    out->read_requests = s->read_requests;
    out->hits = s->hits;
    out->misses = s->misses;
    out->io_wait_s = s->io_wait_s;
    out->direct_io = atomic_load(&((smoe_streamer *)s)->use_direct);
}

void smoe_streamer_reset_stats(smoe_streamer *s) {
    if (!s) return;
    s->blob_reads = s->bytes_read = s->read_requests = s->hits = s->misses = 0;
    s->io_wait_s = 0;
}

uint64_t smoe_streamer_slot_bytes(const smoe_streamer *s) {
    return s ? (uint64_t)s->p.n_slots * s->p.blob_bytes : 0;
}
