/*
 * C tests of libstator: every function of stator.h, its success and each
 * of its error paths, against a real statord.
 *
 *   test_stator SOCKET          all tests (exit 0 when every check held)
 *   test_stator SOCKET gone     opens a session, prints "ready", and
 *                               expects the daemon to die under it
 *
 * Built and run by tests/c_abi.rs (plain and under AddressSanitizer).
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <time.h>
#include <unistd.h>

#include "stator.h"

static int failures;
static int checks;
static const char *sock;

#define CHECK(cond)                                                                     \
    do {                                                                                \
        checks++;                                                                       \
        if (!(cond)) {                                                                  \
            failures++;                                                                 \
            fprintf(stderr, "%s:%d: CHECK failed: %s (last error: %s)\n", __FILE__,     \
                    __LINE__, #cond, stator_last_error());                              \
        }                                                                               \
    } while (0)

#define CHECK_RC(call, want)                                                            \
    do {                                                                                \
        int32_t rc_ = (call);                                                           \
        checks++;                                                                       \
        if (rc_ != (want)) {                                                            \
            failures++;                                                                 \
            fprintf(stderr, "%s:%d: %s returned %d (%s), want %d (%s); last error: %s\n", \
                    __FILE__, __LINE__, #call, rc_, stator_strerror(rc_), (int)(want),  \
                    stator_strerror(want), stator_last_error());                        \
        }                                                                               \
    } while (0)

#define OK(call) CHECK_RC(call, STATOR_OK)

static const uint8_t NS[] = "ns";
#define NSL 2

/* Opens a session of `job`/`op` (subtask 0 of 1) with default options.
 * Job names carry the pid, so that runs against one daemon do not meet. */
static stator_session *open_session(const char *job, const char *op, uint32_t sq) {
    stator_open_options o;
    stator_session *s = NULL;
    char name[128];
    snprintf(name, sizeof name, "%s-%ld", job, (long)getpid());
    OK(stator_open_options_init(&o));
    o.job = name;
    o.operator_name = op;
    o.sq_entries = sq;
    o.cq_entries = sq;
    OK(stator_open(sock, &o, &s));
    if (!s) {
        fprintf(stderr, "cannot open a session: %s\n", stator_last_error());
        exit(2);
    }
    return s;
}

/* Flushes and reaps exactly one completion. */
static stator_completion one(stator_session *s) {
    stator_completion c;
    memset(&c, 0, sizeof c);
    OK(stator_flush(s));
    for (int i = 0; i < 1000; i++) {
        int32_t n = stator_reap(s, &c, 1);
        if (n == 1) return c;
        CHECK(n == 0);
        if (n < 0) break;
        int32_t rc = stator_wait(s, 1000);
        CHECK(rc == STATOR_OK || rc == STATOR_E_TIMED_OUT);
    }
    fprintf(stderr, "no completion came\n");
    exit(2);
}

static void test_versions_and_strings(void) {
    CHECK(stator_abi_version() == STATOR_ABI_VERSION);
    CHECK(strlen(stator_version()) > 0);
    const int32_t codes[] = {STATOR_OK, STATOR_NOT_FOUND, STATOR_E_BAD_OPCODE,
                             STATOR_E_BAD_SNAPSHOT, STATOR_E_NULL, STATOR_E_INVALID_ARGUMENT,
                             STATOR_E_CLOSED, STATOR_E_IN_USE, STATOR_E_FULL,
                             STATOR_E_REQUEST_TOO_LARGE, STATOR_E_CONNECT, STATOR_E_REFUSED,
                             STATOR_E_DAEMON_GONE, STATOR_E_PROTOCOL, STATOR_E_TIMED_OUT,
                             STATOR_E_INVALID_STATE, STATOR_E_CALLBACK, STATOR_E_PANIC,
                             STATOR_E_SYSTEM};
    for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++) {
        const char *m = stator_strerror(codes[i]);
        CHECK(m && strlen(m) > 0 && strcmp(m, "unknown status code") != 0);
    }
    for (int32_t c = -19; c <= 1; c++) {
        CHECK(strcmp(stator_strerror(c), "unknown status code") != 0);
    }
    CHECK(strcmp(stator_strerror(12345), "unknown status code") == 0);
    CHECK(strcmp(stator_strerror(-20), "unknown status code") == 0);
    CHECK(stator_last_error() != NULL);
}

static void test_key_groups(void) {
    /* Flink's values (MathUtils.murmurHash, String.hashCode). */
    CHECK(stator_murmur_hash(0) == 593689054);
    CHECK(stator_murmur_hash(42) == 1134849565);
    CHECK(stator_murmur_hash(-1) == 1982413648);
    const char *hello = "hello";
    CHECK(stator_java_string_hash((const uint8_t *)hello, 5) == 99162322);
    CHECK(stator_java_string_hash((const uint8_t *)"stream", 6) == -891990144);
    const char *u = "gr\xc3\xb6\xc3\x9f" "e"; /* "größe" */
    CHECK(stator_java_string_hash((const uint8_t *)u, strlen(u)) == 98762257);
    CHECK(stator_java_string_hash((const uint8_t *)"\xe6\x97\xa5\xe6\x9c\xac", 6) == 835047);
    CHECK(stator_java_string_hash(NULL, 0) == 0);
    CHECK(stator_java_string_hash(NULL, 5) == 0); /* NULL hashes as "" */
    CHECK(strstr(stator_last_error(), "NULL") != NULL);
    CHECK(stator_key_group_for_hash(99162322, 128) == 35);
    CHECK(stator_key_group_for_hash(-891990144, 128) == 127);
    CHECK_RC(stator_key_group_for_hash(1, 0), STATOR_E_INVALID_ARGUMENT);
    CHECK_RC(stator_key_group_for_hash(1, -5), STATOR_E_INVALID_ARGUMENT);
    CHECK_RC(stator_key_group_for_hash(1, 32769), STATOR_E_INVALID_ARGUMENT);
    CHECK(stator_key_group_for_hash(1, 32768) >= 0);

    /* Ranges tile 0..max and invert stator_operator_for_key_group. */
    const int32_t pars[] = {1, 3, 7, 128};
    for (size_t p = 0; p < 4; p++) {
        int32_t next = 0;
        for (int32_t i = 0; i < pars[p]; i++) {
            int32_t first = -1, last = -1;
            OK(stator_key_group_range(128, pars[p], i, &first, &last));
            CHECK(first == next && last >= first);
            for (int32_t kg = first; kg <= last; kg++) {
                CHECK(stator_operator_for_key_group(128, pars[p], kg) == i);
            }
            next = last + 1;
        }
        CHECK(next == 128);
    }
    int32_t f = 7, l = 7;
    CHECK_RC(stator_key_group_range(128, 3, 1, NULL, &l), STATOR_E_NULL);
    CHECK_RC(stator_key_group_range(128, 3, 1, &f, NULL), STATOR_E_NULL);
    CHECK_RC(stator_key_group_range(0, 1, 0, &f, &l), STATOR_E_INVALID_ARGUMENT);
    CHECK_RC(stator_key_group_range(128, 0, 0, &f, &l), STATOR_E_INVALID_ARGUMENT);
    CHECK_RC(stator_key_group_range(128, 129, 0, &f, &l), STATOR_E_INVALID_ARGUMENT);
    CHECK_RC(stator_key_group_range(128, 3, 3, &f, &l), STATOR_E_INVALID_ARGUMENT);
    CHECK_RC(stator_key_group_range(128, 3, -1, &f, &l), STATOR_E_INVALID_ARGUMENT);
    CHECK(f == 7 && l == 7); /* nothing written on an error */
    CHECK_RC(stator_operator_for_key_group(128, 3, 128), STATOR_E_INVALID_ARGUMENT);
    CHECK_RC(stator_operator_for_key_group(128, 3, -1), STATOR_E_INVALID_ARGUMENT);
    CHECK_RC(stator_operator_for_key_group(128, 0, 5), STATOR_E_INVALID_ARGUMENT);
    CHECK_RC(stator_operator_for_key_group(40000, 3, 5), STATOR_E_INVALID_ARGUMENT);
}

