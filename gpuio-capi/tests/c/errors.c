/* Every error path the C API has: a status and a message naming what was wrong (and, for
 * operations, the op, path, offset and backend). Nothing here may crash or abort. */
#include <pthread.h>

#include "common.h"

struct in_callback {
    pthread_mutex_t lock;
    pthread_cond_t done;
    int called;
    gpuio_status read_status, wait_status, free_engine_status;
    char message[512];
    gpuio_file *file;
    gpuio_engine *engine;
};

static void blocking_calls(gpuio_request *req, gpuio_status status, uint64_t bytes, void *user) {
    (void)req, (void)status, (void)bytes;
    struct in_callback *c = user;
    uint8_t buf[16];
    gpuio_buffer b = host_buffer(buf, sizeof buf);
    gpuio_status r = gpuio_read(c->file, &b, 0, NULL);
    pthread_mutex_lock(&c->lock);
    c->read_status = r;
    snprintf(c->message, sizeof c->message, "%s", gpuio_last_error());
    c->free_engine_status = gpuio_engine_free(c->engine);
    c->called = 1;
    pthread_cond_broadcast(&c->done);
    pthread_mutex_unlock(&c->lock);
}

int main(int argc, char **argv) {
    if (argc != 2) FAIL("usage: %s DIR", argv[0]);
    char *path = join(argv[1], "errors.bin");
    make_file(path, 100000);
    char *missing = join(argv[1], "no-such-file");

    /* Engine creation. */
    EXPECT_ERR(gpuio_engine_create(NULL, NULL), GPUIO_ERR_INVALID, "out is a null pointer");
    gpuio_engine_settings s;
    memset(&s, 0, sizeof s);
    s.backend = 99;
    gpuio_engine *engine = NULL;
    EXPECT_ERR(gpuio_engine_create(&s, &engine), GPUIO_ERR_INVALID, "backend 99");
    EXPECT(engine == NULL);
    memset(&s, 0, sizeof s);
    s.chunk_size = 1000;
    EXPECT_ERR(gpuio_engine_create(&s, &engine), GPUIO_ERR_INVALID,
               "chunk size 1000 must be a multiple of 4096");
    memset(&s, 0, sizeof s);
    s.queue_depth = 100000;
    EXPECT_ERR(gpuio_engine_create(&s, &engine), GPUIO_ERR_INVALID, "queue depth");
    /* Thread counts size what the engine starts: refused, not tried until the OS says no. */
    memset(&s, 0, sizeof s);
    s.executor_threads = UINT32_MAX;
    EXPECT_ERR(gpuio_engine_create(&s, &engine), GPUIO_ERR_INVALID,
               "executor_threads 4294967295 is more than");
    memset(&s, 0, sizeof s);
    s.pread_threads = UINT32_MAX;
    EXPECT_ERR(gpuio_engine_create(&s, &engine), GPUIO_ERR_INVALID,
               "pread_threads 4294967295 is more than");
    EXPECT(engine == NULL);
    /* Options: each bad entry refused by name, and no engine made. */
    gpuio_engine_option opts[2];
    memset(opts, 0, sizeof opts);
    EXPECT_ERR(gpuio_engine_create_with_options(NULL, NULL, 1, &engine), GPUIO_ERR_INVALID,
               "options is a null pointer with a count of 1");
    EXPECT_ERR(gpuio_engine_create_with_options(NULL, opts, (size_t)1 << 40, &engine),
               GPUIO_ERR_INVALID, "a count of 1099511627776 is more than the 1024");
    opts[0].key = 999;
    EXPECT_ERR(gpuio_engine_create_with_options(NULL, opts, 1, &engine), GPUIO_ERR_INVALID,
               "options[0].key 999 is not a GPUIO_OPTION_*");
    opts[0].key = GPUIO_OPTION_MAPPED_READS;
    opts[0].value = 2;
    EXPECT_ERR(gpuio_engine_create_with_options(NULL, opts, 1, &engine), GPUIO_ERR_INVALID,
               "(GPUIO_OPTION_MAPPED_READS): value 2, want 0 or 1");
    opts[0].value = 1;
    opts[0].reserved = 7;
    EXPECT_ERR(gpuio_engine_create_with_options(NULL, opts, 1, &engine), GPUIO_ERR_INVALID,
               "reserved is 7, must be 0");
    opts[0].reserved = 0;
    opts[1] = opts[0];
    EXPECT_ERR(gpuio_engine_create_with_options(NULL, opts, 2, &engine), GPUIO_ERR_INVALID,
               "options[1]: GPUIO_OPTION_MAPPED_READS is given twice");
    opts[1].key = GPUIO_OPTION_POOL_WAIT_LIMIT_MS;
    opts[1].value = 5;
    EXPECT_ERR(gpuio_engine_create_with_options(NULL, opts, 2, &engine), GPUIO_ERR_INVALID,
               "pool wait limit 5ms is below 10 ms");
    /* Options and settings together: the settings' own checks still run. */
    memset(&s, 0, sizeof s);
    s.chunk_size = 1000;
    opts[1].value = 50;
    EXPECT_ERR(gpuio_engine_create_with_options(&s, opts, 2, &engine), GPUIO_ERR_INVALID,
               "chunk size 1000");
    EXPECT(engine == NULL);
    CHECK(gpuio_engine_create(NULL, &engine));

    /* Opening. */
    gpuio_file *file = NULL;
    EXPECT_ERR(gpuio_open(engine, NULL, GPUIO_OPEN_READ, &file), GPUIO_ERR_INVALID,
               "path is a null pointer");
    EXPECT_ERR(gpuio_open(engine, "", GPUIO_OPEN_READ, &file), GPUIO_ERR_INVALID,
               "path is empty");
    EXPECT_ERR(gpuio_open(engine, path, GPUIO_OPEN_READ, NULL), GPUIO_ERR_INVALID,
               "out is a null pointer");
    EXPECT_ERR(gpuio_open(engine, missing, GPUIO_OPEN_READ, &file), GPUIO_ERR_IO,
               "no-such-file");
    EXPECT(gpuio_last_errno() == ENOENT);
    EXPECT(strstr(gpuio_last_error(), "open") != NULL);
    EXPECT_ERR(gpuio_open(engine, path, 0x100 | GPUIO_OPEN_READ, &file), GPUIO_ERR_INVALID,
               "unknown flag bits 0x100");
    EXPECT_ERR(gpuio_open(engine, path, 0, &file), GPUIO_ERR_INVALID,
               "open needs read and/or write access");
    EXPECT_ERR(gpuio_open(engine, path, GPUIO_OPEN_READ | GPUIO_OPEN_CREATE, &file),
               GPUIO_ERR_INVALID, "create/truncate need write access");
    EXPECT(file == NULL);

    /* Handles that are not live, or of another kind. */
    EXPECT_ERR(gpuio_open((gpuio_engine *)(uintptr_t)0x1234, path, GPUIO_OPEN_READ, &file),
               GPUIO_ERR_BAD_HANDLE, "is not a live gpuio_engine");
    EXPECT_ERR(gpuio_open(NULL, path, GPUIO_OPEN_READ, &file), GPUIO_ERR_INVALID,
               "gpuio_engine is a null pointer");
    CHECK(gpuio_open(engine, path, GPUIO_OPEN_READ, &file));
    EXPECT_ERR(gpuio_engine_free((gpuio_engine *)file), GPUIO_ERR_BAD_HANDLE,
               "is not a live gpuio_engine");
    EXPECT_ERR(gpuio_request_free((gpuio_request *)engine), GPUIO_ERR_BAD_HANDLE,
               "is not a live gpuio_request");
    EXPECT(gpuio_engine_eventfd((gpuio_engine *)file) == -1);
    EXPECT(strstr(gpuio_last_error(), "not a live gpuio_engine") != NULL);

    /* Buffers. */
    uint8_t buf[4096];
    uint64_t n = 0;
    EXPECT_ERR(gpuio_read(file, NULL, 0, &n), GPUIO_ERR_INVALID, "gpuio_buffer is a null pointer");
    gpuio_buffer bad = host_buffer(NULL, 10);
    EXPECT_ERR(gpuio_read(file, &bad, 0, &n), GPUIO_ERR_INVALID, "ptr is null with len 10");
    bad = host_buffer(buf, sizeof buf);
    bad.kind = 7;
    EXPECT_ERR(gpuio_read(file, &bad, 0, &n), GPUIO_ERR_INVALID, "kind 7");
    bad = host_buffer(buf, sizeof buf);
    bad.kind = GPUIO_MEMORY_DEVICE;
    bad.device = -1;
    EXPECT_ERR(gpuio_read(file, &bad, 0, &n), GPUIO_ERR_INVALID, "device -1 is negative");
    /* A host pointer claimed as device memory: refused without CUDA (unsupported) and with it
     * (the driver does not know the address). */
    bad.device = 0;
    gpuio_status st = gpuio_read(file, &bad, 0, &n);
    if (st == GPUIO_ERR_UNSUPPORTED) {
        EXPECT(strstr(gpuio_last_error(), "cuda") || strstr(gpuio_last_error(), "CUDA"));
        printf("ok error GPUIO_ERR_UNSUPPORTED: %s\n", gpuio_last_error());
    } else {
        EXPECT(st == GPUIO_ERR_INVALID);
        EXPECT(strstr(gpuio_last_error(), "is not CUDA device memory"));
        printf("ok error GPUIO_ERR_INVALID: %s\n", gpuio_last_error());
    }

    /* Operations the file or the offsets do not allow: messages name op, path, offset. */
    gpuio_buffer good = host_buffer(buf, sizeof buf);
    EXPECT_ERR(gpuio_write(file, &good, 4096, &n), GPUIO_ERR_INVALID,
               "file was opened without write access");
    EXPECT(strstr(gpuio_last_error(), "write") && strstr(gpuio_last_error(), "errors.bin") &&
           strstr(gpuio_last_error(), "offset 4096"));
    EXPECT_ERR(gpuio_read(file, &good, UINT64_MAX - 5, &n), GPUIO_ERR_INVALID,
               "passes the largest file offset");
    gpuio_request *req = NULL;
    EXPECT_ERR(gpuio_read_async(file, &good, 0, NULL, NULL, NULL), GPUIO_ERR_INVALID,
               "out is a null pointer");
    /* An invalid asynchronous request fails when it completes, with the same message. */
    CHECK(gpuio_write_async(file, &good, 0, NULL, NULL, &req));
    EXPECT_ERR(gpuio_request_wait(req, -1, &n), GPUIO_ERR_INVALID,
               "file was opened without write access");
    CHECK(gpuio_request_free(req));
    EXPECT_ERR(gpuio_request_wait(req, -1, &n), GPUIO_ERR_BAD_HANDLE, "not a live gpuio_request");
    EXPECT_ERR(gpuio_request_free(req), GPUIO_ERR_BAD_HANDLE, "not a live gpuio_request");
    EXPECT_ERR(gpuio_request_wait(NULL, -1, &n), GPUIO_ERR_INVALID,
               "gpuio_request is a null pointer");
    EXPECT_ERR(gpuio_file_size(file, NULL), GPUIO_ERR_INVALID, "size is a null pointer");

    /* Text out: a buffer too small gets what fits and the size needed. */
    char small[8];
    size_t needed = 0;
    EXPECT_ERR(gpuio_engine_backend(engine, small, sizeof small, &needed), GPUIO_ERR_RANGE,
               "too small");
    EXPECT(needed > sizeof small && strlen(small) == sizeof small - 1);
    EXPECT(strcmp(gpuio_status_name(GPUIO_ERR_IO), "GPUIO_ERR_IO") == 0);
    EXPECT(strcmp(gpuio_status_name(12345), "GPUIO_UNKNOWN_STATUS") == 0);
    EXPECT(strcmp(gpuio_status_name(-1), "GPUIO_UNKNOWN_STATUS") == 0);

    /* The check report refuses what it cannot examine. */
    char report[64];
    EXPECT_ERR(gpuio_check(NULL, report, sizeof report, NULL), GPUIO_ERR_INVALID,
               "path is a null pointer");
    EXPECT_ERR(gpuio_check(missing, report, sizeof report, NULL), GPUIO_ERR_IO, "no-such-file");
    EXPECT_ERR(gpuio_check("/dev/null", report, sizeof report, NULL), GPUIO_ERR_INVALID,
               "gpuio check examines regular files, block devices and directories");
    EXPECT_ERR(gpuio_check(path, NULL, 10, NULL), GPUIO_ERR_INVALID,
               "output buffer is a null pointer");
    EXPECT_ERR(gpuio_engine_sizing(NULL, NULL), GPUIO_ERR_INVALID, "out is a null pointer");

    /* Blocking calls inside a callback are refused, not deadlocked. */
    struct in_callback cb = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0,
                             GPUIO_OK, GPUIO_OK, GPUIO_OK, {0}, file, engine};
    CHECK(gpuio_read_async(file, &good, 0, blocking_calls, &cb, &req));
    pthread_mutex_lock(&cb.lock);
    while (!cb.called) pthread_cond_wait(&cb.done, &cb.lock);
    pthread_mutex_unlock(&cb.lock);
    EXPECT(cb.read_status == GPUIO_ERR_WOULD_BLOCK);
    EXPECT(strstr(cb.message, "gpuio_read blocks") != NULL);
    EXPECT(cb.free_engine_status == GPUIO_ERR_WOULD_BLOCK);
    printf("ok error GPUIO_ERR_WOULD_BLOCK: %s\n", cb.message);
    CHECK(gpuio_request_free(req));

    /* Closed and freed handles. */
    CHECK(gpuio_close(file));
    EXPECT_ERR(gpuio_read(file, &good, 0, &n), GPUIO_ERR_BAD_HANDLE, "not a live gpuio_file");
    EXPECT_ERR(gpuio_close(file), GPUIO_ERR_BAD_HANDLE, "not a live gpuio_file");
    CHECK(gpuio_open(engine, path, GPUIO_OPEN_READ, &file));
    CHECK(gpuio_engine_free(engine));
    EXPECT_ERR(gpuio_engine_free(engine), GPUIO_ERR_BAD_HANDLE, "not a live gpuio_engine");
    EXPECT_ERR(gpuio_open(engine, path, GPUIO_OPEN_READ, &file), GPUIO_ERR_BAD_HANDLE,
               "not a live gpuio_engine");
    EXPECT_ERR(gpuio_read(file, &good, 0, &n), GPUIO_ERR_SHUTDOWN, "has been freed");
    CHECK(gpuio_close(file));

    free(missing);
    free(path);
    printf("PASS errors\n");
    return 0;
}
