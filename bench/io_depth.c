/* io_depth.c — how many blob reads to keep in flight (the streamer's io_threads).
 *
 *   cc -std=c11 -O2 -pthread -D_GNU_SOURCE -Icsrc bench/io_depth.c csrc/streamer.c csrc/util.c \
 *      -o build/io_depth
 *   build/io_depth FILE [GiB=2.5] [reps=7]
 *   build/io_depth FILE GiB reps union     (coalescing: see below)
 *
 * Makes FILE (GiB of non-zero data, so every read reaches the disk; kept if already that size),
 * then for blobs of 2.5 MiB and 10 MiB reads through the streamer with O_DIRECT at io_threads =
 * 1, 2, 4, 8: each "layer" acquires 8 random distinct blobs (top-8, all missing: the cache is
 * cleared per layer), waits for them and releases them, as a decode step does. The depths are
 * alternated inside each repetition (rotating which goes first) and the median GB/s per depth
 * printed, with the spread. Every read is a miss, so this measures the disk, not the cache.
 *
 * With a fourth argument, coalesced reads instead: blobs of 2.5 MiB in "layers" of 128 (a3b's
 * expert count), each layer acquiring `union` random distinct experts of a random layer at once
 * (as a prefill chunk's union), then waiting for them all; io_threads 4; coalesce_bytes 0 (one
 * read per blob) against 16 MiB (runs of adjacent blobs as one preadv), alternated. */