static void test_decoders(void) {
    /* Two elements: "ab", "" ; then a truncated one. */
    const uint8_t buf[] = {2, 0, 0, 0, 'a', 'b', 0, 0, 0, 0, 9, 0, 0, 0, 'x'};
    size_t pos = 0;
    stator_bytes e;
    CHECK_RC(stator_elements_next(buf, 10, &pos, &e), 1);
    CHECK(e.len == 2 && memcmp(e.data, "ab", 2) == 0 && pos == 6);
    CHECK_RC(stator_elements_next(buf, 10, &pos, &e), 1);
    CHECK(e.len == 0 && pos == 10);
    CHECK_RC(stator_elements_next(buf, 10, &pos, &e), 0);
    pos = 10;
    CHECK_RC(stator_elements_next(buf, sizeof buf, &pos, &e), STATOR_E_INVALID_ARGUMENT);
    pos = 10;
    CHECK_RC(stator_elements_next(buf, 12, &pos, &e), STATOR_E_INVALID_ARGUMENT);
    pos = 99;
    CHECK_RC(stator_elements_next(buf, 10, &pos, &e), STATOR_E_INVALID_ARGUMENT);
    pos = 0;
    CHECK_RC(stator_elements_next(NULL, 0, &pos, &e), 0);
    CHECK_RC(stator_elements_next(NULL, 4, &pos, &e), STATOR_E_NULL);
    CHECK_RC(stator_elements_next(buf, 10, NULL, &e), STATOR_E_NULL);
    CHECK_RC(stator_elements_next(buf, 10, &pos, NULL), STATOR_E_NULL);

    /* A page: one entry "k", cursor "k", cursor length 1. */
    const uint8_t page[] = {1, 0, 0, 0, 'k', 'k', 1, 0, 0, 0};
    stator_bytes entries, after;
    OK(stator_page_split(page, sizeof page, &entries, &after));
    CHECK(entries.len == 5 && entries.data == page);
    CHECK(after.len == 1 && after.data[0] == 'k');
    const uint8_t bad[] = {9, 0, 0, 0};
    CHECK_RC(stator_page_split(bad, sizeof bad, &entries, &after), STATOR_E_INVALID_ARGUMENT);
    CHECK_RC(stator_page_split(page, 3, &entries, &after), STATOR_E_INVALID_ARGUMENT);
    CHECK_RC(stator_page_split(page, sizeof page, NULL, &after), STATOR_E_NULL);
    CHECK_RC(stator_page_split(page, sizeof page, &entries, NULL), STATOR_E_NULL);
}

static void test_open_errors(void) {
    stator_open_options o;
    stator_session *s = NULL;
    CHECK_RC(stator_open_options_init(NULL), STATOR_E_NULL);
    OK(stator_open_options_init(&o));
    CHECK(o.size == sizeof o && o.parallelism == 1 && o.max_parallelism == 128 && !o.job);
    o.job = "c-tests";
    o.operator_name = "open";
    CHECK_RC(stator_open(NULL, &o, &s), STATOR_E_NULL);
    CHECK_RC(stator_open(sock, NULL, &s), STATOR_E_NULL);
    CHECK_RC(stator_open(sock, &o, NULL), STATOR_E_NULL);
    CHECK_RC(stator_open("/nonexistent/stator.sock", &o, &s), STATOR_E_CONNECT);
    CHECK(strstr(stator_last_error(), "/nonexistent/stator.sock") != NULL);
    CHECK(s == NULL);

    stator_open_options bad = o;
    bad.size = 0; /* not initialized */
    CHECK_RC(stator_open(sock, &bad, &s), STATOR_E_INVALID_ARGUMENT);
    bad = o;
    bad.job = NULL;
    CHECK_RC(stator_open(sock, &bad, &s), STATOR_E_NULL);
    bad = o;
    bad.operator_name = "\xff\xfe";
    CHECK_RC(stator_open(sock, &bad, &s), STATOR_E_INVALID_ARGUMENT);
    bad = o;
    bad.reserved = 1;
    CHECK_RC(stator_open(sock, &bad, &s), STATOR_E_INVALID_ARGUMENT);
    bad = o;
    bad.subtask = 5; /* of parallelism 1 */
    CHECK_RC(stator_open(sock, &bad, &s), STATOR_E_REFUSED);
    CHECK(strlen(stator_last_error()) > 0);
    CHECK(s == NULL);

    /* A newer header's bigger struct: unknown fields must be zero. */
    struct {
        stator_open_options o;
        uint64_t newer_field;
    } big;
    memset(&big, 0, sizeof big);
    big.o = o;
    big.o.size = sizeof big;
    big.newer_field = 1;
    CHECK_RC(stator_open(sock, &big.o, &s), STATOR_E_INVALID_ARGUMENT);
    big.newer_field = 0;
    OK(stator_open(sock, &big.o, &s));
    CHECK(s != NULL);
    OK(stator_free(s));
}

static void test_null_and_bad_handles(void) {
    uint64_t id;
    stator_completion c;
    CHECK_RC(stator_close(NULL), STATOR_E_NULL);
    OK(stator_free(NULL));
    CHECK_RC(stator_session_id(NULL, &id), STATOR_E_NULL);
    CHECK_RC(stator_in_flight(NULL), STATOR_E_NULL);
    CHECK_RC(stator_get(NULL, 0, 0, (const uint8_t *)"k", 1, NULL, 0, 1), STATOR_E_NULL);
    CHECK_RC(stator_reap(NULL, &c, 1), STATOR_E_NULL);
    CHECK_RC(stator_wait(NULL, 0), STATOR_E_NULL);
    CHECK_RC(stator_flush(NULL), STATOR_E_NULL);
    CHECK_RC(stator_event_fd(NULL), STATOR_E_NULL);
    CHECK_RC(stator_chunk_slots(NULL), STATOR_E_NULL);
    /* Something that is not a session (aligned, readable): refused. */
    static uint64_t junk[16];
    CHECK_RC(stator_flush((stator_session *)junk), STATOR_E_INVALID_ARGUMENT);
    CHECK_RC(stator_free((stator_session *)junk), STATOR_E_INVALID_ARGUMENT);
}

