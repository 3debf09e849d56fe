/* Synchronous calls: engine settings, open flags, reads (whole, short at end of file, at end
 * of file, O_DIRECT at odd offsets), writes (and reading them back), size, fsync. */
#include <sys/syscall.h>

#include "common.h"

/* Drops `path`'s pages, reads it whole with `e` into `buf` (checking the bytes), and returns
 * how many of its pages the page cache holds afterwards (cachestat(2)); -1 where the cache
 * cannot be seen empty first (no cachestat, a filesystem that keeps its pages, no O_DIRECT). */
static long cold_then_cached_after(gpuio_engine *e, const char *path, unsigned char *buf,
                                   size_t len) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return -1;
    struct { uint64_t off, len; } range = {0, len};
    uint64_t stat[5] = {0};
    fsync(fd);
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    int direct = open(path, O_RDONLY | O_DIRECT);
    if (direct >= 0) close(direct);
    if (direct < 0 || syscall(451, fd, &range, stat, 0) != 0 || stat[0] != 0) {
        close(fd);
        return -1;
    }
    gpuio_file *f = NULL;
    size_t n = 0;
    CHECK(gpuio_open(e, path, GPUIO_OPEN_READ, &f));
    gpuio_buffer all = host_buffer(buf, len);
    CHECK(gpuio_read(f, &all, 0, &n));
    EXPECT(n == len);
    expect_pattern(buf, 0, len);
    CHECK(gpuio_close(f));
    EXPECT(syscall(451, fd, &range, stat, 0) == 0);
    close(fd);
    return (long)stat[0];
}

