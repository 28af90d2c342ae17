"""The live progress bar (tqdm): finished requests on the bar, and in its postfix the running
TTFT and TPOT means, output token throughput and ok / failed counts, refreshed as tokens
arrive (a `TokenListener`), not only when requests finish.

TTFT = first token - send time, averaged over requests that have one so far. TPOT = the gap
since the request's previous message divided by the tokens that message carried, averaged over
every token after the first (so a long request weighs by its tokens here; the final report's
TPOT weighs requests equally). On a terminal the bar redraws at most every `min_interval_s`;
into a file or pipe at most every `FILE_INTERVAL_S`.
"""

from __future__ import annotations

import shutil
import time
from typing import IO

FILE_INTERVAL_S = 5.0


class LiveProgress:
    """Call `on_tokens` per message (through RecordBuilder), `advance` per finished request,
    `close` at the end."""

    def __init__(
        self, total: int, stream: IO[str], label: str = "", min_interval_s: float = 0.2
    ) -> None:
        from tqdm import tqdm

        is_tty = bool(getattr(stream, "isatty", lambda: False)())
        self.interval_s = min_interval_s if is_tty else FILE_INTERVAL_S
        # The terminal's size, or COLUMNS/LINES, else 80x24 where a pseudo-terminal reports
        # 0x0 (tqdm would draw nothing there); a file gets no width limit.
        size = shutil.get_terminal_size()
        self._bar = tqdm(
            total=total, desc=label, file=stream, unit="req", mininterval=self.interval_s,
            ncols=size.columns if is_tty else None, nrows=size.lines, ascii=not is_tty,
            leave=True,
        )  # fmt: skip
        self._start_s = time.perf_counter()
        self._last_draw_s = self._start_s
        self.num_ok = self.num_failed = 0
        self.num_first_tokens = 0
        self.ttft_sum_s = 0.0
        self.num_tokens = 0  # every token, first ones included
        self.num_later_tokens = 0
        self.tpot_sum_s = 0.0

    def on_tokens(self, start_s: float, prev_s: float | None, now_s: float, num: int) -> None:
        self.num_tokens += num
        if prev_s is None:
            self.num_first_tokens += 1
            self.ttft_sum_s += now_s - start_s
            num -= 1  # the rest of a first message are later tokens at the same instant
            prev_s = now_s
        if num > 0:
            self.num_later_tokens += num
            self.tpot_sum_s += now_s - prev_s
        clock_s = time.perf_counter()
        if clock_s - self._last_draw_s >= self.interval_s:
            self._last_draw_s = clock_s
            self._bar.set_postfix_str(self.postfix(clock_s), refresh=False)
            self._bar.refresh()

    def advance(self, is_success: bool) -> None:
        if is_success:
            self.num_ok += 1
        else:
            self.num_failed += 1
        self._bar.set_postfix_str(self.postfix(), refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.set_postfix_str(self.postfix(), refresh=False)
        self._bar.close()

    def postfix(self, now_s: float | None = None) -> str:
        """e.g. `ok=9 fail=1 TTFT=12.1ms TPOT=3.40ms 812tok/s`."""
        elapsed_s = (now_s or time.perf_counter()) - self._start_s
        parts = [f"ok={self.num_ok}", f"fail={self.num_failed}"]
        if self.num_first_tokens:
            parts.append(f"TTFT={1000 * self.ttft_sum_s / self.num_first_tokens:.1f}ms")
        if self.num_later_tokens:
            parts.append(f"TPOT={1000 * self.tpot_sum_s / self.num_later_tokens:.2f}ms")
        if elapsed_s > 0:
            parts.append(f"{self.num_tokens / elapsed_s:.0f}tok/s")
        return " ".join(parts)
