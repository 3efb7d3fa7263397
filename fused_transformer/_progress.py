"""tqdm's progress bar, or one that draws nothing where tqdm is not installed: a GPU machine may hold only torch and
triton, with no package index, and a progress bar is no reason for ``check``, ``bench`` or ``demo`` to fail there."""
from __future__ import annotations

import sys
from typing import Any, Optional, TextIO

try:
    from tqdm import tqdm
except ImportError:  # the same calls, drawing nothing

    class tqdm:  # type: ignore[no-redef]  # noqa: N801 (tqdm's own name, so callers read the same)
        def __init__(self, iterable: Any = None, total: Optional[int] = None, initial: int = 0, **options: Any):
            self.iterable, self.total, self.n = iterable, total, initial

        def __iter__(self):
            return iter(self.iterable)

        def update(self, n: int = 1) -> None:
            self.n += n

        def set_description(self, *args: Any, **kwargs: Any) -> None:
            pass

        def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
            pass

        def close(self) -> None:
            pass

        @staticmethod
        def write(line: str, file: Optional[TextIO] = None) -> None:
            print(line, file=file if file is not None else sys.stdout)

__all__ = ["tqdm"]
