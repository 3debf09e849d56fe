"""Host memory: the buffer protocol (bytearray, numpy, memoryview), writes, batches, and
bad input that must fail clearly and change nothing."""

import asyncio
import os

import numpy as np
import pytest

import gpuio


def test_bytearray_whole_file(engine, data_file):
    path, data = data_file
    f = engine.open(path)
    assert f.size() == len(data)
    buf = bytearray(len(data))
    assert f.read_into(buf) == len(data)
    assert bytes(buf) == data


@pytest.mark.parametrize("direct", [False, True])
def test_numpy_any_offset_and_dtype(engine, data_file, direct):
    path, data = data_file
    f = engine.open(path, direct=direct)
    assert f.direct == direct
    for offset, count, dtype in [(0, 1, np.uint8), (4095, 4097, np.float32), (7, 100_000, np.int64)]:
        arr = np.zeros(count, dtype=dtype)
        n = f.read_into(arr, offset)
        assert n == arr.nbytes
        assert arr.tobytes() == data[offset : offset + n]


def test_memoryview_slice_lands_in_place(engine, data_file):
    path, data = data_file
    f = engine.open(path)
    buf = bytearray(b"\xee" * 64)
    assert f.read_into(memoryview(buf)[16:48], 100) == 32
    assert buf[:16] == b"\xee" * 16 and buf[48:] == b"\xee" * 16
    assert bytes(buf[16:48]) == data[100:132]


def test_short_count_at_end_of_file(engine, data_file):
    path, data = data_file
    f = engine.open(path)
    buf = bytearray(b"\x01" * 1000)
    n = f.read_into(buf, len(data) - 10)
    assert n == 10
    assert bytes(buf[:10]) == data[-10:]
    assert bytes(buf[10:]) == b"\x01" * 990
    assert f.read_into(bytearray(8), len(data) + 5) == 0


def test_write_then_read_back(engine, tmpdir_path):
    path = os.path.join(tmpdir_path, "out.bin")
    f = engine.open(path, write=True, create=True, truncate=True)
    src = np.arange(300_000, dtype=np.int32)
    assert f.write_from(src, 3) == src.nbytes
    assert f.write_from(b"abc", 0) == 3
    f.sync_all()
    with open(path, "rb") as g:
        on_disk = g.read()
    assert on_disk[:3] == b"abc" and on_disk[3:] == src.tobytes()
    back = np.zeros_like(src)
    assert f.read_into(back, 3) == src.nbytes
    assert np.array_equal(back, src)


def test_read_batch_places_each_range(engine, data_file):
    path, data = data_file
    f = engine.open(path)
    dst = bytearray(30)
    got = f.read_batch([(0, 10, 20), (10, 10, 10), (len(data) - 4, 10, 0)], dst)
    assert got == [10, 10, 4]
    assert bytes(dst[20:30]) == data[0:10]
    assert bytes(dst[10:20]) == data[10:20]
    assert bytes(dst[0:4]) == data[-4:]


def test_read_only_destination_is_refused(engine, data_file):
    path, _ = data_file
    f = engine.open(path)
    frozen = np.zeros(16, dtype=np.uint8)
    frozen.flags.writeable = False
    for dst in [b"0123456789", frozen, memoryview(b"xyz")]:
        with pytest.raises(gpuio.InvalidInput, match="read-only"):
            f.read_into(dst)
    assert not frozen.any()


def test_non_contiguous_destination_is_refused(engine, data_file):
    path, _ = data_file
    f = engine.open(path)
    arr = np.zeros((8, 8), dtype=np.uint8)
    with pytest.raises(gpuio.InvalidInput, match="not C-contiguous"):
        f.read_into(arr[:, ::2])
    with pytest.raises(gpuio.InvalidInput, match="not C-contiguous"):
        f.read_into(arr.T)
    assert not arr.any(), "a refused read wrote nothing"


def test_not_memory_is_a_type_error(engine, data_file):
    f = engine.open(data_file[0])
    for dst in [123, "text", [1, 2, 3], None]:
        with pytest.raises(TypeError, match="not memory gpuio can use"):
            f.read_into(dst)