static void test_session_basics(void) {
    stator_session *s = open_session("c-tests", "basics", 0);
    uint64_t id = 0;
    uint32_t first = 99, last = 99, st = 0, st2 = 0, lst = 0, mst = 0;
    OK(stator_session_id(s, &id));
    CHECK(id > 0);
    CHECK_RC(stator_session_id(s, NULL), STATOR_E_NULL);
    OK(stator_session_key_groups(s, &first, &last));
    CHECK(first == 0 && last == 127);
    CHECK_RC(stator_session_key_groups(s, NULL, &last), STATOR_E_NULL);
    CHECK_RC(stator_session_key_groups(s, &first, NULL), STATOR_E_NULL);
    CHECK(stator_in_flight(s) == 0);
    CHECK(stator_chunk_slots(s) > 0);
    uint64_t words[2];
    CHECK_RC(stator_session_id(s, (uint64_t *)((char *)words + 1)), STATOR_E_INVALID_ARGUMENT);
    CHECK_RC(stator_session_id((stator_session *)((char *)s + 1), &id), STATOR_E_INVALID_ARGUMENT);
    stator_completion cbuf[2];
    CHECK_RC(stator_reap(s, (stator_completion *)((char *)cbuf + 4), 1), STATOR_E_INVALID_ARGUMENT);

    OK(stator_register(s, "counts", STATOR_KIND_VALUE, &st));
    OK(stator_register(s, "counts", STATOR_KIND_VALUE, &st2));
    CHECK(st == st2);
    OK(stator_register(s, "events", STATOR_KIND_LIST, &lst));
    OK(stator_register(s, "attrs", STATOR_KIND_MAP, &mst));
    CHECK(lst != st && mst != st && mst != lst);
    CHECK_RC(stator_register(s, "counts", STATOR_KIND_MAP, &st2), STATOR_E_REFUSED);
    CHECK_RC(stator_register(s, "x", 7, &st2), STATOR_E_INVALID_ARGUMENT);
    CHECK_RC(stator_register(s, NULL, STATOR_KIND_VALUE, &st2), STATOR_E_NULL);
    CHECK_RC(stator_register(s, "x", STATOR_KIND_VALUE, NULL), STATOR_E_NULL);
    CHECK_RC(stator_register(s, "\xc3\x28", STATOR_KIND_VALUE, &st2), STATOR_E_INVALID_ARGUMENT);

    /* Value state. */
    const uint8_t k[] = "key-1";
    OK(stator_put(s, st, 5, k, 5, NS, NSL, (const uint8_t *)"hello", 5, 1));
    stator_completion c = one(s);
    CHECK(c.user_data == 1 && c.status == STATOR_OK && c.slot == STATOR_NO_SLOT);
    OK(stator_get(s, st, 5, k, 5, NS, NSL, 2));
    c = one(s);
    CHECK(c.user_data == 2 && c.status == STATOR_OK && c.value_len == 5);
    CHECK(c.value && memcmp(c.value, "hello", 5) == 0 && c.len == 5);
    OK(stator_get(s, st, 5, k, 5, NULL, 0, 3)); /* another namespace */
    c = one(s);
    CHECK(c.status == STATOR_NOT_FOUND && c.value == NULL && c.value_len == 0);
    OK(stator_delete(s, st, 5, k, 5, NS, NSL, 4));
    CHECK(one(s).status == STATOR_OK);
    OK(stator_get(s, st, 5, k, 5, NS, NSL, 5));
    CHECK(one(s).status == STATOR_NOT_FOUND);
    /* What the daemon refuses comes back in the completion. */
    OK(stator_get(s, 999, 5, k, 5, NS, NSL, 6));
    CHECK(one(s).status == STATOR_E_BAD_STATE);
    OK(stator_get(s, mst, 5, k, 5, NS, NSL, 7)); /* wrong kind */
    CHECK(one(s).status == STATOR_E_BAD_STATE);
    OK(stator_get(s, st, 128, k, 5, NS, NSL, 8)); /* outside 0..=127 */
    CHECK(one(s).status == STATOR_E_BAD_KEY_GROUP);
    /* What the library refuses never reaches the queue. */
    CHECK_RC(stator_get(s, st, 70000, k, 5, NS, NSL, 9), STATOR_E_INVALID_ARGUMENT);
    CHECK_RC(stator_get(s, st, 5, NULL, 5, NS, NSL, 9), STATOR_E_NULL);
    CHECK_RC(stator_put(s, st, 5, k, 5, NS, NSL, NULL, 3, 9), STATOR_E_NULL);
    CHECK_RC(stator_get(s, st, 5, k, 5, NULL, 2, 9), STATOR_E_NULL);
    CHECK_RC(stator_get(s, st, 5, k, (size_t)-1, NS, NSL, 9), STATOR_E_INVALID_ARGUMENT);
    CHECK(stator_in_flight(s) == 0);

    /* List state. */
    OK(stator_list_append(s, lst, 9, k, 5, NS, NSL, (const uint8_t *)"a", 1, 10));
    OK(stator_list_append(s, lst, 9, k, 5, NS, NSL, (const uint8_t *)"bcd", 3, 11));
    CHECK(one(s).status == STATOR_OK);
    CHECK(one(s).status == STATOR_OK);
    OK(stator_list_get(s, lst, 9, k, 5, NS, NSL, 12));
    c = one(s);
    CHECK(c.status == STATOR_OK);
    size_t pos = 0;
    stator_bytes e;
    CHECK_RC(stator_elements_next(c.value, c.value_len, &pos, &e), 1);
    CHECK(e.len == 1 && e.data[0] == 'a');
    CHECK_RC(stator_elements_next(c.value, c.value_len, &pos, &e), 1);
    CHECK(e.len == 3 && memcmp(e.data, "bcd", 3) == 0);
    CHECK_RC(stator_elements_next(c.value, c.value_len, &pos, &e), 0);
    const uint8_t enc[] = {2, 0, 0, 0, 'x', 'y'};
    OK(stator_list_replace(s, lst, 9, k, 5, NS, NSL, enc, sizeof enc, 13));
    CHECK(one(s).status == STATOR_OK);
    OK(stator_list_get(s, lst, 9, k, 5, NS, NSL, 14));
    c = one(s);
    CHECK(c.status == STATOR_OK && c.value_len == sizeof enc && memcmp(c.value, enc, 6) == 0);
    OK(stator_clear(s, lst, 9, k, 5, NS, NSL, 15));
    CHECK(one(s).status == STATOR_OK);
    OK(stator_list_get(s, lst, 9, k, 5, NS, NSL, 16));
    CHECK(one(s).status == STATOR_NOT_FOUND);

    /* Map state, with paged iteration. */
    char uk[32], val[64];
    for (int i = 0; i < 100; i++) {
        snprintf(uk, sizeof uk, "user-%03d", i);
        snprintf(val, sizeof val, "value-%03d-padding-padding-padding", i);
        OK(stator_map_put(s, mst, 3, k, 5, NS, NSL, (const uint8_t *)uk, strlen(uk),
                          (const uint8_t *)val, strlen(val), 100 + i));
    }
    stator_completion cs[128];
    OK(stator_flush(s));
    int got = 0;
    while (got < 100) {
        int32_t n = stator_reap(s, cs, 128);
        CHECK(n >= 0);
        for (int i = 0; i < n; i++) CHECK(cs[i].status == STATOR_OK);
        got += n;
        if (n == 0) OK(stator_wait(s, 5000));
    }
    OK(stator_map_get(s, mst, 3, k, 5, NS, NSL, (const uint8_t *)"user-042", 8, 1));
    c = one(s);
    CHECK(c.status == STATOR_OK && c.value_len == strlen("value-042-padding-padding-padding"));
    OK(stator_map_contains(s, mst, 3, k, 5, NS, NSL, (const uint8_t *)"user-042", 8, 2));
    c = one(s);
    CHECK(c.status == STATOR_OK && c.aux == 1);
    OK(stator_map_remove(s, mst, 3, k, 5, NS, NSL, (const uint8_t *)"user-042", 8, 3));
    CHECK(one(s).status == STATOR_OK);
    OK(stator_map_contains(s, mst, 3, k, 5, NS, NSL, (const uint8_t *)"user-042", 8, 4));
    CHECK(one(s).aux == 0);
    CHECK_RC(stator_map_get(s, mst, 3, k, 5, NS, NSL, NULL, 8, 5), STATOR_E_NULL);

    /* Iterate all entries page by page (a 1 KiB page holds ~15). */
    int seen = 0, pages = 0;
    uint8_t cursor[64];
    size_t cursor_len = 0;
    int more = 1, resume = 0;
    while (more) {
        OK(stator_map_iter(s, mst, 3, k, 5, NS, NSL, STATOR_ITER_ENTRIES,
                           resume ? cursor : NULL, cursor_len, 7));
        c = one(s);
        CHECK(c.status == STATOR_OK);
        if (c.status != STATOR_OK) break;
        pages++;
        stator_bytes entries, after;
        OK(stator_page_split(c.value, c.value_len, &entries, &after));
        size_t p = 0;
        stator_bytes key, value;
        uint64_t in_page = 0;
        while (stator_elements_next(entries.data, entries.len, &p, &key) == 1) {
            CHECK_RC(stator_elements_next(entries.data, entries.len, &p, &value), 1);
            CHECK(key.len == 8 && memcmp(key.data, "user-", 5) == 0);
            CHECK(memcmp(key.data, "user-042", 8) != 0);
            in_page++;
        }
        CHECK(in_page == c.aux);
        seen += (int)in_page;
        more = (c.flags & STATOR_CQE_MORE) != 0;
        CHECK(after.len <= sizeof cursor);
        memcpy(cursor, after.data, after.len);
        cursor_len = after.len;
        resume = 1;
    }
    CHECK(seen == 99 && pages > 1);
    OK(stator_map_iter(s, mst, 3, k, 5, NS, NSL, STATOR_ITER_KEYS, NULL, 0, 8));
    CHECK(one(s).status == STATOR_OK);
    OK(stator_map_iter(s, mst, 3, k, 5, NS, NSL, STATOR_ITER_VALUES, NULL, 0, 9));
    CHECK(one(s).status == STATOR_OK);
    CHECK_RC(stator_map_iter(s, mst, 3, k, 5, NS, NSL, 0, NULL, 0, 9), STATOR_E_INVALID_ARGUMENT);
    CHECK_RC(stator_map_iter(s, mst, 3, k, 5, NS, NSL, 4, NULL, 0, 9), STATOR_E_INVALID_ARGUMENT);
    OK(stator_free(s));
}

