/* fuzz_vault.c — drives smoe_vault_parse, the pure parser of vault.bin's header and tables.
 *
 * libFuzzer (clang):
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -D_GNU_SOURCE -Icsrc tests/c/fuzz_vault.c \
 *         csrc/vault.c csrc/util.c csrc/cpu/kernels.c csrc/cpu/kernels_ref.c -lm -pthread -o build/fuzz_vault
 *   build/fuzz_vault -artifact_prefix=build/fuzz/ CORPUS_DIR   (seed it with the first KiBs of a
 *   tiny vault.bin; without -artifact_prefix libFuzzer writes its crash-* files where it runs)
 *
 * Without clang, the same file is its own mutation driver (-DSTANDALONE; `make fuzz` builds it
 * with ASan and UBSan against every csrc/ file, which the blob phase needs, and runs it):
 *   fuzz_vault ITERS OUT_DIR vault.bin...
 * Each vault.bin's header and tables (the seed, which must parse) are parsed ITERS times with a few
 * random bytes changed, half of the time with header_crc recomputed so the edit reaches the
 * checks behind the checksum. The input being parsed is kept in OUT_DIR/fuzz_vault-input.bin,
 * removed when the phase ends: a driver killed by a sanitizer report, a signal or a timeout leaves
 * the input it died on there. The mutations come from a fixed seed: a run is reproducible.
 *
 * Then blob payloads through the whole engine: in a copy of the vault (OUT_DIR/blobfuzz-XXXXXX/,
 * removed at the end, kept when a check fails), ITERS / 1000 times (at least 50) a few bytes of a
 * random expert blob are changed on disk, the vault is opened, a new session prefills a fixed
 * prompt, the vault is closed and the bytes are put back. With verify_blobs the prefill must fail
 * with SMOE_ERR_VAULT or SMOE_ERR_IO unless no token was routed to that expert; without it, it
 * must not crash (whatever the numbers). The driver writes nothing outside OUT_DIR.
 */
#include "vault.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef STANDALONE
#include <fcntl.h>
#include <unistd.h>
#endif

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
            if (w->attn == SMOE_ATTN_LINEAR) /* a Gated DeltaNet in place of q, k, v, o: every tensor present */
                sum += w->lin_qkv->rows + w->lin_z->rows + w->lin_b->rows + w->lin_a->rows + w->lin_conv->cols +
                       w->lin_a_log->cols + w->lin_dt_bias->cols + w->lin_norm->cols + w->lin_out->rows;
            else
                sum += w->q->rows + w->k->rows + w->v->rows + w->o->rows;
            sum += w->input_norm->cols + w->post_norm->cols;
            sum += w->sparse ? w->router->rows : w->mlp_gate->rows + w->mlp_up->rows + w->mlp_down->rows;
            /* the tensors the vault's parameters call for, present exactly when they say */
            const smoe_tensor *opt[] = {w->q_norm, w->k_norm, w->q_bias, w->k_bias, w->v_bias, w->o_bias,
                                        w->router_bias, w->shared_gate, w->shared_up, w->shared_down,
                                        w->sinks, w->q_gate, w->shared_expert_gate};
            for (size_t i = 0; i < sizeof opt / sizeof *opt; i++) sum += opt[i] ? opt[i]->cols : 0;
            const smoe_expert_layout *x = &lay.xl[l];
            for (int i = 0; i < SMOE_XT_COUNT; i++) sum += x->has[i] ? x->t[i].offset + x->t[i].nbytes : 0;
            sum += lay.layer_blob_bytes[l] + lay.layer_attn[l];
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

/* Copies src to dst; 0 on success. */
static int copy_file(const char *src, const char *dst) {
    FILE *in = fopen(src, "rb"), *out = in ? fopen(dst, "wb") : NULL;
    char buf[1 << 16];
    size_t n;
    int rc = in && out ? 0 : -1;
    while (rc == 0 && (n = fread(buf, 1, sizeof buf, in)) > 0)
        if (fwrite(buf, 1, n, out) != n) rc = -1;
    if (in) fclose(in);
    if (out && fclose(out) != 0) rc = -1;
    return rc;
}

/* The blob phase. The vault is opened anew after each mutation and closed before the bytes are
 * put back: a vault refuses new sessions once its file changed under it (size or mtime: "rewritten
 * in place"), so each run must see the changed bytes as the file it opened, as a user would. */
