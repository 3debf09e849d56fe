/* Several threads at once on one engine: each opens its own handle to a shared file (and
 * shares one more), submits asynchronous and synchronous reads and writes, and checks every
 * byte; one thread closes its handles while the others work. */
#include <pthread.h>

#include "common.h"

#define THREADS 8
#define ROUNDS 40
#define INFLIGHT 8
#define PIECE 65536u

static gpuio_engine *engine;
static gpuio_file *shared_file;
static const char *data_path, *dir;
static const uint64_t FILE_LEN = 64ull * PIECE;

struct worker {
    int id;
    uint64_t bytes;
};

static uint64_t next(uint64_t *state) {
    *state = *state * 6364136223846793005ull + 1442695040888963407ull;
    return *state >> 33;
}

static void *work(void *arg) {
    struct worker *w = arg;
    uint64_t rng = (uint64_t)w->id + 1;
    gpuio_file *own = NULL;
    CHECK(gpuio_open(engine, data_path, GPUIO_OPEN_READ, &own));
    uint8_t *bufs = malloc((size_t)INFLIGHT * PIECE);
    for (int round = 0; round < ROUNDS; round++) {
        gpuio_request *reqs[INFLIGHT];
        uint64_t offs[INFLIGHT];
        for (int i = 0; i < INFLIGHT; i++) {
            offs[i] = next(&rng) % (FILE_LEN - PIECE);
            gpuio_buffer b = host_buffer(bufs + (size_t)i * PIECE, PIECE);
            CHECK(gpuio_read_async(i % 2 ? own : shared_file, &b, offs[i], NULL, NULL, &reqs[i]));
        }
        for (int i = 0; i < INFLIGHT; i++) {
            uint64_t n = 0;
            CHECK(gpuio_request_wait(reqs[i], -1, &n));
            EXPECT(n == PIECE);
            expect_pattern(bufs + (size_t)i * PIECE, offs[i], PIECE);
            CHECK(gpuio_request_free(reqs[i]));
            w->bytes += n;
        }
        uint64_t off = next(&rng) % (FILE_LEN - 1000), n = 0;
        gpuio_buffer small = host_buffer(bufs, 1000);
        CHECK(gpuio_read(own, &small, off, &n));
        EXPECT(n == 1000);
        expect_pattern(bufs, off, 1000);
        w->bytes += n;
    }
    /* Each thread writes its own file too, then reads it back. */
    char name[64];
    snprintf(name, sizeof name, "thread-%d.bin", w->id);
    char *out = join(dir, name);
    gpuio_file *wf = NULL;
    CHECK(gpuio_open(engine, out, GPUIO_OPEN_READ | GPUIO_OPEN_WRITE | GPUIO_OPEN_CREATE, &wf));
    for (size_t i = 0; i < PIECE; i++) bufs[i] = pattern_at(i);
    gpuio_buffer b = host_buffer(bufs, PIECE);
    gpuio_request *req = NULL;
    CHECK(gpuio_write_async(wf, &b, 0, NULL, NULL, &req));
    CHECK(gpuio_request_wait(req, -1, NULL));
    CHECK(gpuio_request_free(req));
    memset(bufs, 0, PIECE);
    uint64_t n = 0;
    CHECK(gpuio_read(wf, &b, 0, &n));
    EXPECT(n == PIECE);
    expect_pattern(bufs, 0, PIECE);
    CHECK(gpuio_close(wf));
    CHECK(gpuio_close(own));
    free(out);
    free(bufs);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 2) FAIL("usage: %s DIR", argv[0]);
    dir = argv[1];
    char *path = join(argv[1], "threads.bin");
    data_path = path;
    make_file(path, FILE_LEN);
    gpuio_engine_settings s;
    memset(&s, 0, sizeof s);
    s.executor_threads = 3;
    CHECK(gpuio_engine_create(&s, &engine));
    CHECK(gpuio_open(engine, path, GPUIO_OPEN_READ, &shared_file));
    pthread_t threads[THREADS];
    struct worker workers[THREADS];
    for (int i = 0; i < THREADS; i++) {
        workers[i] = (struct worker){i, 0};
        EXPECT(pthread_create(&threads[i], NULL, work, &workers[i]) == 0);
    }
    uint64_t total = 0;
    for (int i = 0; i < THREADS; i++) {
        pthread_join(threads[i], NULL);
        total += workers[i].bytes;
    }
    EXPECT(total == (uint64_t)THREADS * ROUNDS * (INFLIGHT * PIECE + 1000));
    CHECK(gpuio_close(shared_file));
    CHECK(gpuio_engine_free(engine));
    free(path);
    printf("ok threads: %d threads, %llu bytes checked\n", THREADS, (unsigned long long)total);
    printf("PASS threads\n");
    return 0;
}
