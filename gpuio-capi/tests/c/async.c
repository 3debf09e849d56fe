/* Asynchronous requests completed four ways: gpuio_request_wait, polling with
 * gpuio_request_test, a callback, and the engine's eventfd in an epoll loop. */
#include <poll.h>
#include <pthread.h>
#include <sys/epoll.h>

#include "common.h"

#define REQUESTS 32
#define PIECE (256u << 10)

static const uint64_t FILE_LEN = (uint64_t)REQUESTS * PIECE + 1000;

/* Offsets that are neither aligned nor in order: request i reads at off(i). */
static uint64_t off(int i) { return (uint64_t)((i * 7) % REQUESTS) * PIECE + (uint64_t)i * 3; }

struct callbacks {
    pthread_mutex_t lock;
    pthread_cond_t all_done;
    int done;
    int failed;
    uint64_t bytes;
    int freed_in_callback;
};

static void on_complete(gpuio_request *req, gpuio_status status, uint64_t bytes, void *user) {
    struct callbacks *c = user;
    /* Inside the callback the request is complete: test sees its result at once. */
    uint64_t seen = 0;
    gpuio_status tested = gpuio_request_test(req, &seen);
    /* Freeing its own request inside the callback is allowed. */
    gpuio_status freed = gpuio_request_free(req);
    pthread_mutex_lock(&c->lock);
    if (status != GPUIO_OK || tested != GPUIO_OK || seen != bytes) c->failed++;
    if (freed == GPUIO_OK) c->freed_in_callback++;
    c->bytes += bytes;
    c->done++;
    pthread_cond_broadcast(&c->all_done);
    pthread_mutex_unlock(&c->lock);
}

static volatile int slow_callback_returned;

/* Slow on purpose (briefly): gpuio_request_free must wait for it to return. */
static void slow_callback(gpuio_request *req, gpuio_status status, uint64_t bytes, void *user) {
    (void)req, (void)status, (void)bytes, (void)user;
    usleep(50000);
    __atomic_store_n(&slow_callback_returned, 1, __ATOMIC_SEQ_CST);
}

