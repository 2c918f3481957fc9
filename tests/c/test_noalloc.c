/* test_noalloc.c — proves that prefill and decode never touch the heap once a session exists.
 *
 *   test_noalloc VAULT_DIR CACHE_BYTES CHUNK N_PROMPT N_DECODE
 *
 * This program defines malloc, calloc, realloc, free, posix_memalign, aligned_alloc and memalign
 * itself; the dynamic linker then binds libsmoe's calls (and libc's own) to them. They forward
 * to glibc's __libc_* entry points and count calls while `armed` is set, from any thread (the
 * I/O and pool threads included). glibc only. */
#define _GNU_SOURCE
#include "smoe.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void __libc_free(void *);
extern void *__libc_memalign(size_t, size_t);

static atomic_int armed;
static atomic_long calls;

static void count(void) {
    if (atomic_load(&armed))
        atomic_fetch_add(&calls, 1);
}

void *malloc(size_t n) { count(); return __libc_malloc(n); }
void *calloc(size_t a, size_t b) { count(); return __libc_calloc(a, b); }
void *realloc(void *p, size_t n) { count(); return __libc_realloc(p, n); }
void free(void *p) { if (p) count(); __libc_free(p); }
void *memalign(size_t a, size_t n) { count(); return __libc_memalign(a, n); }
void *aligned_alloc(size_t a, size_t n) { count(); return __libc_memalign(a, n); }
int posix_memalign(void **out, size_t a, size_t n) {
    count();
    void *p = __libc_memalign(a, n);
    if (!p)
        return ENOMEM;
    *out = p;
    return 0;
}

static int fail(const char *what, smoe_status st) {
    fprintf(stderr, "%s: %s: %s\n", what, smoe_status_str(st), smoe_last_error());
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 6 && argc != 7) {
        fprintf(stderr, "usage: %s VAULT CACHE_BYTES CHUNK N_PROMPT N_DECODE [KV_DTYPE]\n", argv[0]);
        return 2;
    }
    smoe_vault *v;
    smoe_status st = smoe_open_vault(argv[1], &v);
    if (st)
        return fail("open", st);
    smoe_config cfg = {.struct_size = sizeof cfg};
    smoe_vault_config(v, &cfg);
    smoe_session_params p = smoe_session_default_params();
    p.cache_bytes = strtoull(argv[2], NULL, 10);
    p.chunk = (uint32_t)atoi(argv[3]);
    p.threads = 2;
    if (argc == 7)
        p.kv_dtype = (uint32_t)atoi(argv[6]);
    smoe_session *s;
    atomic_store(&armed, 1); /* session creation allocates: the shim must see libsmoe's calls */
    if ((st = smoe_session_new(v, &p, &s)))
        return fail("session", st);
    atomic_store(&armed, 0);
    long at_creation = atomic_exchange(&calls, 0);
    if (at_creation == 0) {
        fprintf(stderr, "the shim saw no allocation in smoe_session_new: it is not interposed in libsmoe\n");
        return 4;
    }
    int n_prompt = atoi(argv[4]), n_decode = atoi(argv[5]);
    int32_t ids[4096];
    for (int i = 0; i < n_prompt && i < 4096; i++)
        ids[i] = (int32_t)((i * 7919u + 13u) % cfg.vocab_size);

    /* The counter must see an allocation, or a zero below would prove nothing. */
    atomic_store(&armed, 1);
    void *volatile probe = malloc(64); /* volatile: the compiler may not elide the pair */
    free(probe);
    atomic_store(&armed, 0);
    if (atomic_exchange(&calls, 0) != 2) {
        fprintf(stderr, "the allocator shim is not interposed\n");
        return 4;
    }

    atomic_store(&armed, 1);
    for (int start = 0; start < n_prompt; start += (int)p.chunk) {
        int len = n_prompt - start < (int)p.chunk ? n_prompt - start : (int)p.chunk;
        if ((st = smoe_prefill_chunk(s, ids + start, (uint32_t)len, NULL, NULL)))
            return fail("prefill", st);
    }
    int32_t next = 1;
    for (int i = 0; i < n_decode; i++)
        if ((st = smoe_decode_step(s, next, NULL, &next)))
            return fail("decode", st);
    atomic_store(&armed, 0);

    long n = atomic_load(&calls);
    printf("heap calls in smoe_session_new: %ld\nheap calls during prefill + decode: %ld\n", at_creation, n);
    smoe_session_free(s);
    smoe_close_vault(v);
    return n == 0 ? 0 : 3;
}