#include "streamer.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static uint64_t rng = 88172645463325252ull;
static uint64_t next(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int make_file(const char *path, uint64_t bytes) {
    struct stat st;
    if (stat(path, &st) == 0 && (uint64_t)st.st_size == bytes) return 0;
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return -1;
    size_t chunk = 64u << 20;
    uint64_t *buf = malloc(chunk);
    for (uint64_t done = 0; done < bytes; done += chunk) {
        for (size_t i = 0; i < chunk / 8; i++) buf[i] = next() | 1;
        size_t n = bytes - done < chunk ? (size_t)(bytes - done) : chunk;
        if (pwrite(fd, buf, n, (off_t)done) != (ssize_t)n) return -1;
    }
    free(buf);
    fsync(fd);
    close(fd);
    return 0;
}

/* GB/s for `layers` layers of `union` blobs of blob_bytes (out of runs of 128 neighbours when
 * union > 8, anywhere in the file otherwise) at io_threads = depth. */
static double trial(const char *path, uint64_t file_bytes, uint64_t blob_bytes, uint32_t depth, uint32_t layers,
                    uint32_t n_union, uint64_t coalesce) {
    uint32_t n_blobs = (uint32_t)((file_bytes - SMOE_PAGE) / blob_bytes), E = n_blobs;
    uint64_t *off = malloc(sizeof *off * n_blobs);
    uint32_t *crc = calloc(n_blobs, sizeof *crc);
    for (uint32_t i = 0; i < n_blobs; i++) off[i] = SMOE_PAGE + (uint64_t)i * blob_bytes;
    int fd = open(path, O_RDONLY);
    if (fd < 0) {
        perror(path);
        exit(1);
    }
    smoe_streamer_params p = {.path = path, .fd = fd, .blob_bytes = blob_bytes, .blob_offset = off,
                              .blob_crc = crc, .n_layers = 1, .n_experts = E, .n_sparse_layers = 1,
                              .n_slots = n_union, .io_threads = depth, .direct_io = true,
                              .coalesce_bytes = coalesce};
    smoe_streamer *s;
    if (smoe_streamer_new(&p, &s) != SMOE_OK) {
        fprintf(stderr, "%s\n", smoe_last_error());
        exit(1);
    }
    smoe_streamer_stats x;
    smoe_streamer_get_stats(s, &x);
    if (!x.direct_io) fprintf(stderr, "warning: no O_DIRECT on %s\n", path);
    double t0 = smoe_now();
    for (uint32_t l = 0; l < layers; l++) {
        int slots[128];
        uint32_t want[128];
        uint32_t span = n_union > 8 && E >= 128 ? 128 : E, base = span < E ? (uint32_t)(next() % (E / 128)) * 128 : 0;
        for (uint32_t j = 0; j < n_union; j++) {
            bool dup;
            do {
                want[j] = base + (uint32_t)(next() % span);
                dup = false;
                for (uint32_t i = 0; i < j; i++) dup |= want[i] == want[j];
            } while (dup);
            slots[j] = smoe_streamer_acquire(s, 0, want[j]);
        }
        smoe_streamer_submit(s);
        for (uint32_t j = 0; j < n_union; j++) {
            if (smoe_streamer_wait(s, slots[j]) != SMOE_OK) {
                fprintf(stderr, "%s\n", smoe_last_error());
                exit(1);
            }
            smoe_streamer_release(s, slots[j]);
        }
        smoe_streamer_clear(s);
    }
    double dt = smoe_now() - t0;
    smoe_streamer_get_stats(s, &x);
    smoe_streamer_free(s);
    close(fd);
    free(off);
    free(crc);
    return (double)x.bytes_read / dt / 1e9;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s FILE [GiB=2.5] [reps=7]\n", argv[0]);
        return 2;
    }
    double gib = argc > 2 ? atof(argv[2]) : 2.5;
    int reps = argc > 3 ? atoi(argv[3]) : 7;
    uint64_t file_bytes = (uint64_t)(gib * (1u << 30)) / SMOE_PAGE * SMOE_PAGE;
    if (make_file(argv[1], file_bytes) != 0) {
        perror(argv[1]);
        return 1;
    }
    if (argc > 4) { /* coalesced reads, off against on */
        uint32_t n_union = (uint32_t)atoi(argv[4]);
        if (n_union < 1 || n_union > 128) {
            fprintf(stderr, "union: 1 to 128\n");
            return 2;
        }
        uint64_t blob = 160 * SMOE_PAGE;
        uint32_t layers = (uint32_t)((1024ull << 20) / (n_union * blob)) + 1; /* ~1 GiB per trial */
        double r[2][64];
        for (int rep = 0; rep < reps && rep < 64; rep++)
            for (int k = 0; k < 2; k++) {
                int c = (k + rep) % 2;
                r[c][rep] = trial(argv[1], file_bytes, blob, 4, layers, n_union, c ? 16u << 20 : 0);
            }
        printf("blob 2.5 MiB, union %u of 128 per layer, io_threads 4, %d reps, O_DIRECT:\n", n_union, reps);
        for (int c = 0; c < 2; c++) {
            qsort(r[c], (size_t)reps, sizeof(double), cmp);
            printf("  coalesce %s: median %.2f GB/s (min %.2f, max %.2f)\n", c ? "16 MiB" : "off   ", r[c][reps / 2],
                   r[c][0], r[c][reps - 1]);
        }
        return 0;
    }
    static const uint32_t depths[] = {1, 2, 4, 8};
    static const uint64_t sizes[] = {160 * SMOE_PAGE, 640 * SMOE_PAGE}; /* 2.5 MiB, 10 MiB */
    for (int si = 0; si < 2; si++) {
        uint32_t layers = si == 0 ? 16 : 4; /* ~320 MiB per trial */
        double r[4][64];
        for (int rep = 0; rep < reps && rep < 64; rep++)
            for (int k = 0; k < 4; k++) {
                int d = (k + rep) % 4;
                r[d][rep] = trial(argv[1], file_bytes, sizes[si], depths[d], layers, 8, 0);
            }
        printf("blob %.1f MiB, %d reps, 8 blobs per layer, O_DIRECT:\n", (double)sizes[si] / (1 << 20), reps);
        for (int d = 0; d < 4; d++) {
            qsort(r[d], (size_t)reps, sizeof(double), cmp);
            printf("  io_threads %u: median %.2f GB/s (min %.2f, max %.2f)\n", depths[d], r[d][reps / 2], r[d][0],
                   r[d][reps - 1]);
        }
    }
    return 0;
}