def test_errors_carry_op_path_offset_backend(engine, data_file):
    path, _ = data_file
    f = engine.open(path)
    with pytest.raises(gpuio.InvalidInput) as e:
        f.write_from(b"abc", 42)
    assert isinstance(e.value, ValueError) and isinstance(e.value, gpuio.Error)
    assert (e.value.op, e.value.path, e.value.offset) == ("write", path, 42)
    assert e.value.backend in ("io_uring", "pread")
    assert path in str(e.value) and "42" in str(e.value)
    with pytest.raises(gpuio.InvalidInput, match="largest file offset"):
        f.read_into(bytearray(16), 2**63 - 4)


def test_missing_file_is_an_os_error(engine, tmpdir_path):
    missing = os.path.join(tmpdir_path, "missing.bin")
    with pytest.raises(OSError) as e:
        engine.open(missing)
    assert isinstance(e.value, gpuio.IoError)
    assert e.value.errno == 2 and e.value.filename == missing
    assert e.value.op == "open"


def test_bad_engine_settings_are_refused():
    with pytest.raises(gpuio.InvalidInput, match="chunk size"):
        gpuio.Engine(chunk_size=1000)
    with pytest.raises(gpuio.InvalidInput, match="unknown backend"):
        gpuio.Engine(backend="floppy")
    with pytest.raises(gpuio.InvalidInput, match="negative"):
        gpuio.Engine(async_copy_threshold=-5)
    with pytest.raises(gpuio.InvalidInput, match="page_cache_copies 0"):
        gpuio.Engine(page_cache_copies=0)
    with pytest.raises(gpuio.InvalidInput, match="copies_per_device 0"):
        gpuio.Engine(copies_per_device=0)
    with pytest.raises(ValueError, match="submission_polling"):
        gpuio.Engine(submission_polling=-1.0)
    with pytest.raises(gpuio.InvalidInput, match="reactors 0"):
        gpuio.Engine(reactors=0)


def test_fast_path_and_submission_polling_settings_read_the_same_bytes(data_file):
    # Every small read through the reactor (no page-cache fast path), with a kernel thread
    # polling the ring where the kernel allows it (else the ring is set up without it and the
    # backend's detail says why): the bytes are the same either way, and no read was served
    # from the page cache in poll.
    path, data = data_file
    with gpuio.Engine(page_cache_fast_path=False, submission_polling=0.01,
                      copies_per_device=2) as e:
        f = e.open(path)
        buf = bytearray(4096)
        for off in (0, 4096 * 3, len(data) - 4096):
            assert f.read_into(buf, off) == 4096 and bytes(buf) == data[off:off + 4096]
        assert e.cached_reads == 0


def test_three_reactors_read_and_write_the_same_bytes(data_file, tmpdir_path):
    # Reads take the reactors in turn; a file's writes keep to its own reactor, and a read
    # right after a write sees it.
    path, data = data_file
    with gpuio.Engine(reactors=3, page_cache_fast_path=False) as e:
        f = e.open(path)
        buf = bytearray(len(data))
        assert f.read_into(buf) == len(data) and bytes(buf) == data
        out = e.open(os.path.join(tmpdir_path, "three.bin"), write=True, create=True)
        for i in range(8):
            block = bytes([i]) * 65536
            assert out.write_from(block, 0) == 65536
            back = bytearray(65536)
            assert out.read_into(back, 0) == 65536 and bytes(back) == block


def test_one_page_cache_copy_at_a_time_still_reads_everything(data_file):
    # Pieces of 64 KiB and up go to io_uring's workers; with one allowed at a time, the read's
    # other pieces wait their turn.
    path, data = data_file
    # (The file's reads would otherwise be copied from the page cache in poll: keep them on
    # the reactor's path, whose copies the setting caps.)
    with gpuio.Engine(page_cache_copies=1, chunk_size=64 << 10, page_cache_read_max=65536) as e:
        buf = bytearray(len(data))
        assert e.open(path).read_into(buf) == len(data) and bytes(buf) == data


def test_engine_settings_and_shutdown(data_file):
    path, data = data_file
    with gpuio.Engine(backend="pread", chunk_size=1 << 20, queue_depth=4, bounce_slots=8) as e:
        assert (e.backend, e.chunk_size, e.queue_depth) == ("pread", 1 << 20, 4)
        f = e.open(path)
        buf = bytearray(len(data))
        assert f.read_into(buf) == len(data) and bytes(buf) == data
    with pytest.raises(gpuio.ShutDown):
        f.read_into(bytearray(10))


def test_zero_length_reads_touch_nothing(engine, data_file):
    f = engine.open(data_file[0])
    assert f.read_into(bytearray()) == 0
    assert f.read_into(np.zeros((0, 5), dtype=np.float32)) == 0


