"""Which Triton is this: the one place that says which Triton releases we support and what each of them builds.

The CUDA torch a GPU user installs pins its Triton (torch 2.11 -> 3.6, 2.12 and 2.13 -> 3.7, 2.14 -> 3.8), so
our kernels must build with every release from ``OLDEST`` on, not only the newest. Releases differ where it
matters here: register allocation (a tile that compiles without spills under 3.9 can spill under 3.7), which
launches their compiler accepts (a cluster launch that 3.9 builds crashes 3.7's), and the interpreter's
behaviour. The tile tables mark the rows that hold only for some releases (``VersionRange``), the launchers and
the AOT report read the release from ``installed()``, so a GPU runs what the report compiled with the same Triton,
and CI runs the report under the oldest release, 3.7 and the newest (``.ci/versions``).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

Version = Tuple[int, int]  # (major, minor): patch releases do not change what compiles

OLDEST: Version = (3, 6)
# The releases CI checks, with the torch release that pins each (torch 2.13 CPU pins none: its CI job picks 3.9).
TESTED = {(3, 6): "torch 2.11", (3, 7): "torch 2.12 / 2.13", (3, 8): "torch 2.14", (3, 9): "newest"}


def parse(version: str) -> Version:
    """``(major, minor)`` of a version string: "3.7.1" -> (3, 7), "3.10.0+git1a2b" -> (3, 10)."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        raise ValueError(f"triton version {version!r}: expected MAJOR.MINOR[.PATCH]") from None


@functools.lru_cache(maxsize=None)
def installed() -> Version:
    """The installed Triton's ``(major, minor)`` (imports triton)."""
    import triton

    return parse(triton.__version__)


def unsupported_reason(version: str) -> Optional[str]:
    """None when Triton ``version`` is one we support, else why not (for the backend's "unavailable" message)."""
    if parse(version) < OLDEST:
        return (f"triton {version} is older than {OLDEST[0]}.{OLDEST[1]}, the oldest fused_transformer supports; "
                f"pip install 'triton>={OLDEST[0]}.{OLDEST[1]}' (or the torch release that pins one)")
    return None


@dataclasses.dataclass(frozen=True)
class VersionRange:
    """The Triton releases a tile row holds for: ``first`` to ``last`` inclusive (``last`` None: every later one,
    releases newer than we have tested included)."""

    first: Version = OLDEST
    last: Optional[Version] = None

    def __contains__(self, version: Version) -> bool:
        return self.first <= version and (self.last is None or version <= self.last)

    def __str__(self) -> str:
        def name(v: Version) -> str:
            return f"{v[0]}.{v[1]}"

        return f"triton {name(self.first)}-{name(self.last)}" if self.last else f"triton >= {name(self.first)}"


EVERY_RELEASE = VersionRange()
# Rows tuned on 3.9's register allocator that spill under an older one get a row for these releases before them.
BEFORE_3_9 = VersionRange(OLDEST, (3, 8))
SINCE_3_7 = VersionRange((3, 7))
SINCE_3_9 = VersionRange((3, 9))
TRITON_3_6 = VersionRange((3, 6), (3, 6))
TRITON_3_7 = VersionRange((3, 7), (3, 7))


def cluster_launches(version: Version) -> bool:
    """Whether this Triton compiles our thread-block cluster launches (``num_ctas`` > 1: the LayerNorm backward of
    rows wider than one block): 3.6 and 3.7 fail in TritonGPUPlanCTAPass ("parent layout must have at least rank >=
    2"), an assertion that aborts the process."""
    return version >= (3, 8)


def patch_interpreter() -> None:
    """Make an older Triton's interpreter run our kernels beside NumPy >= 2.4: before 3.7 it turned a scalar
    (a one-element array there) into a Python int with ``int(array)``, which NumPy 2.4 refuses ("only 0-dimensional
    arrays can be converted"), so every loop whose bounds come from a tensor failed. Does nothing from 3.7 on (its
    interpreter squeezes the array first) or when the interpreter has no such hook."""
    if installed() >= (3, 7):
        return
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "squeezes_scalars", False):
        return

    def patch_tensor_squeezing(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch_tensor_squeezing.squeezes_scalars = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_tensor_squeezing
