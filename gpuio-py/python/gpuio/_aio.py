"""Completes asyncio futures from gpuio's threads (called through loop.call_soon_threadsafe)."""


def resolve(fut, ok, value):
    """Sets ``fut``'s result (``ok``) or exception, unless it was cancelled meanwhile."""
    if fut.done():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)
