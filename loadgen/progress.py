"""A plain-text progress bar (no dependency). On a terminal it redraws one line with `\\r`;
otherwise it writes a full line at most every `min_interval_s` seconds and at the end."""

from __future__ import annotations

import time
from typing import IO


class ProgressBar:
    """Counts finished requests; call `advance` once per request and `close` at the end."""

    def __init__(
        self,
        total: int,
        stream: IO[str] | None,
        label: str = "",
        width: int = 30,
        min_interval_s: float = 0.2,
    ) -> None:
        self.total = total
        self.stream = stream
        self.label = label
        self.width = width
        self.num_ok = 0
        self.num_failed = 0
        self._start_s = time.perf_counter()
        self._last_draw_s = -1e9
        self._is_tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self._min_interval_s = min_interval_s if self._is_tty else max(min_interval_s, 5.0)

    @property
    def num_done(self) -> int:
        return self.num_ok + self.num_failed

    def render(self) -> str:
        """The bar as text, e.g. `rate 4 [#####.....] 5/10 ok=4 failed=1 1.2s`."""
        frac = self.num_done / self.total if self.total else 1.0
        filled = round(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed_s = time.perf_counter() - self._start_s
        prefix = f"{self.label} " if self.label else ""
        return (
            f"{prefix}[{bar}] {self.num_done}/{self.total} ok={self.num_ok} "
            f"failed={self.num_failed} {elapsed_s:.1f}s"
        )

    def advance(self, is_success: bool) -> None:
        if is_success:
            self.num_ok += 1
        else:
            self.num_failed += 1
        now = time.perf_counter()
        if now - self._last_draw_s >= self._min_interval_s or self.num_done == self.total:
            self._draw(final=False)
            self._last_draw_s = now

    def close(self) -> None:
        self._draw(final=True)

    def _draw(self, final: bool) -> None:
        if self.stream is None:
            return
        if self._is_tty:
            self.stream.write("\r" + self.render() + ("\n" if final else ""))
        elif final or self.num_done < self.total:
            self.stream.write(self.render() + "\n")
        self.stream.flush()