def test_docstrings_explain_streams():
    doc = gpuio.File.read_into.__doc__
    assert "stream" in doc and "queued" in doc and "current stream" in doc
    assert "cancel" in gpuio.File.aread_into.__doc__.lower()


def test_check_reports_the_machine_and_path(tmpdir_path):
    report = gpuio.check(tmpdir_path)
    text = str(report)
    names = [name for name, _ in report.sections]
    assert names[:4] == ["gpuio", "io_uring", "engine", "path"]
    assert "cuda" in names and "gds" in names
    assert text.startswith(f"gpuio {gpuio.__version__}")
    assert f"path {tmpdir_path}" in text and "O_DIRECT" in text
    assert str(gpuio.check()).splitlines()[0] == text.splitlines()[0]


def test_check_refuses_what_it_cannot_examine(tmpdir_path):
    with pytest.raises(gpuio.IoError):
        gpuio.check(os.path.join(tmpdir_path, "missing"))
    fifo = os.path.join(tmpdir_path, "fifo")
    os.mkfifo(fifo)
    with pytest.raises(gpuio.InvalidInput, match="FIFO|fifo|pipe"):
        gpuio.check(fifo)


class DLPackOnly:
    """Exposes only DLPack (no buffer protocol), like a CPU tensor of a framework."""

    def __init__(self, arr):
        self.arr = arr

    def __dlpack__(self, stream=None, **kw):
        assert stream is None, "host memory is exported without a stream"
        return self.arr.__dlpack__()

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()


def test_dlpack_host_memory(engine, data_file):
    path, data = data_file
    f = engine.open(path)
    arr = np.zeros((3, 1000), dtype=np.int16)
    assert f.read_into(DLPackOnly(arr), 9) == arr.nbytes
    assert arr.tobytes() == data[9 : 9 + arr.nbytes]
    # A capsule itself, of a slice with an offset into its base.
    base = np.zeros(64, dtype=np.uint8)
    assert f.read_into(base[8:40].__dlpack__(), 1) == 32
    assert bytes(base[8:40]) == data[1:33] and not base[:8].any() and not base[40:].any()
    with pytest.raises(gpuio.InvalidInput, match="not C-contiguous"):
        f.read_into(DLPackOnly(np.zeros((4, 4), dtype=np.uint8)[:, ::2]))
    # A consumed capsule is refused, not read through.
    cap = base.__dlpack__()
    np.from_dlpack(type("C", (), {"__dlpack__": lambda s, **k: cap, "__dlpack_device__": lambda s: (1, 0)})())
    with pytest.raises(gpuio.InvalidInput, match="unconsumed DLPack capsule"):
        f.read_into(cap)


def test_device_memory_without_cuda_is_unsupported(engine, data_file):
    if gpuio.cuda_available():
        from conftest import skip_loudly

        skip_loudly("this machine has CUDA: test_gpu.py covers device memory")
    f = engine.open(data_file[0])
    host = np.zeros(16, dtype=np.uint8)

    class CAI:
        __cuda_array_interface__ = {
            "data": (host.ctypes.data, False),
            "shape": (16,),
            "typestr": "|u1",
            "version": 3,
        }

    with pytest.raises(gpuio.Unsupported, match="CUDA"):
        f.read_into(CAI())
    assert not host.any()


def test_sync_read_releases_the_gil(tmpdir_path):
    import threading
    import time

    from conftest import skip_loudly

    path = os.path.join(tmpdir_path, "gil.bin")
    size = 128 << 20
    with open(path, "wb") as g:
        g.truncate(size)
    # A slow engine on purpose (one 64 KiB piece at a time): the read must last long enough
    # for a held GIL to show as one long stall of the thread below.
    slow = gpuio.Engine(backend="pread", queue_depth=1, pread_threads=1, chunk_size=64 << 10)
    f = slow.open(path)
    buf = np.ones(size, dtype=np.uint8)
    span = {}

    def reader():
        span["start"] = time.perf_counter()
        f.read_into(buf)
        span["end"] = time.perf_counter()

    t = threading.Thread(target=reader)
    ticks = []
    t.start()
    while t.is_alive():
        ticks.append(time.perf_counter())
    t.join()
    start, end = span["start"], span["end"]
    took = end - start
    if took < 0.05:
        skip_loudly(f"the read took {took:.4f} s: too short to tell a held GIL from scheduling")
    inside = [x for x in ticks if start <= x <= end]
    stall = max(b - a for a, b in zip([start] + inside, inside + [end]))
    # Holding the GIL through the read would stall this thread for (about) all of it.
    assert stall < took / 2, f"this thread stalled {stall:.3f} s of a {took:.3f} s read"
    assert not buf.any()


