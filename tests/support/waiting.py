"""Waiting on a condition in tests, with a deadline instead of a fixed sleep."""

from __future__ import annotations

import asyncio
import time


async def until(condition, what: str, timeout: float = 60.0, poll_s: float = 0.001) -> None:
    """Yield to the running loop (and any threads) until `condition()` holds; TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(poll_s)


def until_sync(condition, timeout: float = 60.0) -> bool:
    """Wait (in a thread that is not a loop's) until `condition()` holds. -> whether it did."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True