int main(int argc, char **argv) {
    if (argc != 2) FAIL("usage: %s DIR", argv[0]);
    char *path = join(argv[1], "async.bin");
    make_file(path, FILE_LEN);
    gpuio_engine *engine = NULL;
    CHECK(gpuio_engine_create(NULL, &engine));
    gpuio_file *file = NULL;
    CHECK(gpuio_open(engine, path, GPUIO_OPEN_READ, &file));
    uint8_t *bufs = malloc((size_t)REQUESTS * PIECE);
    gpuio_request *reqs[REQUESTS];

    /* 1. wait */
    for (int i = 0; i < REQUESTS; i++) {
        gpuio_buffer b = host_buffer(bufs + (size_t)i * PIECE, PIECE);
        CHECK(gpuio_read_async(file, &b, off(i), NULL, NULL, &reqs[i]));
    }
    for (int i = REQUESTS - 1; i >= 0; i--) {
        uint64_t n = 0;
        CHECK(gpuio_request_wait(reqs[i], -1, &n));
        EXPECT(n == PIECE);
        /* A finished request answers again, the same way. */
        uint64_t again = 0;
        CHECK(gpuio_request_wait(reqs[i], 0, &again));
        EXPECT(again == n);
        expect_pattern(bufs + (size_t)i * PIECE, off(i), PIECE);
        CHECK(gpuio_request_free(reqs[i]));
    }
    printf("ok wait: %d requests\n", REQUESTS);

    /* 2. test, polling */
    memset(bufs, 0, (size_t)REQUESTS * PIECE);
    for (int i = 0; i < REQUESTS; i++) {
        gpuio_buffer b = host_buffer(bufs + (size_t)i * PIECE, PIECE);
        CHECK(gpuio_read_async(file, &b, off(i), NULL, NULL, &reqs[i]));
    }
    int left = REQUESTS, polls = 0;
    int finished[REQUESTS] = {0};
    while (left > 0) {
        for (int i = 0; i < REQUESTS; i++) {
            if (finished[i]) continue;
            uint64_t n = 0;
            gpuio_status s = gpuio_request_test(reqs[i], &n);
            polls++;
            if (s == GPUIO_PENDING) continue;
            CHECK(s);
            EXPECT(n == PIECE);
            expect_pattern(bufs + (size_t)i * PIECE, off(i), PIECE);
            finished[i] = 1;
            left--;
            CHECK(gpuio_request_free(reqs[i]));
        }
        if (left) usleep(100);
    }
    printf("ok test: %d requests, %d polls\n", REQUESTS, polls);

    /* 3. callback */
    memset(bufs, 0, (size_t)REQUESTS * PIECE);
    struct callbacks cb = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0};
    for (int i = 0; i < REQUESTS; i++) {
        gpuio_buffer b = host_buffer(bufs + (size_t)i * PIECE, PIECE);
        gpuio_request *req = NULL;
        CHECK(gpuio_read_async(file, &b, off(i), on_complete, &cb, &req));
    }
    pthread_mutex_lock(&cb.lock);
    while (cb.done < REQUESTS) pthread_cond_wait(&cb.all_done, &cb.lock);
    pthread_mutex_unlock(&cb.lock);
    EXPECT(cb.failed == 0);
    EXPECT(cb.freed_in_callback == REQUESTS);
    EXPECT(cb.bytes == (uint64_t)REQUESTS * PIECE);
    for (int i = 0; i < REQUESTS; i++) expect_pattern(bufs + (size_t)i * PIECE, off(i), PIECE);
    printf("ok callback: %d requests, each freed inside its callback\n", REQUESTS);

    /* 4. eventfd in an epoll loop */
    memset(bufs, 0, (size_t)REQUESTS * PIECE);
    int efd = gpuio_engine_eventfd(engine);
    EXPECT(efd >= 0);
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = efd};
    EXPECT(epoll_ctl(ep, EPOLL_CTL_ADD, efd, &ev) == 0);
    for (int i = 0; i < REQUESTS; i++) {
        gpuio_buffer b = host_buffer(bufs + (size_t)i * PIECE, PIECE);
        CHECK(gpuio_read_async(file, &b, off(i), NULL, NULL, &reqs[i]));
        finished[i] = 0;
    }
    left = REQUESTS;
    int wakeups = 0;
    uint64_t signalled = 0;
    while (left > 0) {
        struct epoll_event got;
        int r = epoll_wait(ep, &got, 1, 10000);
        if (r != 1) FAIL("epoll_wait returned %d with %d requests left", r, left);
        uint64_t count = 0;
        EXPECT(read(efd, &count, sizeof count) == sizeof count);
        signalled += count;
        wakeups++;
        for (int i = 0; i < REQUESTS; i++) {
            if (finished[i]) continue;
            uint64_t n = 0;
            gpuio_status s = gpuio_request_test(reqs[i], &n);
            if (s == GPUIO_PENDING) continue;
            CHECK(s);
            EXPECT(n == PIECE);
            expect_pattern(bufs + (size_t)i * PIECE, off(i), PIECE);
            finished[i] = 1;
            left--;
            CHECK(gpuio_request_free(reqs[i]));
        }
    }
    /* Every completion is counted, once: test may see a result a moment before its signal,
     * so collect the rest. (Counting starts at the first gpuio_engine_eventfd call, so the
     * earlier rounds are not in it.) */
    while (signalled < REQUESTS) {
        struct epoll_event got;
        if (epoll_wait(ep, &got, 1, 10000) != 1) FAIL("only %llu signals", (unsigned long long)signalled);
        uint64_t count = 0;
        EXPECT(read(efd, &count, sizeof count) == sizeof count);
        signalled += count;
    }
    EXPECT(signalled == REQUESTS);
    close(ep);
    printf("ok eventfd: %d requests, %d wakeups, %llu signals\n", REQUESTS, wakeups,
           (unsigned long long)signalled);

    /* 5. wait returns once the result is in; free waits for the callback to return, so
     * the callback's user data may be freed after it. */
    {
        gpuio_buffer b = host_buffer(bufs, PIECE);
        gpuio_request *req = NULL;
        CHECK(gpuio_read_async(file, &b, 0, slow_callback, NULL, &req));
        CHECK(gpuio_request_wait(req, -1, NULL));
        CHECK(gpuio_request_free(req));
        EXPECT(__atomic_load_n(&slow_callback_returned, __ATOMIC_SEQ_CST) == 1);
        printf("ok free waits for the callback\n");
    }

    /* 6. async writes, then read back */
    char *out = join(argv[1], "async-out.bin");
    gpuio_file *wfile = NULL;
    CHECK(gpuio_open(engine, out, GPUIO_OPEN_READ | GPUIO_OPEN_WRITE | GPUIO_OPEN_CREATE, &wfile));
    for (int i = 0; i < REQUESTS; i++) {
        gpuio_buffer b = host_buffer(bufs + (size_t)i * PIECE, PIECE);
        CHECK(gpuio_write_async(wfile, &b, (uint64_t)i * PIECE, NULL, NULL, &reqs[i]));
    }
    for (int i = 0; i < REQUESTS; i++) {
        uint64_t n = 0;
        CHECK(gpuio_request_wait(reqs[i], 10 * 1000000000LL, &n));
        EXPECT(n == PIECE);
        CHECK(gpuio_request_free(reqs[i]));
    }
    uint8_t *back = malloc((size_t)REQUESTS * PIECE);
    gpuio_buffer all = host_buffer(back, (size_t)REQUESTS * PIECE);
    uint64_t n = 0;
    CHECK(gpuio_read(wfile, &all, 0, &n));
    EXPECT(n == (uint64_t)REQUESTS * PIECE);
    EXPECT(memcmp(back, bufs, (size_t)REQUESTS * PIECE) == 0);
    printf("ok write async: %d requests read back\n", REQUESTS);

    CHECK(gpuio_close(wfile));
    CHECK(gpuio_close(file));
    CHECK(gpuio_engine_free(engine));
    free(back);
    free(bufs);
    free(out);
    free(path);
    printf("PASS async\n");
    return 0;
}