static void test_generic_submit(void) {
    stator_session *s = open_session("c-tests", "generic", 0);
    uint32_t st;
    OK(stator_register(s, "v", STATOR_KIND_VALUE, &st));
    stator_request r;
    memset(&r, 0, sizeof r);
    r.opcode = STATOR_OP_NOP;
    r.arg = 0xfeed;
    OK(stator_submit(s, &r, 77));
    stator_completion c = one(s);
    CHECK(c.user_data == 77 && c.status == STATOR_OK && c.aux == 0xfeed);

    uint8_t big[300];
    memset(big, 'v', sizeof big);
    memset(&r, 0, sizeof r);
    r.opcode = STATOR_OP_PUT;
    r.state = st;
    r.key_group = 1;
    r.key = (stator_bytes){(const uint8_t *)"k", 1};
    r.value = (stator_bytes){big, sizeof big};
    OK(stator_submit(s, &r, 1));
    CHECK(one(s).status == STATOR_OK);
    /* A result buffer too small: the completion says how big. */
    r.opcode = STATOR_OP_GET;
    r.value = (stator_bytes){NULL, 0};
    r.capacity = 16;
    OK(stator_submit(s, &r, 2));
    c = one(s);
    CHECK(c.status == STATOR_E_RESULT_TOO_LARGE && c.len == sizeof big && c.value == NULL);
    r.capacity = c.len;
    OK(stator_submit(s, &r, 3));
    c = one(s);
    CHECK(c.status == STATOR_OK && c.value_len == sizeof big && memcmp(c.value, big, sizeof big) == 0);

    CHECK_RC(stator_submit(s, NULL, 4), STATOR_E_NULL);
    r.opcode = 99;
    CHECK_RC(stator_submit(s, &r, 4), STATOR_E_INVALID_ARGUMENT);
    r.opcode = 1000;
    CHECK_RC(stator_submit(s, &r, 4), STATOR_E_INVALID_ARGUMENT);
    r.opcode = STATOR_OP_GET;
    r.flags = 0x100;
    CHECK_RC(stator_submit(s, &r, 4), STATOR_E_INVALID_ARGUMENT);
    r.flags = 0x80; /* a byte, but not a flag the daemon knows */
    OK(stator_submit(s, &r, 4));
    CHECK(one(s).status == STATOR_E_BAD_FLAGS);
    r.flags = 0;
    r.key_group = 65536;
    CHECK_RC(stator_submit(s, &r, 4), STATOR_E_INVALID_ARGUMENT);
    r.key_group = 1;
    r.user_key = (stator_bytes){NULL, 1};
    CHECK_RC(stator_submit(s, &r, 4), STATOR_E_NULL);
    r.user_key = (stator_bytes){(const uint8_t *)"u", 1}; /* a get takes none */
    OK(stator_submit(s, &r, 4));
    CHECK(one(s).status == STATOR_E_BAD_RANGE);
    /* Larger than the whole arena: never fits, so not "full". */
    r.user_key = (stator_bytes){NULL, 0};
    r.capacity = 0x7fffffff;
    CHECK_RC(stator_submit(s, &r, 4), STATOR_E_REQUEST_TOO_LARGE);
    CHECK(stator_in_flight(s) == 0);
    OK(stator_free(s));
}

