/* generate.c — run a prompt through libsmoe from plain C.
 *
 *   smoe_generate VAULT_DIR MAX_TOKENS ID [ID ...]
 *
 * Feeds the prompt ids (layer-major, in chunks; the last id through the token-serial step),
 * then generates MAX_TOKENS ids greedily and prints them, space-separated, on one line.
 * Bad arguments (a negative or non-numeric count or id) exit 2 with the usage; an engine error
 * exits 1 with its message. Links only libsmoe. */
#include "smoe.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

static int fail(const char *what, smoe_status st) {
    fprintf(stderr, "%s: %s: %s\n", what, smoe_status_str(st), smoe_last_error());
    return 1;
}

static int usage(const char *prog, const char *why, const char *arg) {
    fprintf(stderr, "%s: %s: '%s'\nusage: %s VAULT_DIR MAX_TOKENS ID [ID ...]\n", prog, why, arg, prog);
    return 2;
}

/* A whole decimal number in [0, max] (no sign, no trailing text), or -1. */
static long parse_count(const char *s, long max) {
    if (*s < '0' || *s > '9')
        return -1;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    return (*end || errno || v > max) ? -1 : v;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s VAULT_DIR MAX_TOKENS ID [ID ...]\n", argv[0]);
        return 2;
    }
    long max_tokens = parse_count(argv[2], INT32_MAX);
    if (max_tokens < 0)
        return usage(argv[0], "MAX_TOKENS must be a non-negative integer", argv[2]);
    uint32_t n = (uint32_t)(argc - 3);
    for (uint32_t i = 0; i < n; i++)
        if (parse_count(argv[3 + i], INT32_MAX) < 0)
            return usage(argv[0], "token ids are non-negative integers", argv[3 + i]);
    int32_t *ids = malloc(n * sizeof *ids);
    if (!ids)
        return 1;
    for (uint32_t i = 0; i < n; i++)
        ids[i] = (int32_t)parse_count(argv[3 + i], INT32_MAX);

    smoe_vault *vault = NULL;
    smoe_status st = smoe_open_vault(argv[1], &vault);
    if (st != SMOE_OK)
        return fail("smoe_open_vault", st);

    smoe_session_params params = smoe_session_default_params();
    smoe_session *session = NULL;
    if ((st = smoe_session_new(vault, &params, &session)) != SMOE_OK) {
        smoe_close_vault(vault);
        return fail("smoe_session_new", st);
    }

    /* The prompt in layer-major chunks; the last one samples the first new id. */
    int rc = 0;
    int32_t next = -1;
    for (uint32_t start = 0; start < n && rc == 0; start += params.chunk) {
        uint32_t len = n - start < params.chunk ? n - start : params.chunk;
        if ((st = smoe_prefill_chunk(session, ids + start, len, NULL, start + len == n ? &next : NULL)) != SMOE_OK)
            rc = fail("smoe_prefill_chunk", st);
    }
    for (long i = 0; i < max_tokens && rc == 0; i++) {
        printf(i ? " %d" : "%d", next);
        if (i + 1 < max_tokens && (st = smoe_decode_step(session, next, NULL, &next)) != SMOE_OK)
            rc = fail("smoe_decode_step", st);
    }
    printf("\n");

    smoe_session_free(session);
    smoe_close_vault(vault);
    free(ids);
    return rc;
}
