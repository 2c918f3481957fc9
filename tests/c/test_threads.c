/* test_threads.c — smoe.h's threading contract, from C with pthreads.
 *
 *   test_threads VAULT_DIR
 *
 * 1. Two threads call smoe_prefill_chunk on one session while a third reads its counters and
 *    clears its cache: every call returns SMOE_OK or SMOE_ERR_BUSY, the position is the sum of
 *    the successful chunks, and the KV cache equals a session that ran them one after another.
 * 2. smoe_session_cancel, stored again and again from another thread while a prefill runs:
 *    the prefill returns SMOE_ERR_CANCELLED with the position unchanged (or SMOE_OK if it was
 *    past its last check), and the session then gives what an untouched session gives.
 * 3. A cancel while no call runs is ignored by the next call.
 * Prints "test_threads: ok" (tests/test_c_units.py builds and runs it, also under ASan).
 */
#include "smoe.h"
#include "smoe_testing.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond, ...)                                                                                       \
    do {                                                                                                       \
        if (!(cond)) {                                                                                         \
            fprintf(stderr, "%s:%d: %s: ", __FILE__, __LINE__, #cond);                                         \
            fprintf(stderr, __VA_ARGS__);                                                                      \
            fprintf(stderr, " (%s)\n", smoe_last_error());                                                     \
            exit(1);                                                                                           \
        }                                                                                                      \
    } while (0)

enum { CHUNK = 4, ROUNDS = 150 };

static smoe_vault *vault;
static smoe_session *shared;
static const int32_t ids[CHUNK] = {5, 17, 42, 7};
static atomic_int ok_calls, busy_calls, prefill_done;

static smoe_session *new_session(uint32_t chunk) {
    smoe_session_params p = smoe_session_default_params();
    p.chunk = chunk;
    p.threads = 1;
    p.context = 2048;
    p.cache_bytes = 1 << 20;
    smoe_session *s = NULL;
    CHECK(smoe_session_new(vault, &p, &s) == SMOE_OK, "session");
    return s;
}

static void *prefiller(void *arg) {
    (void)arg;
    for (int i = 0; i < ROUNDS; i++) {
        smoe_status st = smoe_prefill_chunk(shared, ids, CHUNK, NULL, NULL);
        CHECK(st == SMOE_OK || st == SMOE_ERR_BUSY, "prefill returned %d", st);
        atomic_fetch_add(st == SMOE_OK ? &ok_calls : &busy_calls, 1);
    }
    return NULL;
}

static void *reader(void *arg) {
    (void)arg;
    while (atomic_load(&prefill_done) < 2) {
        smoe_counters c;
        memset(&c, 0, sizeof c);
        c.struct_size = sizeof c;
        smoe_status st = smoe_stats(shared, &c);
        CHECK(st == SMOE_OK || st == SMOE_ERR_BUSY, "stats returned %d", st);
        st = smoe_cache_clear(shared);
        CHECK(st == SMOE_OK || st == SMOE_ERR_BUSY, "cache_clear returned %d", st);
        (void)smoe_session_position(shared); /* any time, from any thread */
    }
    return NULL;
}

static void *prefill_then_flag(void *arg) {
    prefiller(arg);
    atomic_fetch_add(&prefill_done, 1);
    return NULL;
}

static void kv_equal(smoe_session *a, smoe_session *b, uint32_t n) {
    smoe_config c;
    c.struct_size = sizeof c;
    CHECK(smoe_vault_config(vault, &c) == SMOE_OK, "config");
    size_t row = (size_t)c.num_key_value_heads * c.head_dim;
    float *ka = malloc(n * row * sizeof(float)), *kb = malloc(n * row * sizeof(float));
    for (uint32_t l = 0; l < c.num_hidden_layers; l++) {
        CHECK(smoe_session_read_kv(a, l, 0, n, ka, NULL) == SMOE_OK, "kv a");
        CHECK(smoe_session_read_kv(b, l, 0, n, kb, NULL) == SMOE_OK, "kv b");
        CHECK(memcmp(ka, kb, n * row * sizeof(float)) == 0, "layer %u: KV differs", l);
    }
    free(ka);
    free(kb);
}

static void test_busy(void) {
    shared = new_session(CHUNK);
    pthread_t t[3];
    pthread_create(&t[0], NULL, prefill_then_flag, NULL);
    pthread_create(&t[1], NULL, prefill_then_flag, NULL);
    pthread_create(&t[2], NULL, reader, NULL);
    for (int i = 0; i < 3; i++) pthread_join(t[i], NULL);
    int ok = atomic_load(&ok_calls);
    CHECK(ok + atomic_load(&busy_calls) == 2 * ROUNDS, "calls %d", ok);
    CHECK(smoe_session_position(shared) == (uint32_t)ok * CHUNK, "position %u after %d chunks",
          smoe_session_position(shared), ok);
    smoe_session *ref = new_session(CHUNK);
    for (int i = 0; i < ok; i++) CHECK(smoe_prefill_chunk(ref, ids, CHUNK, NULL, NULL) == SMOE_OK, "ref");
    kv_equal(shared, ref, (uint32_t)ok * CHUNK);
    smoe_session_free(ref);
    smoe_session_free(shared);
    printf("busy: %d ok, %d busy\n", ok, atomic_load(&busy_calls));
}

static atomic_int stop_cancel;

static void *canceller(void *arg) {
    smoe_session *s = arg;
    while (!atomic_load(&stop_cancel)) smoe_session_cancel(s);
    return NULL;
}

static void test_cancel(void) {
    enum { N = 64 };
    int32_t prompt[N];
    for (int i = 0; i < N; i++) prompt[i] = (i * 37 + 11) % 256;
    smoe_session *s = new_session(N), *ref = new_session(N);
    CHECK(smoe_prefill_chunk(s, prompt, 8, NULL, NULL) == SMOE_OK, "head");
    CHECK(smoe_prefill_chunk(ref, prompt, 8, NULL, NULL) == SMOE_OK, "head");
    int cancelled = 0;
    for (int round = 0; round < 10; round++) {
        atomic_store(&stop_cancel, 0);
        pthread_t t;
        pthread_create(&t, NULL, canceller, s);
        smoe_status st = smoe_prefill_chunk(s, prompt, N, NULL, NULL);
        atomic_store(&stop_cancel, 1);
        pthread_join(t, NULL);
        CHECK(st == SMOE_OK || st == SMOE_ERR_CANCELLED, "prefill under cancel returned %d", st);
        if (st == SMOE_ERR_CANCELLED) {
            cancelled++;
            CHECK(strstr(smoe_last_error(), "cancelled") != NULL, "message");
            CHECK(smoe_session_position(s) == 8, "position %u after a cancel", smoe_session_position(s));
        } else {
            CHECK(smoe_session_rewind(s, 8) == SMOE_OK, "rewind");
        }
    }
    CHECK(cancelled > 0, "no prefill was cancelled");
    /* still usable, and exact */
    CHECK(smoe_prefill_chunk(s, prompt, N, NULL, NULL) == SMOE_OK, "after cancel");
    CHECK(smoe_prefill_chunk(ref, prompt, N, NULL, NULL) == SMOE_OK, "ref");
    kv_equal(s, ref, 8 + N);
    /* a cancel while nothing runs is ignored */
    CHECK(smoe_session_cancel(s) == SMOE_OK, "cancel");
    CHECK(smoe_decode_step(s, 3, NULL, NULL) == SMOE_OK, "decode after an idle cancel");
    CHECK(smoe_session_cancel(NULL) == SMOE_ERR_INVALID_ARG, "NULL");
    CHECK(smoe_session_rewind(s, 1000) == SMOE_ERR_INVALID_ARG, "rewind past the position");
    CHECK(smoe_session_position(s) == 8 + N + 1, "position");
    smoe_session_free(s);
    smoe_session_free(ref);
    printf("cancel: %d of 10 cancelled\n", cancelled);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: test_threads VAULT_DIR\n");
        return 2;
    }
    CHECK(smoe_open_vault(argv[1], &vault) == SMOE_OK, "open %s", argv[1]);
    test_busy();
    test_cancel();
    smoe_close_vault(vault);
    printf("test_threads: ok\n");
    return 0;
}