int main(int argc, char **argv) {
    if (argc != 2) FAIL("usage: %s DIR", argv[0]);
    const size_t len = (3u << 20) + 12345; /* not a multiple of any block */
    char *path = join(argv[1], "sync.bin");
    make_file(path, len);

    EXPECT(strlen(gpuio_version()) > 0);
    printf("version %s\n", gpuio_version());

    gpuio_engine *engine = NULL;
    CHECK(gpuio_engine_create(NULL, &engine));
    char backend[256];
    size_t needed = 0;
    CHECK(gpuio_engine_backend(engine, backend, sizeof backend, &needed));
    EXPECT(needed == strlen(backend) + 1);
    printf("backend %s\n", backend);

    gpuio_file *file = NULL;
    CHECK(gpuio_open(engine, path, GPUIO_OPEN_READ, &file));
    uint64_t size = 0;
    CHECK(gpuio_file_size(file, &size));
    EXPECT(size == len);

    uint8_t *buf = malloc(len);
    gpuio_buffer whole = host_buffer(buf, len);
    uint64_t n = 0;
    CHECK(gpuio_read(file, &whole, 0, &n));
    EXPECT(n == len);
    expect_pattern(buf, 0, len);
    printf("ok read whole file %llu bytes\n", (unsigned long long)n);

    /* Past the end: a short count, then 0. */
    gpuio_buffer tail = host_buffer(buf, 8192);
    CHECK(gpuio_read(file, &tail, len - 100, &n));
    EXPECT(n == 100);
    expect_pattern(buf, len - 100, 100);
    CHECK(gpuio_read(file, &tail, len, &n));
    EXPECT(n == 0);
    printf("ok short read at end of file\n");

    /* A zero-length read with a null pointer is fine. */
    gpuio_buffer empty = host_buffer(NULL, 0);
    CHECK(gpuio_read(file, &empty, 7, &n));
    EXPECT(n == 0);
    CHECK(gpuio_close(file));

    /* O_DIRECT at an unaligned offset and length, on an engine with non-default settings. */
    gpuio_engine_settings s;
    memset(&s, 0, sizeof s);
    s.backend = GPUIO_BACKEND_PREAD;
    s.chunk_size = 64 << 10;
    s.queue_depth = 8;
    s.bounce_slots = 16;
    s.executor_threads = 2;
    gpuio_engine *pread_engine = NULL;
    CHECK(gpuio_engine_create(&s, &pread_engine));
    CHECK(gpuio_engine_backend(pread_engine, backend, sizeof backend, NULL));
    EXPECT(strncmp(backend, "pread", 5) == 0);
    gpuio_status st = gpuio_open(pread_engine, path, GPUIO_OPEN_READ | GPUIO_OPEN_DIRECT, &file);
    if (st == GPUIO_OK) {
        gpuio_buffer odd = host_buffer(buf + 3, 1000001);
        CHECK(gpuio_read(file, &odd, 4097, &n));
        EXPECT(n == 1000001);
        expect_pattern(buf + 3, 4097, 1000001);
        CHECK(gpuio_close(file));
        printf("ok O_DIRECT read at offset 4097, 1000001 bytes\n");
    } else {
        /* tmpfs has no O_DIRECT: say so rather than pass silently. */
        printf("SKIPPED O_DIRECT read: %s\n", gpuio_last_error());
    }

    /* Writes: a new file, written at odd offsets, read back. */
    for (size_t i = 0; i < len; i++) buf[i] = pattern_at(i);
    char *out = join(argv[1], "sync-out.bin");
    CHECK(gpuio_open(pread_engine, out,
                     GPUIO_OPEN_READ | GPUIO_OPEN_WRITE | GPUIO_OPEN_CREATE | GPUIO_OPEN_TRUNCATE,
                     &file));
    gpuio_buffer first = host_buffer(buf, 300000);
    CHECK(gpuio_write(file, &first, 0, &n));
    EXPECT(n == 300000);
    gpuio_buffer second = host_buffer(buf + 300000, 77777);
    CHECK(gpuio_write(file, &second, 300000, &n));
    EXPECT(n == 77777);
    CHECK(gpuio_fsync(file));
    CHECK(gpuio_file_size(file, &size));
    EXPECT(size == 377777);
    uint8_t *back = calloc(1, 377777);
    gpuio_buffer back_buf = host_buffer(back, 377777);
    CHECK(gpuio_read(file, &back_buf, 0, &n));
    EXPECT(n == 377777);
    expect_pattern(back, 0, 377777);
    CHECK(gpuio_close(file));
    printf("ok write at two offsets, fsync, read back\n");

    /* Sizing: the defaults come from the machine; settings override them. */
    gpuio_sizing sz;
    CHECK(gpuio_engine_sizing(NULL, &sz));
    EXPECT(sz.queue_depth >= 64 && sz.buffered_chunk > 0 && sz.direct_chunk > 0);
    EXPECT(sz.bounce_block >= sz.buffered_chunk && sz.bounce_block >= sz.direct_chunk);
    EXPECT(sz.bounce_bytes >= sz.bounce_block);
    CHECK(gpuio_engine_sizing(&s, &sz));
    EXPECT(sz.buffered_chunk == 64 << 10 && sz.direct_chunk == 64 << 10);
    EXPECT(sz.queue_depth == 8 && sz.bounce_bytes == 16 * (64 << 10));
    printf("ok sizing: defaults and overrides\n");

    /* The check report, as `gpuio check DIR` prints it: ask the size, then fetch it. */
    size_t report_len = 0;
    EXPECT(gpuio_check(argv[1], NULL, 0, &report_len) == GPUIO_ERR_RANGE);
    char *report = malloc(report_len);
    CHECK(gpuio_check(argv[1], report, report_len, NULL));
    EXPECT(strlen(report) + 1 == report_len);
    EXPECT(strstr(report, "gpuio ") && strstr(report, "io_uring"));
    printf("ok check report, %zu bytes:\n%s\n", report_len, report);
    free(report);

    /* Residency-aware reads: a cold file read with the defaults stays out of the page cache
     * (its pieces went O_DIRECT); with no_residency it is read through the page cache. */
    for (int off = 0; off <= 1; off++) {
        gpuio_engine_settings r;
        memset(&r, 0, sizeof r);
        r.no_residency = (uint32_t)off;
        gpuio_engine *re = NULL;
        CHECK(gpuio_engine_create(&r, &re));
        long cached = cold_then_cached_after(re, path, buf, len);
        CHECK(gpuio_engine_free(re));
        if (cached < 0) {
            printf("SKIPPED residency (no_residency=%d): the page cache cannot be seen empty "
                   "here (tmpfs, no cachestat, or no O_DIRECT)\n", off);
            continue;
        }
        long pages = (long)((len + 4095) / 4096);
        if (off) EXPECT(cached == pages);
        else EXPECT(cached * 10 < pages);
        printf("ok residency no_residency=%d: %ld of %ld pages cached after the read\n", off,
               cached, pages);
    }

    /* Options beyond the settings struct: each engine reads the (now cached) file whole and
     * at an odd offset, the same bytes whatever path its options choose: the polling thread's
     * copy up to 64 MiB, only small reads there (64 KiB), or every read through the reactor
     * with two page-cache copies and no reactor tick, or through three reactors taking the
     * pieces in turn. */
    const gpuio_engine_option sets[4][3] = {
        {{GPUIO_OPTION_PAGE_CACHE_READ_MAX, 0, 64u << 20}},
        {{GPUIO_OPTION_PAGE_CACHE_READ_MAX, 0, 64u << 10}, {GPUIO_OPTION_IOWQ_WORKERS, 0, 4}},
        {{GPUIO_OPTION_PAGE_CACHE_FAST_PATH, 0, 0}, {GPUIO_OPTION_PAGE_CACHE_COPIES, 0, 2},
         {GPUIO_OPTION_REACTOR_TICK_US, 0, 0}},
        {{GPUIO_OPTION_PAGE_CACHE_FAST_PATH, 0, 0}, {GPUIO_OPTION_REACTORS, 0, 3}},
    };
    const size_t counts[4] = {1, 2, 3, 2};
    for (int i = 0; i < 4; i++) {
        gpuio_engine *oe = NULL;
        CHECK(gpuio_engine_create_with_options(NULL, sets[i], counts[i], &oe));
        gpuio_file *of = NULL;
        CHECK(gpuio_open(oe, path, GPUIO_OPEN_READ, &of));
        memset(buf, 0, len);
        CHECK(gpuio_read(of, &whole, 0, &n));
        EXPECT(n == len);
        expect_pattern(buf, 0, len);
        gpuio_buffer part = host_buffer(buf, 1000001);
        CHECK(gpuio_read(of, &part, 4097, &n));
        EXPECT(n == 1000001);
        expect_pattern(buf, 4097, 1000001);
        CHECK(gpuio_close(of));
        CHECK(gpuio_engine_free(oe));
    }
    /* No options is gpuio_engine_create. */
    gpuio_engine *none = NULL;
    CHECK(gpuio_engine_create_with_options(NULL, NULL, 0, &none));
    CHECK(gpuio_engine_free(none));
    printf("ok engines with options read the same bytes\n");

    CHECK(gpuio_engine_free(pread_engine));
    CHECK(gpuio_engine_free(engine));
    free(back);
    free(buf);
    free(out);
    free(path);
    printf("PASS sync\n");
    return 0;
}