static void test_batches_full_and_wait(void) {
    /* A small queue: submits fail with FULL until completions are reaped. */
    stator_session *s = open_session("c-tests", "batches", 64);
    uint32_t st;
    OK(stator_register(s, "v", STATOR_KIND_VALUE, &st));
    stator_completion cs[16];
    CHECK_RC(stator_reap(s, NULL, 4), STATOR_E_NULL);
    CHECK_RC(stator_reap(s, cs, 0), 0);
    CHECK_RC(stator_reap(s, NULL, 0), 0);
    CHECK_RC(stator_wait(s, 0), STATOR_E_TIMED_OUT);
    CHECK_RC(stator_wait(s, 20), STATOR_E_TIMED_OUT);

    int submitted = 0, full = 0, done = 0;
    uint64_t sum = 0;
    while (done < 1000) {
        while (submitted < 1000) {
            uint64_t key = (uint64_t)submitted;
            int32_t rc = stator_put(s, st, (uint32_t)(submitted % 128), (const uint8_t *)&key, 8,
                                    NULL, 0, (const uint8_t *)&key, 8, (uint64_t)submitted);
            if (rc == STATOR_E_FULL) {
                full++;
                break;
            }
            CHECK_RC(rc, STATOR_OK);
            if (rc != STATOR_OK) return;
            submitted++;
        }
        OK(stator_flush(s));
        int32_t n = stator_reap(s, cs, 16);
        CHECK(n >= 0 && n <= 16);
        for (int i = 0; i < n; i++) {
            CHECK(cs[i].status == STATOR_OK);
            sum += cs[i].user_data;
        }
        done += n;
        if (n == 0) {
            int32_t rc = stator_wait(s, 2000);
            CHECK(rc == STATOR_OK);
        }
    }
    CHECK(full > 0);
    CHECK(sum == 999u * 1000u / 2u);

    /* Read them back: each value equals its key. Results of one reap all
     * stay valid until the next. */
    for (uint64_t key = 0; key < 16; key++) {
        OK(stator_get(s, st, (uint32_t)(key % 128), (const uint8_t *)&key, 8, NULL, 0, key));
    }
    OK(stator_flush(s));
    int have = 0;
    stator_completion all[16];
    while (have < 16) {
        int32_t n = stator_reap(s, all + have, (size_t)(16 - have));
        if (n == 0) {
            OK(stator_wait(s, 2000));
            continue;
        }
        CHECK(n > 0);
        if (n < 0) break;
        for (int i = have; i < have + n; i++) {
            CHECK(all[i].status == STATOR_OK && all[i].value_len == 8 &&
                  memcmp(all[i].value, &all[i].user_data, 8) == 0);
        }
        have += n;
    }
    OK(stator_free(s));
}

static void test_event_fd(void) {
    stator_session *s = open_session("c-tests", "events", 0);
    uint32_t st;
    OK(stator_register(s, "v", STATOR_KIND_VALUE, &st));
    int fd = stator_event_fd(s);
    CHECK(fd >= 0);
    CHECK(stator_event_fd(s) == fd); /* the same fd each time */
    int ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = 42};
    CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) == 0);

    /* Nothing in flight: armed, and the fd stays quiet. */
    CHECK_RC(stator_arm(s), 0);
    struct epoll_event out;
    CHECK(epoll_wait(ep, &out, 1, 50) == 0);
    OK(stator_disarm(s));
    OK(stator_disarm(s)); /* disarming twice is harmless */

    /* 1,000 requests through the caller's own loop. */
    int done = 0, next = 0, sleeps = 0;
    stator_completion cs[64];
    while (done < 1000) {
        while (next < 1000) {
            uint64_t key = (uint64_t)next;
            int32_t rc = stator_put(s, st, 1, (const uint8_t *)&key, 8, NULL, 0,
                                    (const uint8_t *)"x", 1, key);
            if (rc == STATOR_E_FULL) break;
            CHECK_RC(rc, STATOR_OK);
            next++;
        }
        OK(stator_flush(s));
        int32_t armed = stator_arm(s);
        CHECK(armed == 0 || armed == 1);
        if (armed == 0) {
            int n = epoll_wait(ep, &out, 1, 5000);
            CHECK(n == 1 && out.data.u64 == 42);
            sleeps++;
        }
        int32_t n = stator_reap(s, cs, 64); /* disarms */
        CHECK(n >= 0);
        for (int i = 0; i < n; i++) CHECK(cs[i].status == STATOR_OK);
        done += n > 0 ? n : 0;
    }
    /* Armed and woken by a completion. */
    OK(stator_get(s, st, 1, (const uint8_t *)"nokey", 5, NULL, 0, 5));
    CHECK_RC(stator_arm(s), 0); /* not flushed yet: nothing can be ready */
    OK(stator_flush(s));
    CHECK(epoll_wait(ep, &out, 1, 5000) == 1);
    CHECK_RC(stator_reap(s, cs, 64), 1);
    CHECK(cs[0].status == STATOR_NOT_FOUND && cs[0].user_data == 5);
    close(ep);
    OK(stator_free(s));
}

static void test_reservations(void) {
    stator_session *s = open_session("c-tests", "reserve", 0);
    uint32_t st, mst;
    OK(stator_register(s, "v", STATOR_KIND_VALUE, &st));
    OK(stator_register(s, "m", STATOR_KIND_MAP, &mst));
    stator_value_buffer b;
    OK(stator_value_reserve(s, 1000, &b));
    CHECK(b.data != NULL && b.capacity >= 1000);
    for (uint32_t i = 0; i < 1000; i++) b.data[i] = (uint8_t)(i * 7);
    stator_request r;
    memset(&r, 0, sizeof r);
    r.opcode = STATOR_OP_PUT;
    r.state = st;
    r.key_group = 4;
    r.key = (stator_bytes){(const uint8_t *)"zc", 2};
    r.value = (stator_bytes){(const uint8_t *)"ignored", 7};
    CHECK_RC(stator_submit_reserved(s, &r, b.id, b.capacity + 1, 1), STATOR_E_INVALID_ARGUMENT);
    CHECK_RC(stator_submit_reserved(s, &r, b.id + 1000, 10, 1), STATOR_E_INVALID_ARGUMENT);
    CHECK_RC(stator_submit_reserved(s, NULL, b.id, 10, 1), STATOR_E_NULL);
    r.opcode = STATOR_OP_GET;
    CHECK_RC(stator_submit_reserved(s, &r, b.id, 10, 1), STATOR_E_INVALID_ARGUMENT);
    r.opcode = STATOR_OP_PUT;
    OK(stator_submit_reserved(s, &r, b.id, 1000, 1));
    CHECK(one(s).status == STATOR_OK);
    /* The buffer is the request's now: its id is no longer reserved. */
    CHECK_RC(stator_value_release(s, b.id), STATOR_E_INVALID_ARGUMENT);
    r.opcode = STATOR_OP_GET;
    r.value = (stator_bytes){NULL, 0};
    r.capacity = 1000;
    OK(stator_submit(s, &r, 2));
    stator_completion c = one(s);
    CHECK(c.status == STATOR_OK && c.value_len == 1000);
    int same = 1;
    for (uint32_t i = 0; i < 1000 && c.value; i++) same &= c.value[i] == (uint8_t)(i * 7);
    CHECK(same);

    /* A map put from a reservation; a zero-length value. */
    stator_value_buffer m;
    OK(stator_value_reserve(s, 16, &m));
    memcpy(m.data, "mapval", 6);
    memset(&r, 0, sizeof r);
    r.opcode = STATOR_OP_MAP_PUT;
    r.state = mst;
    r.key_group = 4;
    r.key = (stator_bytes){(const uint8_t *)"zc", 2};
    r.user_key = (stator_bytes){(const uint8_t *)"u", 1};
    OK(stator_submit_reserved(s, &r, m.id, 6, 3));
    CHECK(one(s).status == STATOR_OK);
    OK(stator_map_get(s, mst, 4, (const uint8_t *)"zc", 2, NULL, 0, (const uint8_t *)"u", 1, 4));
    c = one(s);
    CHECK(c.status == STATOR_OK && c.value_len == 6 && memcmp(c.value, "mapval", 6) == 0);

    /* A full queue leaves the reservation the caller's; `value` is never
     * read (even a wild pointer). */
    stator_session *small = open_session("c-tests", "reserve-full", 64);
    uint32_t sst;
    OK(stator_register(small, "v", STATOR_KIND_VALUE, &sst));
    stator_value_buffer fb;
    OK(stator_value_reserve(small, 8, &fb));
    memcpy(fb.data, "retained", 8);
    stator_request nop;
    memset(&nop, 0, sizeof nop);
    nop.opcode = STATOR_OP_NOP;
    int queued = 0;
    while (stator_submit(small, &nop, 1000) == STATOR_OK) queued++;
    CHECK(queued > 0);
    memset(&r, 0, sizeof r);
    r.opcode = STATOR_OP_PUT;
    r.state = sst;
    r.key = (stator_bytes){(const uint8_t *)"fk", 2};
    r.value = (stator_bytes){(const uint8_t *)(uintptr_t)8, 1 << 20};
    CHECK_RC(stator_submit_reserved(small, &r, fb.id, 8, 7), STATOR_E_FULL);
    stator_completion drain[64];
    int reaped = 0;
    OK(stator_flush(small));
    while (reaped < queued) {
        int32_t got = stator_reap(small, drain, 64);
        CHECK(got >= 0);
        if (got <= 0) OK(stator_wait(small, 2000));
        else reaped += got;
    }
    OK(stator_submit_reserved(small, &r, fb.id, 8, 7));
    CHECK(one(small).status == STATOR_OK);
    OK(stator_get(small, sst, 0, (const uint8_t *)"fk", 2, NULL, 0, 8));
    c = one(small);
    CHECK(c.status == STATOR_OK && c.value_len == 8 && memcmp(c.value, "retained", 8) == 0);
    OK(stator_free(small));

    /* Release, double release, NULL out, too large, and FULL. */
    OK(stator_value_reserve(s, 64, &b));
    OK(stator_value_release(s, b.id));
    CHECK_RC(stator_value_release(s, b.id), STATOR_E_INVALID_ARGUMENT);
    CHECK_RC(stator_value_reserve(s, 64, NULL), STATOR_E_NULL);
    CHECK_RC(stator_value_reserve(s, 0xffffffffu, &b), STATOR_E_REQUEST_TOO_LARGE);
    uint32_t ids[4096];
    int n = 0;
    int32_t rc = STATOR_OK;
    while (n < 4096 && (rc = stator_value_reserve(s, 1 << 20, &b)) == STATOR_OK) ids[n++] = b.id;
    CHECK_RC(rc, STATOR_E_FULL);
    CHECK(n > 0);
    for (int i = 0; i < n; i++) OK(stator_value_release(s, ids[i]));
    OK(stator_value_reserve(s, 1 << 20, &b)); /* room again */
    OK(stator_free(s)); /* frees a reservation still held */
}

