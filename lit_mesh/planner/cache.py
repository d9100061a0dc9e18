"""A cache keyed by an object's identity (the search prices thousands of options of one model and layout): the object
is kept alive with its entry, so its id cannot be reused by another while the entry stands."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")

LIMIT = 100_000  # entries before a cache starts over (one plan needs far fewer)
IdentityCache = dict[tuple, tuple[Any, Any]]  # (id(anchor), *key) -> (anchor, value)


def by_identity(cache: IdentityCache, anchor: object, key: tuple[Hashable, ...], make: Callable[[], T]) -> T:
    """cache[(id(anchor), *key)], made by `make()` on a miss."""
    full = (id(anchor), *key)
    hit = cache.get(full)
    if hit is None or hit[0] is not anchor:
        if len(cache) > LIMIT:
            cache.clear()
        hit = cache[full] = (anchor, make())
    return hit[1]
