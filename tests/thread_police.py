"""Lightning's zombie-thread check (the autouse fixture `thread_police_duuu_daaa_duuu_daaa` of Lightning 2.6's
tests/tests_pytorch/conftest.py, which many users copy), for the ported ModelParallelStrategy tests: a thread that a
test started and left running fails it, unless it is a daemon whose `stop()` (or `exit()`) ends it at once."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


def zombie_threads(before: set[threading.Thread]) -> list[str]:
    """The threads started since `before` that are still running, after stopping those that can be stopped as
    Lightning's check does (empty: the check passes)."""
    zombies = []
    for thread in set(threading.enumerate()) - before:
        stop = getattr(thread, "stop", None) or getattr(thread, "exit", None)
        if thread.daemon and callable(stop):
            stop()
            if thread.is_alive():
                zombies.append(f"{thread} (alive after its stop())")
        elif thread.name == "QueueFeederThread":  # tensorboardX, which Lightning lets finish
            thread.join(timeout=20)
        elif "ThreadPoolExecutor-" in thread.name:  # torch.compile's, which Lightning lets be
            continue
        else:
            zombies.append(str(thread))
    return zombies


@contextmanager
def no_zombie_threads() -> Iterator[None]:
    """Fail (AssertionError, with Lightning's words) if the body leaves a thread running."""
    before = set(threading.enumerate())
    yield
    zombies = zombie_threads(before)
    assert not zombies, f"Test left zombie thread: {', '.join(zombies)}"