/* Export sink: keeps every chunk. */
struct chunks {
    uint8_t *data[64];
    size_t len[64];
    uint32_t n;
    int fail_at; /* return an error at this chunk (-1: never) */
    uint32_t next; /* source position */
};

static int32_t keep_chunk(void *ctx, const uint8_t *chunk, size_t len) {
    struct chunks *c = ctx;
    if ((int)c->n == c->fail_at || c->n == 64) return -1;
    c->data[c->n] = malloc(len);
    memcpy(c->data[c->n], chunk, len);
    c->len[c->n++] = len;
    return 0;
}

static int32_t give_chunk(void *ctx, uint8_t *slot, size_t cap, size_t *len) {
    struct chunks *c = ctx;
    if ((int)c->next == c->fail_at) return -5;
    if (c->next == c->n) return 0;
    if (c->len[c->next] > cap) return -6;
    memcpy(slot, c->data[c->next], c->len[c->next]);
    *len = c->len[c->next++];
    return 1;
}

static int32_t lying_source(void *ctx, uint8_t *slot, size_t cap, size_t *len) {
    (void)ctx;
    (void)slot;
    *len = cap + 1;
    return 1;
}

static void free_chunks(struct chunks *c) {
    for (uint32_t i = 0; i < c->n; i++) free(c->data[i]);
    c->n = 0;
}

/* Counts the values of state `st` over keys 0..n-1 that hold their key. */
static int count_values(stator_session *s, uint32_t st, int n) {
    int found = 0;
    for (int i = 0; i < n; i++) {
        uint64_t key = (uint64_t)i;
        OK(stator_get(s, st, (uint32_t)(i % 128), (const uint8_t *)&key, 8, NS, NSL, key));
        stator_completion c = one(s);
        if (c.status == STATOR_OK && c.value_len == 8 && memcmp(c.value, &key, 8) == 0) found++;
    }
    return found;
}

