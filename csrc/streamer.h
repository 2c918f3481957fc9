/* streamer.h — expert blobs from disk into pre-allocated aligned slots, and the retention cache.
 *
 * One compute thread (the session's) calls everything here; a pool of I/O threads does the
 * reads. Slot states move through C11 atomics: EMPTY → LOADING → READY (or FAILED); a slot is
 * pinned from acquire to release and is never evicted while pinned or loading. Compute reads a
 * blob's bytes where pread put them. Nothing is read that was not acquired: no speculation. */
#ifndef SMOE_STREAMER_H
#define SMOE_STREAMER_H

#include "internal.h"
#include "retention.h"

typedef struct smoe_streamer smoe_streamer;

typedef struct {
    const char *path;            /* vault.bin: for messages, and the fallback reopen below */
    int fd;                      /* vault.bin as the vault opened it: blobs are read from this file
                                    (a dup, and on Linux /proc/self/fd/N reopened O_DIRECT), so a
                                    vault.bin replaced since is never read; where the open file
                                    cannot be reopened, path is, and refused unless it is the same
                                    file (SMOE_ERR_VAULT) */
    uint64_t blob_bytes;         /* a slot's size: the largest blob; multiple of SMOE_PAGE */
    const uint64_t *layer_bytes; /* (layers) each layer's blob length (≤ blob_bytes, a multiple of
                                    SMOE_PAGE), what a read of its blobs covers; NULL: blob_bytes */
    const uint64_t *blob_offset; /* (layers × experts), 0 = no blob (dense layer) */
    const uint32_t *blob_crc;    /* (layers × experts) */
    uint32_t n_layers, n_experts;
    uint32_t n_sparse_layers;    /* for the per-layer share of the budget */
    uint32_t n_slots;            /* ≥ 1 */
    uint32_t io_threads;         /* ≥ 1 */
    bool direct_io;              /* try O_DIRECT / F_NOCACHE, fall back (logged) */
    bool verify;                 /* check smoe_checksum of every blob read, in the I/O thread */
    uint64_t coalesce_bytes;     /* largest read request. ≥ 2 blobs: a miss is held until
                                    smoe_streamer_submit (or the next wait), and held blobs that lie
                                    next to each other in the file are read with one preadv into
                                    their slots; < 2 blobs: each miss is read alone at acquire */
    smoe_retain_kind retention;  /* within-layer victim order; 0: SMOE_RETENTION or LRFU (retention.h) */
    double half_life;            /* LRFU's, in visits of a layer; ≤ 0: SMOE_RETAIN_HALF_LIFE */
} smoe_streamer_params;

typedef struct {
    uint64_t blob_reads, bytes_read; /* counted when a read is issued (a failed read counts) */
    uint64_t read_requests;          /* reads issued (a coalesced run of blobs is one) */
    uint64_t hits, misses;           /* one of the two per successful acquire */
    double io_wait_s;                /* seconds wait / wait_any / clear spent on loading slots */
    bool direct_io;                  /* in force (false after a logged fallback) */
} smoe_streamer_stats;

smoe_status smoe_streamer_new(const smoe_streamer_params *p, smoe_streamer **out);
void smoe_streamer_free(smoe_streamer *s); /* waits for reads in flight */

/* Pins the slot of (layer, expert), starting its read if it is not retained (a miss), and
 * returns the slot's index (≥ 0). Returns −1, changing nothing, when every slot is pinned or
 * loading: release one and try again. Returns −2 (smoe_last_error says why) for a layer or
 * expert out of range or a layer without blobs: a caller bug, never worth a retry. Does not wait
 * for I/O. Counts a hit or a miss; a slot still loading counts as a hit. Pins nest: acquiring a
 * pinned key again pins it twice. A key whose read failed is read again (a miss). */
int smoe_streamer_acquire(smoe_streamer *s, uint32_t layer, uint32_t expert);

/* Issues the reads that acquire held (coalescing on): sorted by file offset, runs of adjacent
 * blobs as one request each. wait, wait_any, clear and free call it first, so a caller that
 * never calls it still gets every read; calling it as soon as a batch of acquires is done starts
 * the disk sooner. No-op when nothing is held. */
void smoe_streamer_submit(smoe_streamer *s);

/* Waits for slot's read. SMOE_OK when its bytes are ready; SMOE_ERR_IO (message names the
 * layer, expert and offset) when the read failed, came back short or did not match its
 * checksum (the slot then empties on release, so a later acquire reads it again). Time spent
 * waiting is added to io_wait_s. */
smoe_status smoe_streamer_wait(smoe_streamer *s, int slot);

/* Waits until at least one of slots[0..n) is no longer loading; returns its position in the
 * array (the lowest such position); n when n is 0. Does not report failures: call
 * smoe_streamer_wait on the slot it names (which then returns at once). */
uint32_t smoe_streamer_wait_any(smoe_streamer *s, const int *slots, uint32_t n);

bool smoe_streamer_ready(const smoe_streamer *s, int slot); /* no longer loading (a held read is
                                                               still loading: submit first) */
const uint8_t *smoe_streamer_data(const smoe_streamer *s, int slot); /* blob_bytes, 16 KiB aligned */

/* Unpins. A failed slot becomes empty (so a later acquire reads again). */
void smoe_streamer_release(smoe_streamer *s, int slot);

/* Waits until a slot can be taken by smoe_streamer_acquire when none can now only because
 * unpinned slots are still loading (reads that a cancelled or failed call released in flight).
 * Returns true when an acquire can now succeed, false when every slot is pinned. */
bool smoe_streamer_settle(smoe_streamer *s);

/* Drops every retained blob; no slot may be pinned (a pinned one is left alone). Waits for
 * reads in flight. */
void smoe_streamer_clear(smoe_streamer *s);

void smoe_streamer_get_stats(const smoe_streamer *s, smoe_streamer_stats *out);
void smoe_streamer_reset_stats(smoe_streamer *s);
uint64_t smoe_streamer_slot_bytes(const smoe_streamer *s); /* n_slots × blob_bytes */

#endif
