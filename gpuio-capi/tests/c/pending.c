/* Requests held pending for as long as the test wants, deterministically: an engine with one
 * executor thread whose first callback blocks (on purpose, against the callback contract, as
 * a test device) until a helper thread releases it, so no other request of the engine can
 * complete meanwhile. They show GPUIO_PENDING, GPUIO_ERR_TIMEOUT, gpuio_request_free
 * cancelling a running request, and gpuio_engine_free cancelling the engine's requests
 * (GPUIO_ERR_CANCELED). The helper releases the executor only once the handle being freed is
 * gone, which gpuio guarantees happens after the cancellation. */
#include <pthread.h>

#include "common.h"

struct gate {
    pthread_mutex_t lock;
    pthread_cond_t changed;
    int entered, open;
};

static struct gate gate = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0};

static void blocking_callback(gpuio_request *req, gpuio_status status, uint64_t bytes, void *u) {
    (void)req, (void)status, (void)bytes, (void)u;
    pthread_mutex_lock(&gate.lock);
    gate.entered = 1;
    pthread_cond_broadcast(&gate.changed);
    while (!gate.open) pthread_cond_wait(&gate.changed, &gate.lock);
    pthread_mutex_unlock(&gate.lock);
}

/* Blocks the engine's only executor thread inside a callback. */
static gpuio_request *block_executor(gpuio_file *file, uint8_t *buf) {
    pthread_mutex_lock(&gate.lock);
    gate.entered = gate.open = 0;
    pthread_mutex_unlock(&gate.lock);
    gpuio_request *req = NULL;
    gpuio_buffer b = host_buffer(buf, 4096);
    CHECK(gpuio_read_async(file, &b, 0, blocking_callback, NULL, &req));
    pthread_mutex_lock(&gate.lock);
    while (!gate.entered) pthread_cond_wait(&gate.changed, &gate.lock);
    pthread_mutex_unlock(&gate.lock);
    return req;
}

static void open_gate(void) {
    pthread_mutex_lock(&gate.lock);
    gate.open = 1;
    pthread_cond_broadcast(&gate.changed);
    pthread_mutex_unlock(&gate.lock);
}

/* Helper threads: open the gate once a handle is dead (the cancellation has happened). */
static void *release_when_request_gone(void *req) {
    while (gpuio_request_test(req, NULL) != GPUIO_ERR_BAD_HANDLE) usleep(1000);
    open_gate();
    return NULL;
}

static void *release_when_engine_gone(void *engine) {
    while (gpuio_engine_eventfd(engine) >= 0) usleep(1000);
    open_gate();
    return NULL;
}

struct seen {
    pthread_mutex_t lock;
    int calls;
    gpuio_status status;
};

static void record(gpuio_request *req, gpuio_status status, uint64_t bytes, void *user) {
    (void)req, (void)bytes;
    struct seen *s = user;
    pthread_mutex_lock(&s->lock);
    s->calls++;
    s->status = status;
    pthread_mutex_unlock(&s->lock);
}