static void test_checkpoints_and_snapshots(void) {
    stator_session *s = open_session("c-tests-ckpt", "op", 0);
    uint32_t st;
    OK(stator_register(s, "v", STATOR_KIND_VALUE, &st));
    for (int i = 0; i < 500; i++) {
        uint64_t key = (uint64_t)i;
        OK(stator_put(s, st, (uint32_t)(i % 128), (const uint8_t *)&key, 8, NS, NSL,
                      (const uint8_t *)&key, 8, key));
        CHECK(one(s).status == STATOR_OK);
    }
    /* A checkpoint: its handle comes back as the completion's value. */
    OK(stator_checkpoint(s, 1, 1001));
    stator_completion c = one(s);
    CHECK(c.user_data == 1001 && c.status == STATOR_OK && c.value_len > 0);
    uint8_t handle[256];
    size_t handle_len = c.value_len;
    memcpy(handle, c.value, handle_len);
    OK(stator_checkpoint_notify(s, 1, STATOR_NOTIFY_COMPLETE, 1002));
    CHECK(one(s).status == STATOR_OK);
    CHECK_RC(stator_checkpoint_notify(s, 1, 9, 1003), STATOR_E_INVALID_ARGUMENT);

    /* Portable export through the helper, into memory. */
    struct chunks ex = {.fail_at = -1};
    uint32_t nchunks = 0;
    OK(stator_export_snapshot(s, 7, keep_chunk, &ex, &nchunks));
    CHECK(nchunks == ex.n && ex.n >= 1);
    CHECK_RC(stator_export_snapshot(s, 8, NULL, &ex, NULL), STATOR_E_NULL);
    struct chunks failing = {.fail_at = 0};
    CHECK_RC(stator_export_snapshot(s, 9, keep_chunk, &failing, NULL), STATOR_E_CALLBACK);
    CHECK(stator_in_flight(s) == 0);

    /* The low-level stream: export, read each chunk in place, release. */
    CHECK(stator_chunk_slots(s) >= 1);
    OK(stator_snapshot_export(s, 10, 1));
    CHECK(one(s).status == STATOR_OK);
    OK(stator_chunk_release(s, 10, 0, 2));
    CHECK_RC(stator_chunk_release(s, 10, 0, 3), STATOR_E_INVALID_STATE); /* held */
    uint8_t *slot = NULL;
    CHECK_RC(stator_chunk_slot(s, 0, &slot), STATOR_E_INVALID_STATE);
    CHECK_RC(stator_chunk_release(s, 10, 1000, 3), STATOR_E_INVALID_ARGUMENT);
    CHECK_RC(stator_chunk_release(s, 10, STATOR_NO_SLOT, 3), STATOR_E_INVALID_ARGUMENT);
    c = one(s);
    CHECK(c.status == STATOR_OK && c.slot == 0 && c.aux == 0 && c.value != NULL);
    CHECK((c.flags & STATOR_CQE_LAST) != 0 && ex.n == 1);
    CHECK(c.value_len == ex.len[0]); /* the same state, another snapshot id */
    OK(stator_chunk_slot(s, 0, &slot));
    CHECK(slot == c.value);
    OK(stator_chunk_release(s, 10, 0, 4)); /* after the last: NOT_FOUND */
    CHECK(one(s).status == STATOR_NOT_FOUND);
    OK(stator_snapshot_export(s, 11, 5));
    CHECK(one(s).status == STATOR_OK);
    OK(stator_export_cancel(s, 11, 6));
    CHECK(one(s).user_data == 6); /* the cancel completes */
    OK(stator_chunk_release(s, 11, 0, 7));
    CHECK(one(s).status == STATOR_NOT_FOUND);
    CHECK_RC(stator_chunk_slot(s, 1000, &slot), STATOR_E_INVALID_ARGUMENT);
    CHECK_RC(stator_chunk_slot(s, 0, NULL), STATOR_E_NULL);
    /* The helpers need an idle session. */
    OK(stator_get(s, st, 0, (const uint8_t *)"x", 1, NULL, 0, 8));
    CHECK_RC(stator_export_snapshot(s, 12, keep_chunk, &failing, NULL), STATOR_E_INVALID_STATE);
    CHECK(one(s).user_data == 8);
    OK(stator_close(s));
    OK(stator_free(s));

    /* Restore the checkpoint in a new session of the same operator. */
    s = open_session("c-tests-ckpt", "op", 0);
    OK(stator_register(s, "v", STATOR_KIND_VALUE, &st));
    stator_bytes h = {handle, handle_len};
    uint32_t used = 0, layers = 0;
    uint8_t garbage[40] = {1, 2, 3};
    stator_bytes g = {garbage, sizeof garbage};
    CHECK_RC(stator_restore(s, &g, 1, &used, &layers), STATOR_E_REFUSED);
    CHECK(strlen(stator_last_error()) > 0);
    CHECK_RC(stator_restore(s, NULL, 1, &used, &layers), STATOR_E_NULL);
    OK(stator_restore(s, &h, 1, &used, &layers));
    CHECK(used == 1);
    OK(stator_restore(s, &h, 1, NULL, NULL));
    stator_bytes *many = calloc(4097, sizeof *many);
    CHECK_RC(stator_restore(s, many, 4097, NULL, NULL), STATOR_E_INVALID_ARGUMENT);
    free(many);
    CHECK_RC(stator_restore(s, (const stator_bytes *)((char *)&h + 1), 1, NULL, NULL),
             STATOR_E_INVALID_ARGUMENT);
    CHECK(count_values(s, st, 500) == 500);
    /* An unbounded wait returns once a completion is there. */
    OK(stator_get(s, st, 0, (const uint8_t *)"x", 1, NULL, 0, 99));
    OK(stator_flush(s));
    OK(stator_wait(s, -1));
    CHECK(one(s).user_data == 99);
    /* The engine discarded a checkpoint: released with no session, as an
     * engine's coordinator does. */
    OK(stator_checkpoint(s, 2, 104));
    c = one(s);
    CHECK(c.status == STATOR_OK && c.value_len > 0 && c.value_len <= sizeof handle);
    memcpy(handle, c.value, c.value_len);
    stator_bytes h2 = {handle, c.value_len};
    char job[128];
    snprintf(job, sizeof job, "c-tests-ckpt-%ld", (long)getpid());
    uint32_t released = 9;
    CHECK_RC(stator_release_checkpoints(sock, job, "op", &g, 1, &released), STATOR_E_REFUSED);
    OK(stator_release_checkpoints(sock, job, "other-op", &h2, 1, &released));
    CHECK(released == 0);
    OK(stator_release_checkpoints(sock, job, "op", &h2, 1, &released));
    CHECK(released == 1);
    OK(stator_release_checkpoints(sock, job, "op", &h2, 1, NULL));
    CHECK_RC(stator_release_checkpoints(NULL, job, "op", &h2, 1, NULL), STATOR_E_NULL);
    CHECK_RC(stator_restore(s, &h2, 1, NULL, NULL), STATOR_E_REFUSED);
    OK(stator_free(s));

    /* Import the portable snapshot into another job, at parallelism 1. */
    s = open_session("c-tests-import", "op", 0);
    OK(stator_register(s, "v", STATOR_KIND_VALUE, &st));
    CHECK(count_values(s, st, 10) == 0);
    struct chunks bad = ex;
    bad.next = 0;
    bad.fail_at = 0;
    uint64_t records = 0;
    CHECK_RC(stator_import_snapshot(s, 1, give_chunk, &bad, &records), STATOR_E_CALLBACK);
    CHECK_RC(stator_import_snapshot(s, 2, lying_source, NULL, &records), STATOR_E_CALLBACK);
    CHECK_RC(stator_import_snapshot(s, 3, NULL, NULL, &records), STATOR_E_NULL);
    struct chunks none = {.fail_at = -1}; /* no chunk at all: ends before the last */
    CHECK_RC(stator_import_snapshot(s, 6, give_chunk, &none, &records), STATOR_E_PROTOCOL);
    /* A corrupted chunk is refused and nothing is installed. */
    uint8_t *saved = malloc(ex.len[0]);
    memcpy(saved, ex.data[0], ex.len[0]);
    ex.data[0][ex.len[0] / 2] ^= 0x40;
    ex.next = 0;
    ex.fail_at = -1;
    CHECK_RC(stator_import_snapshot(s, 4, give_chunk, &ex, &records), STATOR_E_BAD_SNAPSHOT);
    CHECK(count_values(s, st, 10) == 0);
    memcpy(ex.data[0], saved, ex.len[0]);
    free(saved);
    ex.next = 0;
    OK(stator_import_snapshot(s, 5, give_chunk, &ex, &records));
    CHECK(records == 500);
    CHECK(count_values(s, st, 500) == 500);
    OK(stator_free(s));

    /* The low-level import: write the chunk in place, submit, cancel. */
    s = open_session("c-tests-import2", "op", 0);
    OK(stator_register(s, "v", STATOR_KIND_VALUE, &st));
    OK(stator_chunk_slot(s, 1, &slot));
    memcpy(slot, ex.data[0], ex.len[0]);
    OK(stator_snapshot_import(s, 1, 1, 1));
    CHECK_RC(stator_chunk_slot(s, 1, &slot), STATOR_E_INVALID_STATE);
    CHECK_RC(stator_snapshot_import(s, 1, 1, 2), STATOR_E_INVALID_STATE);
    CHECK_RC(stator_snapshot_import(s, 1, STATOR_NO_SLOT, 2), STATOR_E_INVALID_ARGUMENT);
    c = one(s);
    CHECK(c.status == STATOR_OK && c.slot == 1 && (c.flags & STATOR_CQE_LAST) && c.aux == 500);
    CHECK(count_values(s, st, 500) == 500);
    OK(stator_chunk_slot(s, 2, &slot));
    memcpy(slot, ex.data[0], ex.len[0]);
    OK(stator_import_cancel(s, 2, 3)); /* nothing of import 2 yet */
    c = one(s);
    CHECK(c.user_data == 3);
    OK(stator_free(s));
    free_chunks(&ex);
}

