/* Batches: scattered pages of two files into one host buffer (contiguous neighbours merge),
 * short reads at end of file, per-descriptor failures, the asynchronous form. */
#include "common.h"

#define PAGE 4096u

int main(int argc, char **argv) {
    if (argc != 2) FAIL("usage: %s DIR", argv[0]);
    char *a_path = join(argv[1], "batch-a.bin");
    char *b_path = join(argv[1], "batch-b.bin");
    const size_t a_len = 64 * PAGE, b_len = 10 * PAGE + 123;
    make_file(a_path, a_len);
    make_file(b_path, b_len);
    gpuio_engine *engine = NULL;
    CHECK(gpuio_engine_create(NULL, &engine));
    gpuio_file *a = NULL, *b = NULL;
    CHECK(gpuio_open(engine, a_path, GPUIO_OPEN_READ, &a));
    CHECK(gpuio_open(engine, b_path, GPUIO_OPEN_READ, &b));

    /* Pages 3, 4 (contiguous in file and destination: one read), 9 of a; the last page of b,
     * which ends 123 bytes in (a short read); 100 bytes of a at an odd offset. */
    gpuio_batch_desc descs[] = {
        {a, 3 * PAGE, PAGE, 0},
        {a, 4 * PAGE, PAGE, PAGE},
        {a, 9 * PAGE, PAGE, 2 * PAGE},
        {b, 10 * PAGE, PAGE, 3 * PAGE},
        {a, 12345, 100, 4 * PAGE},
    };
    const size_t count = sizeof descs / sizeof descs[0];
    const size_t dst_len = 4 * PAGE + 100;
    uint8_t *dst = calloc(1, dst_len);
    gpuio_buffer d = host_buffer(dst, dst_len);
    gpuio_batch_result results[5];
    uint64_t total = 0;
    CHECK(gpuio_read_batch(descs, count, &d, results, &total));
    EXPECT(total == 3 * PAGE + 123 + 100);
    uint64_t want[] = {PAGE, PAGE, PAGE, 123, 100};
    for (size_t i = 0; i < count; i++) {
        EXPECT(results[i].status == GPUIO_OK);
        EXPECT(results[i].bytes == want[i]);
        expect_pattern(dst + descs[i].dst_offset, descs[i].offset, want[i]);
    }
    printf("ok batch into host memory: %zu descriptors, %llu bytes\n", count,
           (unsigned long long)total);

    /* The same batch, asynchronously; the descriptors may go at once. */
    memset(dst, 0, dst_len);
    gpuio_batch_desc *copy = malloc(sizeof descs);
    memcpy(copy, descs, sizeof descs);
    gpuio_request *req = NULL;
    CHECK(gpuio_read_batch_async(copy, count, &d, results, NULL, NULL, &req));
    free(copy);
    CHECK(gpuio_request_wait(req, -1, &total));
    CHECK(gpuio_request_free(req));
    EXPECT(total == 3 * PAGE + 123 + 100);
    for (size_t i = 0; i < count; i++) {
        EXPECT(results[i].status == GPUIO_OK && results[i].bytes == want[i]);
        expect_pattern(dst + descs[i].dst_offset, descs[i].offset, want[i]);
    }
    printf("ok batch async\n");

    /* A descriptor overlapping another's destination, one past the destination's end: each
     * fails alone with its reason; the others are read. */
    gpuio_batch_desc mixed[] = {
        {a, 0, PAGE, 0},
        {a, PAGE, PAGE, PAGE / 2},      /* overlaps descriptor 0's destination */
        {a, 2 * PAGE, PAGE, 4 * PAGE},  /* ends past dst_len */
        {a, 5 * PAGE, 100, 2 * PAGE},
    };
    memset(dst, 0, dst_len);
    EXPECT_ERR(gpuio_read_batch(mixed, 4, &d, results, &total), GPUIO_ERR_INVALID,
               "batch descriptor 1");
    EXPECT(strstr(gpuio_last_error(), "overlaps descriptor 0"));
    EXPECT(results[0].status == GPUIO_OK && results[0].bytes == PAGE);
    EXPECT(results[1].status == GPUIO_ERR_INVALID && results[1].bytes == 0);
    EXPECT(results[2].status == GPUIO_ERR_INVALID);
    EXPECT(results[3].status == GPUIO_OK && results[3].bytes == 100);
    expect_pattern(dst, 0, PAGE);
    expect_pattern(dst + 2 * PAGE, 5 * PAGE, 100);

    /* Malformed batches. */
    EXPECT_ERR(gpuio_read_batch(descs, 0, &d, NULL, NULL), GPUIO_ERR_INVALID,
               "batch of 0 descriptors");
    EXPECT_ERR(gpuio_read_batch(NULL, 3, &d, NULL, NULL), GPUIO_ERR_INVALID, "null pointer");
    gpuio_batch_desc dead[] = {{a, 0, PAGE, 0}, {NULL, 0, PAGE, PAGE}};
    EXPECT_ERR(gpuio_read_batch(dead, 2, &d, NULL, NULL), GPUIO_ERR_INVALID,
               "batch descriptor 1: gpuio_file is a null pointer");
    EXPECT_ERR(gpuio_read_batch(descs, count, NULL, NULL, NULL), GPUIO_ERR_INVALID,
               "gpuio_buffer is a null pointer");
    EXPECT_ERR(gpuio_read_batch_async(descs, count, &d, NULL, NULL, NULL, NULL),
               GPUIO_ERR_INVALID, "out is a null pointer");

    CHECK(gpuio_close(a));
    CHECK(gpuio_close(b));
    CHECK(gpuio_engine_free(engine));
    free(dst);
    free(a_path);
    free(b_path);
    printf("PASS batch\n");
    return 0;
}