static int fuzz_blobs(const char *vault_bin, const char *out_dir, long iters) {
    char dir[4096], bin[4200];
    if ((size_t)snprintf(dir, sizeof dir, "%s/blobfuzz-XXXXXX", out_dir) >= sizeof dir)
        return fprintf(stderr, "%s: path too long\n", out_dir), 1;
    if (!mkdtemp(dir)) return perror(dir), 1;
    snprintf(bin, sizeof bin, "%s/vault.bin", dir);
    int rc = 1, fd = -1;
    smoe_vault *v = NULL;
    smoe_session *s = NULL;
    uint64_t *blob_offset = NULL, *counts = NULL;
    if (copy_file(vault_bin, bin) != 0) {
        fprintf(stderr, "cannot copy %s to %s\n", vault_bin, bin);
        goto done;
    }
    /* The layout, read once from the unchanged copy. */
    if (smoe_open_vault(dir, &v) != SMOE_OK) {
        fprintf(stderr, "%s\n", smoe_last_error());
        goto done;
    }
    const smoe_config cfg = v->lay.cfg;
    const uint32_t E = cfg.num_experts, n_keys = cfg.num_hidden_layers * E;
    const uint64_t blob_bytes = v->lay.blob_bytes;
    if (cfg.num_sparse_layers == 0 || blob_bytes == 0) {
        fprintf(stderr, "%s: no sparse layer, no blobs to fuzz\n", vault_bin);
        goto done;
    }
    blob_offset = malloc(n_keys * sizeof *blob_offset);
    counts = calloc(E, sizeof *counts);
    if (!blob_offset || !counts) {
        fprintf(stderr, "out of memory\n");
        goto done;
    }
    memcpy(blob_offset, v->lay.blob_offset, n_keys * sizeof *blob_offset);
    smoe_close_vault(v);
    v = NULL;
    if ((fd = open(bin, O_RDWR)) < 0) {
        perror(bin);
        goto done;
    }
    int32_t ids[24];
    for (int i = 0; i < 24; i++) ids[i] = (int32_t)((i * 131 + 7) % cfg.vocab_size);
    long caught = 0, unused = 0, unchecked = 0;
    for (long it = 0; it < iters; it++) {
        uint32_t key;
        do key = (uint32_t)(rnd() % n_keys);
        while (blob_offset[key] == 0);
        uint64_t off[4];
        uint8_t old[4];
        int k = 1 + (int)(rnd() % 4);
        for (int j = 0; j < k; j++) {
            off[j] = blob_offset[key] + rnd() % blob_bytes;
            uint8_t b;
            if (pread(fd, &old[j], 1, (off_t)off[j]) != 1) {
                perror("pread");
                goto done;
            }
            b = (uint8_t)(old[j] ^ (1u + rnd() % 255)); /* always a change */
            if (pwrite(fd, &b, 1, (off_t)off[j]) != 1) {
                perror("pwrite");
                goto done;
            }
        }
        smoe_session_params p = smoe_session_default_params();
        p.threads = 1;
        p.verify_blobs = it % 2 == 0;
        if (smoe_open_vault(dir, &v) != SMOE_OK || smoe_session_new(v, &p, &s) != SMOE_OK) {
            fprintf(stderr, "iteration %ld: %s\n", it, smoe_last_error());
            goto done;
        }
        smoe_status st = smoe_prefill_chunk(s, ids, 23, NULL, NULL);
        if (st == SMOE_OK) st = smoe_decode_step(s, ids[23], NULL, NULL);
        char why[512];
        snprintf(why, sizeof why, "%s", st == SMOE_OK ? "" : smoe_last_error());
        if (smoe_stats_expert_counts(s, key / E, counts, E) != SMOE_OK) {
            fprintf(stderr, "iteration %ld: %s\n", it, smoe_last_error());
            goto done;
        }
        const uint64_t routed = counts[key % E];
        if (p.verify_blobs) {
            if (st == SMOE_ERR_VAULT || st == SMOE_ERR_IO) caught++;
            else if (st == SMOE_OK && routed == 0) unused++;
            else {
                fprintf(stderr, "iteration %ld: blob (%u,%u) changed: status %d, routed %llu: %s\n", it, key / E,
                        key % E, st, (unsigned long long)routed, why);
                goto done;
            }
        } else {
            unchecked++;
        }
        smoe_session_free(s);
        s = NULL;
        smoe_close_vault(v);
        v = NULL;
        for (int j = k - 1; j >= 0; j--) /* in reverse: a byte changed twice gets its first value */
            if (pwrite(fd, &old[j], 1, (off_t)off[j]) != 1) {
                perror("pwrite");
                goto done;
            }
    }
    rc = 0;
    printf("%s: %ld blob mutations: %ld caught by the checksum, %ld in experts nobody used, %ld unchecked runs\n",
           vault_bin, iters, caught, unused, unchecked);
done:
    smoe_session_free(s);
    smoe_close_vault(v);
    free(counts);
    free(blob_offset);
    if (fd >= 0) close(fd);
    if (rc == 0) {
        unlink(bin);
        rmdir(dir);
    } else {
        fprintf(stderr, "the vault it failed on is kept in %s\n", dir);
    }
    return rc;
}

/* The parse phase's current input, kept in a file so that whatever kills the driver (a sanitizer
 * report, a signal, a timeout) leaves behind the input it died on; removed when the phase ends. */
static int keep_fd = -1;
static size_t kept_len; /* the file's length: it is cut only when an input's length differs */
static int keep(const uint8_t *buf, size_t len) {
    if (len != kept_len && ftruncate(keep_fd, (off_t)len) != 0) return perror("keep"), -1;
    kept_len = len;
    if (pwrite(keep_fd, buf, len, 0) != (ssize_t)len) return perror("keep"), -1;
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s ITERS OUT_DIR vault.bin...\n", argv[0]);
        return 2;
    }
    long iters = atol(argv[1]);
    const char *out_dir = argv[2];
    char keep_path[4200];
    snprintf(keep_path, sizeof keep_path, "%s/fuzz_vault-input.bin", out_dir);
    for (int a = 3; a < argc; a++) {
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
        if ((keep_fd = open(keep_path, O_RDWR | O_CREAT | O_TRUNC, 0644)) < 0) return perror(keep_path), 1;
        kept_len = 0;
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
            if (keep(buf, len) != 0) return 1;
            smoe_layout l2;
            if (smoe_vault_parse(buf, len, claimed_size(buf, len), &l2) == SMOE_OK) ok++, smoe_layout_free(&l2);
            LLVMFuzzerTestOneInput(buf, len);
        }
        close(keep_fd);
        unlink(keep_path);
        printf("%s: %ld mutations, %ld parsed\n", argv[a], iters, ok);
        free(seed);
        free(buf);
        if (fuzz_blobs(argv[a], out_dir, iters / 1000 > 50 ? iters / 1000 : 50) != 0) return 1;
    }
    return 0;
}
#endif