/* Thread-safety contract: a second thread entering a busy session. */
struct waiter {
    stator_session *s;
    int32_t rc;
};

static void *wait_long(void *arg) {
    struct waiter *w = arg;
    w->rc = stator_wait(w->s, 600);
    return NULL;
}

/* Every session function refuses `s` with `want` (NULL, a closed or a
 * freed session), touching nothing. */
static void every_call_refused(stator_session *s, int32_t want) {
    uint64_t u64 = 0;
    uint32_t a = 0, b = 0;
    const uint8_t k[] = "k";
    stator_request r;
    memset(&r, 0, sizeof r);
    r.opcode = STATOR_OP_NOP;
    stator_completion c;
    stator_value_buffer vb;
    stator_bytes h = {k, 1};
    uint8_t *slot = NULL;
    CHECK_RC(stator_session_id(s, &u64), want);
    CHECK_RC(stator_session_key_groups(s, &a, &b), want);
    CHECK_RC(stator_in_flight(s), want);
    CHECK_RC(stator_register(s, "v", STATOR_KIND_VALUE, &a), want);
    CHECK_RC(stator_restore(s, &h, 1, NULL, NULL), want);
    CHECK_RC(stator_submit(s, &r, 1), want);
    CHECK_RC(stator_get(s, 0, 0, k, 1, NULL, 0, 1), want);
    CHECK_RC(stator_put(s, 0, 0, k, 1, NULL, 0, k, 1, 1), want);
    CHECK_RC(stator_delete(s, 0, 0, k, 1, NULL, 0, 1), want);
    CHECK_RC(stator_list_append(s, 0, 0, k, 1, NULL, 0, k, 1, 1), want);
    CHECK_RC(stator_list_get(s, 0, 0, k, 1, NULL, 0, 1), want);
    CHECK_RC(stator_list_replace(s, 0, 0, k, 1, NULL, 0, NULL, 0, 1), want);
    CHECK_RC(stator_map_get(s, 0, 0, k, 1, NULL, 0, k, 1, 1), want);
    CHECK_RC(stator_map_put(s, 0, 0, k, 1, NULL, 0, k, 1, k, 1, 1), want);
    CHECK_RC(stator_map_remove(s, 0, 0, k, 1, NULL, 0, k, 1, 1), want);
    CHECK_RC(stator_map_contains(s, 0, 0, k, 1, NULL, 0, k, 1, 1), want);
    CHECK_RC(stator_map_iter(s, 0, 0, k, 1, NULL, 0, STATOR_ITER_KEYS, NULL, 0, 1), want);
    CHECK_RC(stator_clear(s, 0, 0, k, 1, NULL, 0, 1), want);
    CHECK_RC(stator_checkpoint(s, 1, 1), want);
    CHECK_RC(stator_checkpoint_notify(s, 1, STATOR_NOTIFY_ABORT, 1), want);
    CHECK_RC(stator_flush(s), want);
    CHECK_RC(stator_reap(s, &c, 1), want);
    CHECK_RC(stator_wait(s, 0), want);
    CHECK_RC(stator_event_fd(s), want);
    CHECK_RC(stator_arm(s), want);
    CHECK_RC(stator_disarm(s), want);
    CHECK_RC(stator_value_reserve(s, 8, &vb), want);
    r.opcode = STATOR_OP_PUT;
    CHECK_RC(stator_submit_reserved(s, &r, 0, 1, 1), want);
    CHECK_RC(stator_value_release(s, 0), want);
    CHECK_RC(stator_chunk_slots(s), want);
    CHECK_RC(stator_chunk_slot(s, 0, &slot), want);
    CHECK_RC(stator_snapshot_export(s, 1, 1), want);
    CHECK_RC(stator_chunk_release(s, 1, 0, 1), want);
    CHECK_RC(stator_export_cancel(s, 1, 1), want);
    CHECK_RC(stator_snapshot_import(s, 1, 0, 1), want);
    CHECK_RC(stator_import_cancel(s, 1, 1), want);
    CHECK_RC(stator_export_snapshot(s, 1, keep_chunk, NULL, NULL), want);
    CHECK_RC(stator_import_snapshot(s, 1, give_chunk, NULL, NULL), want);
    CHECK_RC(stator_close(s), want);
}

static void test_threads_and_close(void) {
    stator_session *s = open_session("c-tests", "threads", 0);
    struct waiter w = {s, 1};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, wait_long, &w) == 0);
    struct timespec ts = {0, 200 * 1000 * 1000};
    nanosleep(&ts, NULL);
    CHECK_RC(stator_in_flight(s), STATOR_E_IN_USE);
    CHECK_RC(stator_flush(s), STATOR_E_IN_USE);
    CHECK_RC(stator_free(s), STATOR_E_IN_USE); /* freed nothing */
    pthread_join(t, NULL);
    CHECK_RC(w.rc, STATOR_E_TIMED_OUT);
    /* Moving between threads one at a time is fine. */
    CHECK(stator_in_flight(s) == 0);

    OK(stator_close(s));
    every_call_refused(s, STATOR_E_CLOSED);
    every_call_refused(NULL, STATOR_E_NULL);
    OK(stator_free(s));
    /* A freed handle is marked: calls and a second free are refused. */
    CHECK_RC(stator_flush(s), STATOR_E_INVALID_ARGUMENT);
    CHECK_RC(stator_free(s), STATOR_E_INVALID_ARGUMENT);
    /* Freeing an open session closes it. */
    s = open_session("c-tests", "threads", 0);
    OK(stator_free(s));
}

/* The daemon dies under an open session (the driver kills it). */
static int daemon_gone(void) {
    stator_session *s = open_session("c-tests", "gone", 0);
    uint32_t st;
    OK(stator_register(s, "v", STATOR_KIND_VALUE, &st));
    printf("ready\n");
    fflush(stdout);
    CHECK_RC(stator_wait(s, 20000), STATOR_E_DAEMON_GONE);
    CHECK_RC(stator_get(s, st, 0, (const uint8_t *)"k", 1, NULL, 0, 1), STATOR_E_DAEMON_GONE);
    CHECK_RC(stator_flush(s), STATOR_E_DAEMON_GONE);
    int32_t rc = stator_close(s);
    CHECK(rc == STATOR_E_DAEMON_GONE);
    OK(stator_free(s));
    return failures;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s SOCKET [gone]\n", argv[0]);
        return 2;
    }
    sock = argv[1];
    if (argc > 2 && strcmp(argv[2], "gone") == 0) {
        int f = daemon_gone();
        fprintf(stderr, "gone: %d checks, %d failed\n", checks, f);
        return f ? 1 : 0;
    }
    test_versions_and_strings();
    test_key_groups();
    test_decoders();
    test_open_errors();
    test_null_and_bad_handles();
    test_session_basics();
    test_generic_submit();
    test_batches_full_and_wait();
    test_event_fd();
    test_reservations();
    test_checkpoints_and_snapshots();
    test_threads_and_close();
    fprintf(stderr, "%d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
