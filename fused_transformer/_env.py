"""Facts about the process the ops run in that cannot change while it runs, marked so that ``torch.compile`` calls
them at trace time instead of tracing into them. The bottom of the package: it imports nothing of it."""
from __future__ import annotations

import functools
import os
from typing import Callable, Dict, List, TypeVar

T = TypeVar("T")
# What was derived from the facts below (``on_facts_forgotten``): dropped whenever one of them is recomputed.
_DERIVED: List[Callable[[], None]] = []


def constant_for_compile(fn: Callable[..., T]) -> Callable[..., T]:
    """Mark ``fn`` as ``torch.compiler.assume_constant_result`` does, without its import of ``torch._dynamo``
    (0.8 s, which would double the import time of this package and import triton before ``python -m
    fused_transformer`` can switch the interpreter on). tests/test_drop_in.py fails if torch stops honouring it."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def computed_once(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn()`` computed at the first call only, and a constant to torch.compile. ``cache_clear()`` forgets it and
    everything derived from these facts (a test that changes one). Not ``functools.lru_cache``: torch.compile traces
    through that wrapper into ``fn``."""
    results: Dict[str, T] = {}

    @functools.wraps(fn)
    def once() -> T:
        if "value" not in results:
            results["value"] = fn()
        return results["value"]

    def cache_clear() -> None:
        results.clear()
        for forget in _DERIVED:
            forget()

    once.cache_clear = cache_clear  # type: ignore[attr-defined]
    return constant_for_compile(once)


def on_facts_forgotten(forget: Callable[[], None]) -> None:
    """Call ``forget`` whenever a ``computed_once`` fact is forgotten (what it cached from them is stale then)."""
    _DERIVED.append(forget)


@computed_once
def triton_interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (``TRITON_INTERPRET=1``), as Triton read it
    when it made the kernels: once per process."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
