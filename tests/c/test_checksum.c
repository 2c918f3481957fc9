/* test_checksum.c — smoe_checksum and CRC-32C: every implementation this build has gives the same
 * value, on random lengths 0..100k at misaligned addresses; the known CRC-32C check value; the
 * 4-lane definition of docs/vault.md written out with the plain CRC; with the argument "speed",
 * GB/s on one core. Built by tests/test_c_units.py against util.c alone; by hand:
 *   gcc -O2 -mavx2 -pthread -D_GNU_SOURCE -Icsrc tests/c/test_checksum.c csrc/util.c -o /tmp/t && /tmp/t speed */
#include "check.h"
#include "internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    if (!failures) printf("test_checksum: ok (%d cases)\n", cases);
    return failures != 0;
}
