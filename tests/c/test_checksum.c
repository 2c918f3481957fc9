/* test_checksum.c — util.c alone: smoe_checksum and CRC-32C: every implementation this build has
 * gives the same value, on random lengths 0..100k at misaligned addresses; the known CRC-32C check
 * value; the 4-lane definition of docs/vault.md written out with the plain CRC; with the argument
 * "speed", GB/s on one core. And smoe_alloc: zeroed at every size and alignment, also where malloc
 * hands back memory just freed dirty, and (Linux) a large buffer's pages not made resident. Built
 * by tests/test_c_units.py against util.c alone; by hand:
 *   gcc -O2 -mavx2 -pthread -D_GNU_SOURCE -Icsrc tests/c/test_checksum.c csrc/util.c -o /tmp/t && /tmp/t speed */
#include "check.h"
#include "internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t next(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return rng;
}

/* Bit by bit, from the polynomial: no table, no instruction, nothing shared with util.c. */
static uint32_t crc32c_bitwise(const uint8_t *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c & 1) ? 0x82F63B78u ^ (c >> 1) : c >> 1;
    }
    return ~c;
}

/* docs/vault.md's definition, spelled out. */
static uint32_t checksum_spec(const uint8_t *p, size_t n) {
    size_t m = n / 32 * 8;
    uint8_t lanes[16];
    for (int i = 0; i < 4; i++) {
        size_t lo = (size_t)i * m, hi = i < 3 ? lo + m : n;
        uint32_t c = crc32c_bitwise(p + lo, hi - lo);
        for (int b = 0; b < 4; b++) lanes[4 * i + b] = (uint8_t)(c >> (8 * b));
    }
    return crc32c_bitwise(lanes, 16);
}

/* smoe_alloc's contract: aligned and zeroed, whatever malloc hands back (fresh pages or a chunk just
 * freed full of 0xA5: a freed large chunk raises glibc's mmap threshold, so the next one of that
 * size comes from the heap, written). On Linux a 64 MiB buffer's pages are mostly not resident
 * after it (util.c gives its whole pages back rather than writing them): mincore counts them. */
static void check_alloc(void) {
    static const size_t sizes[] = {1, 100, 4095, 4096, 65537, 256 * 1024 - 1, 256 * 1024, 256 * 1024 + 17,
                                   (1u << 20) + 12345, 5u << 20, 40u << 20};
    static const size_t aligns[] = {8, 64, 4096, 16384};
    for (int round = 0; round < 3; round++)
        for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++)
            for (size_t a = 0; a < sizeof aligns / sizeof *aligns; a++) {
                const size_t n = sizes[i], al = aligns[a];
                uint8_t *dirty = malloc(n + 64);
                CHECK(dirty != NULL, "malloc %zu", n);
                if (!dirty) return;
                memset(dirty, 0xA5, n + 64);
                free(dirty);
                uint8_t *p = smoe_alloc(n, al);
                CHECK(p != NULL, "smoe_alloc %zu", n);
                if (!p) return;
                CHECK((uintptr_t)p % al == 0, "smoe_alloc %zu align %zu: %p", n, al, (void *)p);
                size_t bad = n;
                for (size_t k = 0; k < n && bad == n; k++)
                    if (p[k]) bad = k;
                CHECK(bad == n, "smoe_alloc %zu align %zu round %d: byte %zu is %u", n, al, round, bad, p[bad]);
                memset(p, 0x5A, n); /* dirty for the next round's malloc */
                smoe_free(p);
            }
#if defined(__linux__)
    const size_t big = 64u << 20, pg = (size_t)sysconf(_SC_PAGESIZE);
    uint8_t *p = smoe_alloc(big, 64);
    CHECK(p != NULL, "smoe_alloc 64 MiB");
    if (!p) return;
    const uintptr_t lo = ((uintptr_t)p + pg - 1) & ~(uintptr_t)(pg - 1);
    const size_t pages = ((uintptr_t)p + big - lo) / pg;
    unsigned char *vec = malloc(pages);
    size_t resident = 0;
    if (vec && mincore((void *)lo, pages * pg, vec) == 0)
        for (size_t k = 0; k < pages; k++) resident += vec[k] & 1;
    else
        resident = SIZE_MAX;
    CHECK(resident < pages / 4, "a fresh 64 MiB smoe_alloc has %zu of its %zu pages resident", resident, pages);
    CHECK(p[0] == 0 && p[big / 2] == 0 && p[big - 1] == 0, "64 MiB zeroed");
    free(vec);
    smoe_free(p);
