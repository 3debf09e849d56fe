"""asyncio futures for gpuio's awaitables, completed from gpuio's threads (through
``loop.call_soon_threadsafe``)."""

import asyncio


class OpFuture(asyncio.Future):
    """The future of one gpuio operation. ``cancel()`` ends the operation before it returns:
    by the time the awaiting task sees ``CancelledError``, nothing more is read into or
    written from the caller's memory, and a cancelled write's pieces are done or ordered
    before every later operation on the file (device memory: copies already queued on the
    stream still run there, before anything queued on it afterwards)."""

    def __init__(self, *, loop, stop):
        super().__init__(loop=loop)
        self._gpuio_stop = stop

    def cancel(self, msg=None):
        stop, self._gpuio_stop = self._gpuio_stop, None
        if stop is not None and not self.done():
            stop()
        return super().cancel(msg=msg)


def resolve(fut, ok, value):
    """Sets ``fut``'s result (``ok``) or exception, unless it was cancelled meanwhile."""
    fut._gpuio_stop = None
    if fut.done():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)
