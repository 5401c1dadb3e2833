/*
 * quickstart.c: count words in keyed state through a running statord.
 *
 *   cargo run --release -p statord            # in one terminal
 *   make -C clients/c install PREFIX=$HOME/.local
 *   cc quickstart.c $(pkg-config --cflags --libs stator) -o quickstart
 *   ./quickstart                              # STATOR_SOCKET overrides
 *                                             # ./stator-run/stator.sock
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <stator.h>

#define MAX_PARALLELISM 128

static int fail(const char *what, int32_t rc) {
    fprintf(stderr, "%s: %s (%s)\n", what, stator_strerror(rc), stator_last_error());
    return 1;
}

/* Submits one request (already queued), flushes, and waits for it. */
static int32_t complete_one(stator_session *s, stator_completion *c) {
    int32_t rc = stator_flush(s);
    while (rc == STATOR_OK) {
        int32_t n = stator_reap(s, c, 1);
        if (n == 1) return STATOR_OK;
        rc = n < 0 ? n : stator_wait(s, -1);
    }
    return rc;
}

int main(void) {
    if (stator_abi_version() != STATOR_ABI_VERSION) {
        fprintf(stderr, "libstator ABI %u, stator.h ABI %u\n", stator_abi_version(),
                STATOR_ABI_VERSION);
        return 1;
    }
    const char *sock = getenv("STATOR_SOCKET");
    if (!sock) sock = "./stator-run/stator.sock";

    stator_open_options o;
    stator_open_options_init(&o);
    o.job = "quickstart-job";
    o.operator_name = "word-count";
    o.max_parallelism = MAX_PARALLELISM;
    stator_session *s = NULL;
    int32_t rc = stator_open(sock, &o, &s);
    if (rc != STATOR_OK) return fail("open", rc);
    uint64_t id;
    uint32_t first, last, counts;
    stator_session_id(s, &id);
    stator_session_key_groups(s, &first, &last);
    printf("libstator %s: session %llu owns key groups %u..=%u\n", stator_version(),
           (unsigned long long)id, first, last);
    if ((rc = stator_register(s, "counts", STATOR_KIND_VALUE, &counts)) != STATOR_OK)
        return fail("register", rc);

    const char *words[] = {"stream", "state", "stream"};
    for (int i = 0; i < 3; i++) {
        const uint8_t *w = (const uint8_t *)words[i];
        size_t len = strlen(words[i]);
        int32_t kg = stator_key_group_for_hash(stator_java_string_hash(w, len), MAX_PARALLELISM);
        stator_completion c;
        if ((rc = stator_get(s, counts, (uint32_t)kg, w, len, NULL, 0, 1)) != STATOR_OK ||
            (rc = complete_one(s, &c)) != STATOR_OK)
            return fail("get", rc);
        uint64_t n = 0;
        if (c.status == STATOR_OK && c.value_len == sizeof n) memcpy(&n, c.value, sizeof n);
        else if (c.status != STATOR_NOT_FOUND) return fail("get completion", c.status);
        n++;
        if ((rc = stator_put(s, counts, (uint32_t)kg, w, len, NULL, 0, (const uint8_t *)&n,
                             sizeof n, 2)) != STATOR_OK ||
            (rc = complete_one(s, &c)) != STATOR_OK)
            return fail("put", rc);
        if (c.status != STATOR_OK) return fail("put completion", c.status);
        printf("%s: %llu (key group %d)\n", words[i], (unsigned long long)n, kg);
    }
    rc = stator_close(s);
    stator_free(s);
    return rc == STATOR_OK ? 0 : fail("close", rc);
}