#endif
}

int main(int argc, char **argv) {
    printf("impl %s\n", smoe_checksum_impl());
    const uint8_t digits[] = "123456789";
    CHECK(smoe_crc32c(0, digits, 9) == 0xE3069283u, "crc32c check value: %08x", smoe_crc32c(0, digits, 9));
    CHECK(smoe_crc32c_with(SMOE_CRC_TABLE, 0, digits, 9) == 0xE3069283u, "table check value");
    CHECK(crc32c_bitwise(digits, 9) == 0xE3069283u, "bitwise check value");
    CHECK(smoe_crc32c(smoe_crc32c(0, digits, 4), digits + 4, 5) == 0xE3069283u, "continued");
    CHECK(smoe_checksum(NULL, 0) == checksum_spec(digits, 0), "empty");

    enum { MAX = 100000 };
    uint8_t *buf = malloc(MAX + 64);
    for (size_t i = 0; i < MAX + 64; i++) buf[i] = (uint8_t)next();
    int cases = 0;
    for (size_t n = 0; n <= 300; n++) { /* every small length: all lane shapes and tails */
        const uint8_t *p = buf + (n % 13);
        uint32_t want = checksum_spec(p, n);
        CHECK(smoe_checksum(p, n) == want, "n %zu", n);
        CHECK(smoe_checksum_with(SMOE_CRC_TABLE, p, n) == want, "table n %zu", n);
        cases++;
    }
    for (int t = 0; t < 300; t++) { /* random lengths up to 100k at random misalignments */
        size_t n = (size_t)(next() % (MAX + 1)), off = (size_t)(next() % 64);
        const uint8_t *p = buf + off;
        uint32_t best = smoe_checksum(p, n), table = smoe_checksum_with(SMOE_CRC_TABLE, p, n);
        CHECK(best == table, "n %zu off %zu: %08x vs table %08x", n, off, best, table);
        CHECK(smoe_crc32c(0, p, n) == smoe_crc32c_with(SMOE_CRC_TABLE, 0, p, n), "plain crc n %zu off %zu", n, off);
        if (t < 20) CHECK(best == checksum_spec(p, n), "spec n %zu off %zu", n, off);
        cases++;
    }
    /* The lane helpers are what smoe_checksum does. */
    uint64_t b[5];
    smoe_checksum_lanes(MAX, b);
    uint32_t c[4];
    for (int i = 0; i < 4; i++) c[i] = smoe_crc32c(0, buf + b[i], (size_t)(b[i + 1] - b[i]));
    CHECK(smoe_checksum_combine(c) == smoe_checksum(buf, MAX), "lanes + combine");

    /* Speed on one core, with the argument "speed" (bench/RESULTS.md; never asserted). */
    if (argc > 1 && !strcmp(argv[1], "speed")) {
    size_t big = 64u << 20;
    uint8_t *mb = malloc(big);
    for (size_t i = 0; i < big; i += 8) memcpy(mb + i, &(uint64_t){next()}, 8);
    for (int which = 0; which < 2; which++) {
        uint32_t sink = 0;
        double t0 = smoe_now(), dt;
        int reps = 0;
        do {
            sink ^= smoe_checksum_with(which, mb, big);
            reps++;
            dt = smoe_now() - t0;
        } while (dt < 0.3);
        printf("speed %s %.2f GB/s (%08x)\n", which == SMOE_CRC_TABLE ? "table" : smoe_checksum_impl(),
               (double)big * reps / dt / 1e9, sink);
    }
    free(mb);
    }
    free(buf);
    check_alloc();
    if (!failures) printf("test_checksum: ok (%d cases)\n", cases);
    return failures != 0;
}