int main(int argc, char **argv) {
    if (argc != 2) FAIL("usage: %s DIR", argv[0]);
    char *path = join(argv[1], "pending.bin");
    make_file(path, 1 << 20);
    gpuio_engine_settings s;
    memset(&s, 0, sizeof s);
    s.executor_threads = 1;
    gpuio_engine *engine = NULL;
    CHECK(gpuio_engine_create(&s, &engine));
    gpuio_file *file = NULL;
    CHECK(gpuio_open(engine, path, GPUIO_OPEN_READ, &file));
    uint8_t gate_buf[4096], buf[65536];
    gpuio_buffer b = host_buffer(buf, sizeof buf);

    /* Pending, then a timeout, then completion once the executor is free. */
    gpuio_request *blocker = block_executor(file, gate_buf);
    gpuio_request *req = NULL;
    CHECK(gpuio_read_async(file, &b, 4096, NULL, NULL, &req));
    uint64_t n = 99;
    EXPECT_ERR(gpuio_request_test(req, &n), GPUIO_PENDING, "still running");
    EXPECT(n == 99); /* untouched while pending */
    EXPECT_ERR(gpuio_request_wait(req, 20 * 1000000, &n), GPUIO_ERR_TIMEOUT,
               "still running after 20000000 ns");
    open_gate();
    CHECK(gpuio_request_wait(req, -1, &n));
    EXPECT(n == sizeof buf);
    expect_pattern(buf, 4096, sizeof buf);
    CHECK(gpuio_request_free(req));
    CHECK(gpuio_request_wait(blocker, -1, NULL));
    CHECK(gpuio_request_free(blocker));
    printf("ok pending: test, timeout, then completion with %llu bytes\n", (unsigned long long)n);

    /* Freeing a running request cancels it: its callback never runs, its buffer is not
     * written after the free returns. */
    struct seen seen = {PTHREAD_MUTEX_INITIALIZER, 0, GPUIO_OK};
    blocker = block_executor(file, gate_buf);
    memset(buf, 0, sizeof buf);
    CHECK(gpuio_read_async(file, &b, 0, record, &seen, &req));
    pthread_t helper;
    EXPECT(pthread_create(&helper, NULL, release_when_request_gone, req) == 0);
    CHECK(gpuio_request_free(req));
    pthread_join(helper, NULL);
    CHECK(gpuio_request_wait(blocker, -1, NULL));
    CHECK(gpuio_request_free(blocker));
    pthread_mutex_lock(&seen.lock);
    EXPECT(seen.calls == 0);
    pthread_mutex_unlock(&seen.lock);
    for (size_t i = 0; i < sizeof buf; i++) EXPECT(buf[i] == 0);
    EXPECT_ERR(gpuio_request_test(req, NULL), GPUIO_ERR_BAD_HANDLE, "not a live gpuio_request");
    printf("ok request_free cancels a running request\n");

    /* A cancelled batch still writes every result: the descriptors it never finished say
     * GPUIO_ERR_CANCELED (this one never even started: the executor is held). */
    blocker = block_executor(file, gate_buf);
    gpuio_batch_desc descs[] = {{file, 0, 4096, 0}, {file, 8192, 4096, 4096}};
    gpuio_batch_result results[2];
    memset(results, 0xAB, sizeof results);
    CHECK(gpuio_read_batch_async(descs, 2, &b, results, NULL, NULL, &req));
    EXPECT(pthread_create(&helper, NULL, release_when_request_gone, req) == 0);
    CHECK(gpuio_request_free(req));
    pthread_join(helper, NULL);
    CHECK(gpuio_request_wait(blocker, -1, NULL));
    CHECK(gpuio_request_free(blocker));
    for (size_t i = 0; i < 2; i++)
        EXPECT(results[i].status == GPUIO_ERR_CANCELED && results[i].bytes == 0);
    printf("ok batch request_free cancels, every result written\n");

    /* Freeing the engine cancels what runs: the callback reports GPUIO_ERR_CANCELED before
     * gpuio_engine_free returns; wait reports it too; the handle lives until freed. */
    blocker = block_executor(file, gate_buf);
    CHECK(gpuio_read_async(file, &b, 0, record, &seen, &req));
    EXPECT(pthread_create(&helper, NULL, release_when_engine_gone, engine) == 0);
    CHECK(gpuio_engine_free(engine));
    pthread_join(helper, NULL);
    pthread_mutex_lock(&seen.lock);
    EXPECT(seen.calls == 1 && seen.status == GPUIO_ERR_CANCELED);
    pthread_mutex_unlock(&seen.lock);
    EXPECT_ERR(gpuio_request_wait(req, -1, &n), GPUIO_ERR_CANCELED, "engine was freed");
    CHECK(gpuio_request_free(req));
    CHECK(gpuio_request_free(blocker));
    printf("ok engine_free cancels running requests\n");

    /* The file outlives its engine only as a handle: every call says why it cannot run. */
    EXPECT_ERR(gpuio_read(file, &b, 0, &n), GPUIO_ERR_SHUTDOWN, "has been freed");
    EXPECT_ERR(gpuio_read_async(file, &b, 0, NULL, NULL, &req), GPUIO_ERR_SHUTDOWN,
               "has been freed");
    CHECK(gpuio_close(file));
    free(path);
    printf("PASS pending\n");
    return 0;
}