def test_file_properties(engine, data_file):
    path, data = data_file
    f = engine.open(path)
    assert str(f.path) == path and f.size() == len(data) and f.direct is False
    assert repr(f) == f'gpuio.File("{path}", direct=False)'
    assert f.gds_status().split(" ")[0] in ("gds", "cufile-compat", "bounce")
    assert engine.backend in ("io_uring", "pread") and engine.backend_detail is not None


def _cached_pages(path):
    """(cached, pages) of the file by cachestat(2), or None where the kernel lacks it."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        rng = (ctypes.c_uint64 * 2)(0, os.path.getsize(path))
        out = (ctypes.c_uint64 * 5)()
        if libc.syscall(451, fd, rng, out, 0) != 0:
            return None
        return out[0], (os.path.getsize(path) + 4095) // 4096
    finally:
        os.close(fd)


def _cold(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("residency_aware", [True, False])
def test_residency_aware_reads_leave_a_cold_file_uncached(data_file, residency_aware):
    path, data = data_file
    _cold(path)
    before = _cached_pages(path)
    if before is None or before[0] != 0:
        pytest.skip(f"cannot see the page cache empty here (cachestat: {before})")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        os.close(fd)
    except OSError as e:
        pytest.skip(f"no O_DIRECT on this filesystem: {e}")
    with gpuio.Engine(residency_aware=residency_aware) as e:
        buf = bytearray(len(data))
        assert e.open(path).read_into(buf) == len(data) and bytes(buf) == data
    cached, pages = _cached_pages(path)
    if residency_aware:
        assert cached * 10 < pages, (cached, pages)
    else:
        assert cached == pages, (cached, pages)


def _nowait_works(path):
    """Whether this kernel and filesystem serve preadv2(RWF_NOWAIT) on ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def test_warm_host_reads_take_one_copy(data_file):
    # A warm read of up to page_cache_read_max bytes into host memory is copied from the page
    # cache straight into the array by the thread running it (counted in cached_reads); with
    # the limit at 64 KiB the same read goes through bounce slots. The bytes are the same.
    path, data = data_file
    if not _nowait_works(path):
        pytest.skip("preadv2(RWF_NOWAIT) refused here: no read is served from the page cache")
    for limit, served in ((None, 1), (65536, 0)):
        with gpuio.Engine(page_cache_read_max=limit) as e:
            f = e.open(path)
            a = np.zeros((5 << 20) + 7, dtype=np.uint8)
            assert f.read_into(a, 1001) == a.size
            assert a.tobytes() == data[1001 : 1001 + a.size]
            b = np.zeros(3 << 20, dtype=np.uint8)

            async def main():
                return await f.aread_into(b, 77)

            assert asyncio.run(main()) == b.size
            assert b.tobytes() == data[77 : 77 + b.size]
            assert e.cached_reads == 2 * served, (limit, e.cached_reads)


def test_large_sync_host_reads_land_in_place_and_match(data_file):
    # A blocking read into host memory lends the memory for the call, so past
    # page_cache_read_max the kernel reads into it in place (no bounce slot; for buffered
    # files on engines with three page-cache copies or more): the bytes are the file's, warm
    # or cold, buffered or O_DIRECT, at any offset.
    path, data = data_file
    with gpuio.Engine(page_cache_read_max=65536, page_cache_copies=3) as e:
        for direct in (False, True):
            try:
                f = e.open(path, direct=direct)
            except gpuio.Error as err:
                print(f"SKIPPED O_DIRECT here: {err}")
                continue
            for off in (0, 1001, 4096):
                a = np.zeros(len(data) - off + 50, dtype=np.uint8)
                assert f.read_into(a, off) == len(data) - off
                assert a[: len(data) - off].tobytes() == data[off:]
                assert not a[len(data) - off :].any(), "nothing past the end of the file"
            with open(path, "rb") as raw:
                os.posix_fadvise(raw.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            b = bytearray(len(data))
            assert f.read_into(b) == len(data)
            assert bytes(b) == data
