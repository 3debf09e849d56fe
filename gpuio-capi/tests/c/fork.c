/* An engine inherited across fork() (issue 40): the child has none of the engine's threads.
 * Every call on it fails at once with GPUIO_ERR_UNSUPPORTED naming fork() (sync reads,
 * async requests, opens), freeing it in the child returns at once, and a new engine made in
 * the child works. The parent's engine is untouched. Before, the child waited for good.
 * No request is in flight at the fork: one completing at that instant may leave a lock of the
 * C API held in the child by a thread that does not exist there (RELIABILITY.md, issue 40).
 * Built without AddressSanitizer only: its allocator is not fork-safe (tests/c_api.rs). */
#include <signal.h>
#include <sys/wait.h>

#include "common.h"

static int child(gpuio_engine *engine, gpuio_file *file, const char *path, size_t len) {
    uint8_t *buf = malloc(len);
    if (!buf) FAIL("malloc");
    gpuio_buffer b = host_buffer(buf, len);
    size_t n = 0;
    EXPECT_ERR(gpuio_read(file, &b, 0, &n), GPUIO_ERR_UNSUPPORTED, "fork()");
    gpuio_request *req = NULL;
    EXPECT_ERR(gpuio_read_async(file, &b, 0, NULL, NULL, &req), GPUIO_ERR_UNSUPPORTED,
               "fork()");
    gpuio_file *again = NULL;
    EXPECT_ERR(gpuio_open(engine, path, GPUIO_OPEN_READ, &again), GPUIO_ERR_UNSUPPORTED,
               "fork()");
    CHECK(gpuio_close(file));
    CHECK(gpuio_engine_free(engine));
    printf("ok child: the inherited engine refuses and frees\n");
    gpuio_engine *fresh = NULL;
    gpuio_file *f = NULL;
    CHECK(gpuio_engine_create(NULL, &fresh));
    CHECK(gpuio_open(fresh, path, GPUIO_OPEN_READ, &f));
    CHECK(gpuio_read(f, &b, 0, &n));
    EXPECT(n == len);
    expect_pattern(buf, 0, len);
    CHECK(gpuio_close(f));
    CHECK(gpuio_engine_free(fresh));
    printf("ok child: a new engine works\n");
    fflush(stdout);
    free(buf);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 2) FAIL("usage: %s DIR", argv[0]);
    const size_t len = 1u << 20;
    char *path = join(argv[1], "fork.bin");
    make_file(path, len);
    gpuio_engine *engine = NULL;
    gpuio_file *file = NULL;
    CHECK(gpuio_engine_create(NULL, &engine));
    CHECK(gpuio_open(engine, path, GPUIO_OPEN_READ, &file));
    uint8_t *buf = malloc(len);
    if (!buf) FAIL("malloc");
    gpuio_buffer b = host_buffer(buf, len);
    size_t n = 0;
    CHECK(gpuio_read(file, &b, 0, &n));
    EXPECT(n == len);

    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) FAIL("fork: %s", strerror(errno));
    if (pid == 0) {
        alarm(30); /* a hang fails the child instead of the suite */
        _exit(child(engine, file, path, len));
    }
    int status = 0;
    if (waitpid(pid, &status, 0) != pid) FAIL("waitpid: %s", strerror(errno));
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        FAIL("the child failed (status %#x%s)", status,
             WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM ? ": it hung" : "");

    memset(buf, 0, len);
    CHECK(gpuio_read(file, &b, 0, &n));
    EXPECT(n == len);
    expect_pattern(buf, 0, len);
    printf("ok parent: its engine goes on\n");
    CHECK(gpuio_close(file));
    CHECK(gpuio_engine_free(engine));
    free(buf);
    free(path);
    printf("PASS fork\n");
    return 0;
}
