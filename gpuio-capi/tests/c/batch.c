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
    total = 12345;
    EXPECT_ERR(gpuio_read_batch(mixed, 4, &d, results, &total), GPUIO_ERR_INVALID,
               "batch descriptor 1");
    EXPECT(total == PAGE + 100); /* what the others read, though the call failed */
    EXPECT(strstr(gpuio_last_error(), "overlaps descriptor 0"));
    EXPECT(results[0].status == GPUIO_OK && results[0].bytes == PAGE);
    EXPECT(results[1].status == GPUIO_ERR_INVALID && results[1].bytes == 0);
    EXPECT(results[2].status == GPUIO_ERR_INVALID);
    EXPECT(results[3].status == GPUIO_OK && results[3].bytes == 100);
    expect_pattern(dst, 0, PAGE);
    expect_pattern(dst + 2 * PAGE, 5 * PAGE, 100);

    /* A descriptor naming no file or a closed one fails alone, like the ones above: every
     * result is written, the others are read, and the total counts what they read. */
    gpuio_file *closed = NULL;
    CHECK(gpuio_open(engine, a_path, GPUIO_OPEN_READ, &closed));
    CHECK(gpuio_close(closed));
    gpuio_batch_desc dead[] = {
        {a, 0, PAGE, 0},
        {NULL, 0, PAGE, PAGE},
        {closed, 0, PAGE, 2 * PAGE},
        {a, 7 * PAGE, 100, 3 * PAGE},
    };
    memset(dst, 0, dst_len);
    memset(results, 0xAB, sizeof results);
    total = 12345;
    EXPECT_ERR(gpuio_read_batch(dead, 4, &d, results, &total), GPUIO_ERR_INVALID,
               "batch descriptor 1: gpuio_file is a null pointer");
    EXPECT(results[0].status == GPUIO_OK && results[0].bytes == PAGE);
    EXPECT(results[1].status == GPUIO_ERR_INVALID && results[1].bytes == 0);
    EXPECT(results[2].status == GPUIO_ERR_BAD_HANDLE && results[2].bytes == 0);
    EXPECT(results[3].status == GPUIO_OK && results[3].bytes == 100);
    EXPECT(total == PAGE + 100);
    expect_pattern(dst, 0, PAGE);
    expect_pattern(dst + 3 * PAGE, 7 * PAGE, 100);
    /* Asynchronously the same, the results written by the time the request completes. */
    memset(results, 0xAB, sizeof results);
    CHECK(gpuio_read_batch_async(dead, 4, &d, results, NULL, NULL, &req));
    EXPECT_ERR(gpuio_request_wait(req, -1, &total), GPUIO_ERR_INVALID,
               "batch descriptor 1: gpuio_file is a null pointer");
    CHECK(gpuio_request_free(req));
    EXPECT(results[0].status == GPUIO_OK && results[0].bytes == PAGE);
    EXPECT(results[1].status == GPUIO_ERR_INVALID && results[1].bytes == 0);
    EXPECT(results[2].status == GPUIO_ERR_BAD_HANDLE && results[2].bytes == 0);
    EXPECT(results[3].status == GPUIO_OK && results[3].bytes == 100);
    /* Only dead descriptors: nothing to read, each says why. */
    memset(results, 0xAB, sizeof results);
    total = 12345;
    EXPECT_ERR(gpuio_read_batch(dead + 1, 2, &d, results, &total), GPUIO_ERR_INVALID,
               "batch descriptor 0: gpuio_file is a null pointer");
    EXPECT(results[0].status == GPUIO_ERR_INVALID && results[0].bytes == 0);
    EXPECT(results[1].status == GPUIO_ERR_BAD_HANDLE && results[1].bytes == 0);
    EXPECT(total == 0);
    printf("ok batch with dead files: every result written\n");

    /* A batch refused as a whole (here: no destination) still writes every result, with the
     * refusal's status, and a total of 0. */
    memset(results, 0xAB, sizeof results);
    total = 12345;
    EXPECT_ERR(gpuio_read_batch(descs, count, NULL, results, &total), GPUIO_ERR_INVALID,
               "gpuio_buffer is a null pointer");
    for (size_t i = 0; i < count; i++)
        EXPECT(results[i].status == GPUIO_ERR_INVALID && results[i].bytes == 0);
    EXPECT(total == 0);
    memset(results, 0xAB, sizeof results);
    EXPECT_ERR(gpuio_read_batch(NULL, 3, &d, results, NULL), GPUIO_ERR_INVALID, "null pointer");
    for (size_t i = 0; i < 3; i++) EXPECT(results[i].status == GPUIO_ERR_INVALID);
    memset(results, 0xAB, sizeof results);
    EXPECT_ERR(gpuio_read_batch_async(descs, count, NULL, results, NULL, NULL, &req),
               GPUIO_ERR_INVALID, "gpuio_buffer is a null pointer");
    for (size_t i = 0; i < count; i++) EXPECT(results[i].status == GPUIO_ERR_INVALID);
    printf("ok batch refused: every result written\n");

    /* Counts no descriptor array can have: refused before anything is allocated or read,
     * without a panic (c_api.rs checks stderr), the results left alone (no array of that
     * many exists), the total 0. */
    const size_t absurd[] = {SIZE_MAX, SIZE_MAX / sizeof(gpuio_batch_desc) + 1};
    for (size_t i = 0; i < 2; i++) {
        memset(results, 0xAB, sizeof results);
        total = 12345;
        EXPECT_ERR(gpuio_read_batch(descs, absurd[i], &d, results, &total), GPUIO_ERR_INVALID,
                   "descriptors is more than any array holds");
        EXPECT(total == 0);
        EXPECT(results[0].bytes == 0xABABABABABABABABull);
        req = NULL;
        EXPECT_ERR(gpuio_read_batch_async(descs, absurd[i], &d, results, NULL, NULL, &req),
                   GPUIO_ERR_INVALID, "descriptors is more than any array holds");
        EXPECT(req == NULL);
    }

    /* Malformed batches. */
    total = 12345;
    EXPECT_ERR(gpuio_read_batch(descs, 0, &d, NULL, &total), GPUIO_ERR_INVALID,
               "batch of 0 descriptors");
    EXPECT(total == 0);
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
