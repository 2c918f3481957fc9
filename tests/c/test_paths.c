/* test_paths.c — the two prefill paths of the whole engine, bit for bit, from C alone.
 *
 *   test_paths VAULT_DIR [N_PROMPT]
 *
 * For a prompt of N_PROMPT ids (default 23, made from a fixed generator), the token-serial
 * path (every id through smoe_decode_step, one thread) is the baseline; then for several
 * (chunk, threads) pairs the layer-major path (smoe_prefill_chunk in chunks, the last id
 * through smoe_decode_step) must give the same logits of the last id and the same K and V rows
 * of every layer, bit for bit, and so must two more greedy decode steps. All of it twice: with
 * 8-bit activations for q8/q4 products (the default) and with float_activations (the f32
 * products of smoe_matmul_rows).
 *
 * The Python tests check the same property with hypothesis; this program exists for builds with
 * no Python on the target: `make neon-check` runs it, linked statically for AArch64, under
 * qemu-aarch64, so the NEON kernels are checked inside the engine and not only one by one. */
#include "smoe.h"
#include "smoe_testing.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

enum { DECODE = 2 };

typedef struct {
    float *logits; /* ((1 + DECODE), vocab) the last prompt id's logits, then each decode step's */
    float *k, *v;  /* (layers, n_pos, kv_dim) */
} run_out;

static smoe_config cfg;
static uint32_t kv_dim, n_pos;

/* Prefill ids[0, n - 1) with chunk (0 = token-serial), then decode ids[n - 1] and DECODE greedy
 * ids; fills out. 0 on success. */
static int run_prompt(smoe_vault *vault, const int32_t *ids, uint32_t n, uint32_t chunk, uint32_t threads,
                      uint32_t float_act, run_out *out) {
    smoe_session_params p = smoe_session_default_params();
    p.threads = threads;
    p.chunk = chunk ? chunk : 1;
    p.context = n + DECODE + 8;
    p.cache_bytes = 0;
    p.float_activations = float_act;
    smoe_session *s = NULL;
    smoe_status st = smoe_session_new(vault, &p, &s);
    if (st != SMOE_OK) {
        fprintf(stderr, "session_new (chunk %u, threads %u): %s: %s\n", chunk, threads, smoe_status_str(st),
                smoe_last_error());
        return 1;
    }
    int rc = 0;
    for (uint32_t i = 0; i + 1 < n && rc == 0;) {
        uint32_t len = chunk == 0 ? 0 : (n - 1 - i < chunk ? n - 1 - i : chunk);
        st = len ? smoe_prefill_chunk(s, ids + i, len, NULL, NULL) : smoe_decode_step(s, ids[i], NULL, NULL);
        i += len ? len : 1;
        if (st != SMOE_OK) rc = 1;
    }
    int32_t next = ids[n - 1];
    for (uint32_t d = 0; d <= DECODE && rc == 0; d++)
        if (smoe_decode_step(s, next, out->logits + (size_t)d * cfg.vocab_size, &next) != SMOE_OK) rc = 1;
    for (uint32_t l = 0; l < cfg.num_hidden_layers && rc == 0; l++)
        if (smoe_session_read_kv(s, l, 0, n_pos, out->k + (size_t)l * n_pos * kv_dim,
                                 out->v + (size_t)l * n_pos * kv_dim) != SMOE_OK)
            rc = 1;
    if (rc) fprintf(stderr, "chunk %u, threads %u: %s\n", chunk, threads, smoe_last_error());
    smoe_session_free(s);
    return rc;
}

static size_t first_diff(const float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (memcmp(a + i, b + i, sizeof(float)) != 0) return i;
    return n;
}

/* Every (chunk, threads) case against token-serial in one activation mode. 0 unless a run
 * failed (a difference is a CHECK failure). */
static int check_paths(smoe_vault *vault, const int32_t *ids, uint32_t n, uint32_t float_act) {
    static const uint32_t cases[][2] = {{1, 2}, {3, 1}, {5, 3}, {7, 4}, {64, 2}, {64, 1}}; /* (chunk, threads) */
    const char *mode = float_act ? "f32 activations" : "8-bit activations";
    const size_t nl = (size_t)(1 + DECODE) * cfg.vocab_size, nkv = (size_t)cfg.num_hidden_layers * n_pos * kv_dim;
    run_out base = {malloc(sizeof(float) * nl), malloc(sizeof(float) * nkv), malloc(sizeof(float) * nkv)};
    run_out got = {malloc(sizeof(float) * nl), malloc(sizeof(float) * nkv), malloc(sizeof(float) * nkv)};
    int rc = run_prompt(vault, ids, n, 0, 1, float_act, &base);
    for (size_t c = 0; c < sizeof cases / sizeof *cases && rc == 0; c++) {
        const uint32_t chunk = cases[c][0], threads = cases[c][1];
        if ((rc = run_prompt(vault, ids, n, chunk, threads, float_act, &got)) != 0) break;
        size_t i = first_diff(got.logits, base.logits, nl);
        CHECK(i == nl, "%s, chunk %u, threads %u: logits differ from token-serial (step %zu, id %zu)", mode, chunk,
              threads, i / cfg.vocab_size, i % cfg.vocab_size);
        i = first_diff(got.k, base.k, nkv);
        CHECK(i == nkv, "%s, chunk %u, threads %u: K differs from token-serial (layer %zu, pos %zu)", mode, chunk,
              threads, i / ((size_t)n_pos * kv_dim), i / kv_dim % n_pos);
        i = first_diff(got.v, base.v, nkv);
        CHECK(i == nkv, "%s, chunk %u, threads %u: V differs from token-serial (layer %zu, pos %zu)", mode, chunk,
              threads, i / ((size_t)n_pos * kv_dim), i / kv_dim % n_pos);
    }
    free(base.logits), free(base.k), free(base.v);
    free(got.logits), free(got.k), free(got.v);
    return rc;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s VAULT_DIR [N_PROMPT]\n", argv[0]);
        return 2;
    }
    const uint32_t n = argc > 2 ? (uint32_t)atoi(argv[2]) : 23;
    if (n < 2) {
        fprintf(stderr, "N_PROMPT must be at least 2\n");
        return 2;
    }
    smoe_vault *vault = NULL;
    smoe_status st = smoe_open_vault(argv[1], &vault);
    if (st != SMOE_OK) {
        fprintf(stderr, "open_vault %s: %s: %s\n", argv[1], smoe_status_str(st), smoe_last_error());
        return 1;
    }
    cfg.struct_size = sizeof cfg;
    smoe_vault_config(vault, &cfg);
    kv_dim = cfg.num_key_value_heads * cfg.head_dim;
    n_pos = n + DECODE; /* the last decoded id is sampled, not fed */

    int32_t *ids = malloc(sizeof(int32_t) * n);
    uint64_t z = 12345;
    for (uint32_t i = 0; i < n; i++) {
        z = z * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int32_t)((z >> 33) % cfg.vocab_size);
    }
    int rc = 0;
    for (uint32_t float_act = 0; float_act < 2 && rc == 0; float_act++) rc = check_paths(vault, ids, n, float_act);
    free(ids);
    smoe_close_vault(vault);
    if (rc) return 1;
    if (failures) {
        fprintf(stderr, "test_paths: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_paths: ok (%u prompt ids, %u layers, %u experts; 8-bit and f32 activations)\n", n,
           cfg.num_hidden_layers, cfg.num_experts);
    return 0;
}
