/*
 * eventloop.c: 1,000 requests in flight from the caller's own epoll loop.
 *
 * Writes N keys (values written in place in shared memory: no copy), then
 * reads them back and checks every value, always keeping IN_FLIGHT
 * requests outstanding, sleeping on epoll with the session's event fd
 * when nothing is ready. Prints ops/s per phase; exits 1 on any mismatch.
 *
 *   cc eventloop.c $(pkg-config --cflags --libs stator) -o eventloop
 *   ./eventloop [N]      # STATOR_SOCKET overrides ./stator-run/stator.sock
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <time.h>
#include <unistd.h>

#include <stator.h>

#define IN_FLIGHT 1000
#define MAX_PARALLELISM 128
#define VALUE_LEN 100

static int fail(const char *what, int32_t rc) {
    fprintf(stderr, "%s: %s (%s)\n", what, stator_strerror(rc), stator_last_error());
    return 1;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* The value of key i: VALUE_LEN bytes derived from i. */
static void value_of(uint64_t i, uint8_t *out) {
    for (int b = 0; b < VALUE_LEN; b++) out[b] = (uint8_t)(i * 31 + (uint64_t)b);
}

struct loop {
    stator_session *s;
    uint32_t state;
    int ep;
    uint64_t n, next, done, bad;
    int reading;
};

/* Queues request `i` of the current phase; STATOR_E_FULL means later. */
static int32_t submit(struct loop *l, uint64_t i) {
    uint8_t key[8];
    memcpy(key, &i, 8);
    uint32_t kg = (uint32_t)(i % MAX_PARALLELISM);
    if (l->reading) return stator_get(l->s, l->state, kg, key, 8, NULL, 0, i);
    stator_value_buffer b;
    int32_t rc = stator_value_reserve(l->s, VALUE_LEN, &b);
    if (rc != STATOR_OK) return rc;
    value_of(i, b.data); /* straight into shared memory */
    stator_request r;
    memset(&r, 0, sizeof r);
    r.opcode = STATOR_OP_PUT;
    r.state = l->state;
    r.key_group = kg;
    r.key = (stator_bytes){key, 8};
    rc = stator_submit_reserved(l->s, &r, b.id, VALUE_LEN, i);
    if (rc != STATOR_OK) stator_value_release(l->s, b.id);
    return rc;
}

static int run_phase(struct loop *l, int reading) {
    l->reading = reading;
    l->next = l->done = 0;
    stator_completion cs[256];
    uint8_t want[VALUE_LEN];
    double t = now();
    while (l->done < l->n) {
        while (l->next < l->n && l->next - l->done < IN_FLIGHT) {
            int32_t rc = submit(l, l->next);
            if (rc == STATOR_E_FULL) break;
            if (rc != STATOR_OK) return fail("submit", rc);
            l->next++;
        }
        int32_t rc = stator_flush(l->s);
        if (rc != STATOR_OK) return fail("flush", rc);
        int32_t n = stator_reap(l->s, cs, 256);
        if (n < 0) return fail("reap", n);
        if (n == 0) {
            rc = stator_arm(l->s);
            if (rc < 0) return fail("arm", rc);
            if (rc == 0) { /* armed: sleep until the daemon rings */
                struct epoll_event ev;
                if (epoll_wait(l->ep, &ev, 1, 10000) == 0) {
                    fprintf(stderr, "no completion in 10 s\n");
                    return 1;
                }
            }
            continue; /* the next reap disarms */
        }
        for (int32_t k = 0; k < n; k++) {
            if (cs[k].status != STATOR_OK) {
                l->bad++;
                continue;
            }
            if (reading) {
                value_of(cs[k].user_data, want);
                if (cs[k].value_len != VALUE_LEN || memcmp(cs[k].value, want, VALUE_LEN) != 0)
                    l->bad++;
            }
        }
        l->done += (uint64_t)n;
    }
    double dt = now() - t;
    printf("{\"case\":\"c_eventloop_%s\",\"in_flight\":%d,\"ops\":%llu,\"seconds\":%.3f,"
           "\"ops_per_sec\":%.0f}\n",
           reading ? "get" : "put", IN_FLIGHT, (unsigned long long)l->n, dt,
           (double)l->n / dt);
    return 0;
}

int main(int argc, char **argv) {
    const char *sock = getenv("STATOR_SOCKET");
    if (!sock) sock = "./stator-run/stator.sock";
    struct loop l;
    memset(&l, 0, sizeof l);
    l.n = argc > 1 ? strtoull(argv[1], NULL, 10) : 200000;

    stator_open_options o;
    stator_open_options_init(&o);
    o.job = "eventloop-example";
    o.operator_name = "op";
    o.max_parallelism = MAX_PARALLELISM;
    int32_t rc = stator_open(sock, &o, &l.s);
    if (rc != STATOR_OK) return fail("open", rc);
    if ((rc = stator_register(l.s, "values", STATOR_KIND_VALUE, &l.state)) != STATOR_OK)
        return fail("register", rc);
    int fd = stator_event_fd(l.s);
    if (fd < 0) return fail("event fd", fd);
    l.ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN};
    if (l.ep < 0 || epoll_ctl(l.ep, EPOLL_CTL_ADD, fd, &ev) != 0) {
        perror("epoll");
        return 1;
    }
    if (run_phase(&l, 0) || run_phase(&l, 1)) return 1;
    epoll_ctl(l.ep, EPOLL_CTL_DEL, fd, NULL);
    close(l.ep);
    rc = stator_close(l.s);
    stator_free(l.s);
    if (rc != STATOR_OK) return fail("close", rc);
    if (l.bad) {
        fprintf(stderr, "%llu requests failed or read a wrong value\n", (unsigned long long)l.bad);
        return 1;
    }
    return 0;
}
