"""asyncio: awaitables complete on the loop without blocking it, run concurrently, and are
safe to cancel (the operation stops, its memory is released, nothing writes it afterwards)."""

import asyncio
import gc
import os
import time
import weakref

import numpy as np
import pytest

import gpuio


def run(coro):
    return asyncio.run(coro)


def test_aread_into_and_gather(engine, data_file):
    path, data = data_file
    f = engine.open(path)

    async def main():
        bufs = [bytearray(100_000) for _ in range(16)]
        counts = await asyncio.gather(*(f.aread_into(b, i * 50_000) for i, b in enumerate(bufs)))
        return bufs, counts

    bufs, counts = run(main())
    for i, (b, n) in enumerate(zip(bufs, counts)):
        assert n == 100_000
        assert bytes(b) == data[i * 50_000 : i * 50_000 + 100_000]


def test_awrite_and_abatch(engine, tmpdir_path):
    path = os.path.join(tmpdir_path, "w.bin")
    f = engine.open(path, write=True, create=True)
    src = np.arange(1 << 18, dtype=np.uint32)

    async def main():
        assert await f.awrite_from(src, 0) == src.nbytes
        dst = np.zeros(8, dtype=np.uint32)
        got = await f.aread_batch([(4, 16, 0), (4 * 100, 16, 16)], dst)
        return got, dst

    got, dst = run(main())
    assert got == [16, 16]
    assert list(dst) == [1, 2, 3, 4, 100, 101, 102, 103]


def test_errors_arrive_as_exceptions(engine, data_file):
    f = engine.open(data_file[0])

    async def main():
        with pytest.raises(gpuio.InvalidInput, match="write access"):
            await f.awrite_from(b"x", 0)
        with pytest.raises(gpuio.InvalidInput, match="largest file offset"):
            await f.aread_into(bytearray(4), 2**63 - 1)

    run(main())
    # Bad memory fails at the call, before anything is started.
    with pytest.raises(gpuio.InvalidInput, match="read-only"):
        f.aread_into(b"abc")


def test_the_loop_keeps_running_during_a_read(engine, tmpdir_path):
    path = os.path.join(tmpdir_path, "big.bin")
    size = 256 << 20
    with open(path, "wb") as g:
        g.truncate(size)
    f = engine.open(path)
    buf = np.ones(size, dtype=np.uint8)

    async def main():
        ticks = 0
        reading = True

        async def ticker():
            nonlocal ticks
            while reading:
                await asyncio.sleep(0.001)
                ticks += 1

        t = asyncio.create_task(ticker())
        start = time.perf_counter()
        n = await f.aread_into(buf)
        took = time.perf_counter() - start
        reading = False
        await t
        return n, ticks, took

    n, ticks, took = run(main())
    assert n == size and not buf.any()
    # The loop ran timers while the read was in flight (a blocking call would allow none).
    assert ticks >= 1, f"no loop iteration during a {took:.3f} s read"


def test_cancel_stops_and_releases_the_buffer(engine, tmpdir_path):
    path = os.path.join(tmpdir_path, "cancel.bin")
    size = 128 << 20
    with open(path, "wb") as g:
        g.truncate(size)
    # Slow on purpose (one 4 KiB piece at a time, 32 768 of them: seconds): the cancellation
    # lands while the read is far from done, however loaded the machine. (With 64 KiB pieces,
    # about 0.4 s, a loaded CI machine once let the whole read finish first.)
    slow = gpuio.Engine(backend="pread", queue_depth=1, pread_threads=1, chunk_size=4 << 10)
    f = slow.open(path)
    base = np.full(size, 0xAB, dtype=np.uint8)

    async def main():
        view = base[:]  # the op holds this view; `base` stays with the test
        alive = weakref.ref(view)
        task = asyncio.ensure_future(f.aread_into(view))
        del view
        await asyncio.sleep(0)  # started, and far from done (128 MiB)
        assert task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The aborted operation is dropped on gpuio's thread, which then lets go of the view.
        deadline = time.monotonic() + 10
        while alive() is not None and time.monotonic() < deadline:
            gc.collect()
            await asyncio.sleep(0.01)
        assert alive() is None, "the cancelled operation still holds its destination"
        snapshot = base.copy()
        await asyncio.sleep(0.2)
        assert np.array_equal(base, snapshot), "memory written after cancellation"
        assert (base == 0xAB).any(), "the cancelled read ran to completion"
        # The engine and file keep working.
        small = bytearray(b"\x01" * 4096)
        assert await f.aread_into(small, 10) == 4096
        assert bytes(small) == bytes(4096)

    run(main())


def test_many_cancellations_leave_the_engine_healthy(data_file):
    path, data = data_file
    engine = gpuio.Engine(bounce_slots=4, chunk_size=1 << 20)
    f = engine.open(path)

    async def main():
        for round_ in range(20):
            bufs = [bytearray(1 << 20) for _ in range(8)]
            tasks = [asyncio.ensure_future(f.aread_into(b, i * 4096)) for i, b in enumerate(bufs)]
            await asyncio.sleep(0)
            for t in tasks[round_ % 2 :: 2]:
                t.cancel()
            for i, t in enumerate(tasks):
                try:
                    n = await t
                except asyncio.CancelledError:
                    continue
                assert n == 1 << 20 and bytes(bufs[i]) == data[i * 4096 : i * 4096 + (1 << 20)]
        check = bytearray(len(data))
        assert await f.aread_into(check) == len(data) and bytes(check) == data

    run(main())


def test_awaitable_outlives_its_loop_safely(engine, data_file):
    # The loop closes while an operation is in flight: the result has nowhere to go, and
    # nothing may crash or hang; the engine serves later calls.
    f = engine.open(data_file[0])
    loop = asyncio.new_event_loop()
    loop.run_until_complete(asyncio.sleep(0))
    fut = None

    async def start():
        nonlocal fut
        fut = f.aread_into(bytearray(8 << 20))

    loop.run_until_complete(start())
    loop.close()
    time.sleep(0.2)
    buf = bytearray(16)
    assert f.read_into(buf) == 16
