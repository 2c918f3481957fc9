/* fuzz_vault.c — drives smoe_vault_parse, the pure parser of vault.bin's header and tables.
 *
 * libFuzzer (clang):
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -D_GNU_SOURCE -Icsrc tests/c/fuzz_vault.c \
 *         csrc/vault.c csrc/util.c csrc/kernels.c -lm -pthread -o build/fuzz_vault
 *   build/fuzz_vault CORPUS_DIR       (seed it with the first KiBs of a tiny vault.bin)
 *
 * Without clang, the same file is its own mutation driver (-DSTANDALONE): each vault.bin named on
 * the command line is parsed as is, then ITERS times with a few random bytes of its header and
 * tables changed, half of the time with header_crc recomputed so the edit reaches the checks
 * behind the checksum:
 *   gcc -std=c11 -g -O1 -fsanitize=address,undefined -DSTANDALONE -D_GNU_SOURCE -Icsrc \
 *       tests/c/fuzz_vault.c csrc/vault.c csrc/util.c csrc/kernels.c -lm -pthread -o /tmp/fuzz_vault
 *   /tmp/fuzz_vault 200000 some/vault/vault.bin
 */
#include "vault.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The file size the header claims, so that inputs holding only the header and tables (what a
 * fuzzer can mutate in useful time) reach the checks past the size comparison. */
static uint64_t claimed_size(const uint8_t *data, size_t size) {
    if (size < 24) return size;
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | data[16 + i];
    return v;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    smoe_layout lay;
    if (size >= 256) (void)smoe_vault_head_bytes(data);
    if (smoe_vault_parse(data, size, claimed_size(data, size), &lay) == SMOE_OK) {
        /* Touch what the engine would: every layer's tensors and the blob table. */
        uint64_t sum = lay.embed->nbytes + lay.final_norm->nbytes + lay.lm_head->nbytes;
        for (uint32_t l = 0; l < lay.cfg.num_hidden_layers; l++) {
            const smoe_layer_weights *w = &lay.layers[l];
            sum += w->q->rows + w->k->rows + w->v->rows + w->o->rows + w->q_norm->cols + w->k_norm->cols;
            sum += w->input_norm->cols + w->post_norm->cols;
            sum += w->sparse ? w->router->rows : w->mlp_gate->rows + w->mlp_up->rows + w->mlp_down->rows;
        }
        for (uint32_t i = 0; i < lay.n_blobs; i++) sum += lay.blob_offset[i] + lay.blob_crc[i];
        if (sum == 42) fputc(' ', stderr); /* keep the reads */
        smoe_layout_free(&lay);
    }
    return 0;
}

#ifdef STANDALONE
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static void seal(uint8_t *b, size_t n) {
    if (n < 40) return;
    uint64_t end = smoe_vault_head_bytes(b);
    if (end == 0 || end > n) return;
    memset(b + 12, 0, 4);
    uint32_t crc = smoe_checksum(b, end);
    for (int i = 0; i < 4; i++) b[12 + i] = (uint8_t)(crc >> (8 * i));
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s ITERS vault.bin...\n", argv[0]);
        return 2;
    }
    long iters = atol(argv[1]);
    for (int a = 2; a < argc; a++) {
        FILE *f = fopen(argv[a], "rb");
        if (!f) {
            perror(argv[a]);
            return 1;
        }
        uint8_t head[256];
        if (fread(head, 1, 256, f) != 256) return fprintf(stderr, "%s: short\n", argv[a]), 1;
        size_t n = smoe_vault_head_bytes(head);
        if (n == 0) return fprintf(stderr, "%s: not a vault\n", argv[a]), 1;
        uint8_t *seed = malloc(n), *buf = malloc(n);
        rewind(f);
        if (fread(seed, 1, n, f) != n) return fprintf(stderr, "%s: short\n", argv[a]), 1;
        fclose(f);
        smoe_layout lay;
        if (smoe_vault_parse(seed, n, claimed_size(seed, n), &lay) != SMOE_OK)
            return fprintf(stderr, "%s: seed does not parse: %s\n", argv[a], smoe_last_error()), 1;
        smoe_layout_free(&lay);
        long ok = 0;
        for (long it = 0; it < iters; it++) {
            memcpy(buf, seed, n);
            size_t len = n;
            for (int k = 1 + (int)(rnd() % 4); k > 0; k--) {
                size_t pos = rnd() % n;
                size_t word = pos - pos % 4;
                if (rnd() % 2 || word + 4 > n) {
                    buf[pos] = (uint8_t)rnd();
                } else { /* a whole word, small or not: counts, sizes, offsets */
                    uint32_t v = (uint32_t)(rnd() % 3 == 0 ? rnd() : rnd() % 70000);
                    memcpy(buf + word, &v, 4);
                }
            }
            if (rnd() % 2) seal(buf, len);
            if (rnd() % 8 == 0) len = rnd() % (n + 1);
            smoe_layout l2;
            if (smoe_vault_parse(buf, len, claimed_size(buf, len), &l2) == SMOE_OK) ok++, smoe_layout_free(&l2);
            LLVMFuzzerTestOneInput(buf, len);
        }
        printf("%s: %ld mutations, %ld parsed\n", argv[a], iters, ok);
        free(seed);
        free(buf);
    }
    return 0;
}
#endif
