/* Device memory through the C API, with CUDA loaded by dlopen: reads into device memory with
 * no stream (complete when the data is there) and on a caller's stream (complete when queued;
 * the caller synchronises), writes from device memory, a batch into device memory, and the
 * checks on device ranges. Without a GPU it prints SKIPPED and why. */
#include "common.h"
#include "cuda_loader.h"

#define CU(call)                                                            \
    do {                                                                    \
        cu_result r_ = (call);                                              \
        if (r_) FAIL("%s -> CUresult %d", #call, r_);                       \
    } while (0)

static gpuio_buffer device_buffer(cu_ptr ptr, size_t len, cu_stream stream) {
    gpuio_buffer b;
    memset(&b, 0, sizeof b);
    b.ptr = (void *)(uintptr_t)ptr;
    b.len = len;
    b.kind = GPUIO_MEMORY_DEVICE;
    b.device = 0;
    b.stream = stream;
    return b;
}

int main(int argc, char **argv) {
    if (argc != 2) FAIL("usage: %s DIR", argv[0]);
    if (cuda_load(0)) {
        printf("SKIPPED: %s\n", cuda_why);
        printf("PASS device\n");
        return 0;
    }
    const size_t len = (8u << 20) + 4321;
    char *path = join(argv[1], "device.bin");
    make_file(path, len);
    gpuio_engine *engine = NULL;
    CHECK(gpuio_engine_create(NULL, &engine));
    gpuio_file *file = NULL;
    CHECK(gpuio_open(engine, path, GPUIO_OPEN_READ, &file));
    uint8_t *host = malloc(len);
    cu_ptr dev = 0;
    CU(cu.mem_alloc(&dev, len));

    /* No stream: the data is in device memory when the call returns. */
    CU(cu.memset_d8(dev, 0, len));
    CU(cu.ctx_synchronize()); /* the memset is asynchronous; gpuio's stream may not wait for it */
    gpuio_buffer d = device_buffer(dev, len, NULL);
    uint64_t n = 0;
    CHECK(gpuio_read(file, &d, 0, &n));
    EXPECT(n == len);
    CU(cu.memcpy_dtoh(host, dev, len));
    expect_pattern(host, 0, len);
    printf("ok device read, no stream: %llu bytes\n", (unsigned long long)n);

    /* On the caller's stream, asynchronously: complete once queued; synchronise, then look. */
    cu_stream stream = NULL;
    CU(cu.stream_create(&stream, 1 /* CU_STREAM_NON_BLOCKING */));
    CU(cu.memset_d8(dev, 0, len));
    CU(cu.ctx_synchronize()); /* the memset is asynchronous; gpuio's stream may not wait for it */
    d = device_buffer(dev + 1000, len - 1000, stream);
    gpuio_request *req = NULL;
    CHECK(gpuio_read_async(file, &d, 77, NULL, NULL, &req));
    CHECK(gpuio_request_wait(req, -1, &n));
    CHECK(gpuio_request_free(req));
    EXPECT(n == len - 1000);
    CU(cu.stream_synchronize(stream));
    CU(cu.memcpy_dtoh(host, dev + 1000, len - 1000));
    expect_pattern(host, 77, len - 1000);
    printf("ok device read on a stream, async\n");

    /* Write from device memory, read back through the host. */
    char *out = join(argv[1], "device-out.bin");
    gpuio_file *wf = NULL;
    CHECK(gpuio_open(engine, out, GPUIO_OPEN_READ | GPUIO_OPEN_WRITE | GPUIO_OPEN_CREATE, &wf));
    for (size_t i = 0; i < len; i++) host[i] = pattern_at(i);
    CU(cu.memcpy_htod(dev, host, len));
    CU(cu.ctx_synchronize());
    d = device_buffer(dev, len, stream);
    CHECK(gpuio_write(wf, &d, 0, &n));
    EXPECT(n == len);
    memset(host, 0, len);
    gpuio_buffer h = host_buffer(host, len);
    CHECK(gpuio_read(wf, &h, 0, &n));
    EXPECT(n == len);
    expect_pattern(host, 0, len);
    CHECK(gpuio_close(wf));
    printf("ok device write\n");

    /* A batch into device memory. */
    gpuio_batch_desc descs[] = {{file, 4096, 4096, 0}, {file, 12345, 5000, 4096}};
    CU(cu.memset_d8(dev, 0, len));
    CU(cu.ctx_synchronize()); /* the memset is asynchronous; gpuio's stream may not wait for it */
    d = device_buffer(dev, 9096, NULL);
    gpuio_batch_result results[2];
    uint64_t total = 0;
    CHECK(gpuio_read_batch(descs, 2, &d, results, &total));
    EXPECT(total == 9096);
    CU(cu.memcpy_dtoh(host, dev, 9096));
    expect_pattern(host, 4096, 4096);
    expect_pattern(host + 4096, 12345, 5000);
    printf("ok device batch\n");

    /* Ranges the driver does not vouch for are refused before any copy. */
    /* Far past the end: the driver may round an allocation up, never by 64 MiB. */
    d = device_buffer(dev + len - 10, 64u << 20, NULL);
    EXPECT_ERR(gpuio_read(file, &d, 0, &n), GPUIO_ERR_INVALID, "runs past its allocation");
    d = device_buffer((cu_ptr)(uintptr_t)host, 100, NULL);
    EXPECT_ERR(gpuio_read(file, &d, 0, &n), GPUIO_ERR_INVALID,
               "is not CUDA device memory");
    d = device_buffer(dev, 100, NULL);
    d.device = 99;
    EXPECT_ERR(gpuio_read(file, &d, 0, &n), GPUIO_ERR_UNSUPPORTED, "no GPU 99");

    CU(cu.stream_destroy(stream));
    CU(cu.mem_free(dev));
    CHECK(gpuio_close(file));
    CHECK(gpuio_engine_free(engine));
    free(host);
    free(out);
    free(path);
    printf("PASS device\n");
    return 0;
}
