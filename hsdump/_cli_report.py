"""How ``hsdump extract`` reports a run on the console: live progress, then the summary.

A terminal gets a live bar (samples, tokens/s, MB/s, compression ratio, ETA, failures); anywhere
else (Slurm, nohup, CI) a plain progress line every few seconds. The summary says what a user
acts on first, then the stages and which one samples waited for longest.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

if TYPE_CHECKING:
    from hsdump import ExtractionSummary

__all__ = ["console", "print_summary", "progress_view"]

#: Where the command's messages go (stderr; stdout carries only what a command outputs).
console = Console(stderr=True)


class _ProgressView:
    """Rich progress: samples, tokens/s, MB/s, compression ratio, ETA by tokens, failures."""

    def __init__(self) -> None:
        self.summary: ExtractionSummary | None = None
        self._progress = Progress(
            TextColumn("[bold]extract"),
            BarColumn(),
            TextColumn("{task.fields[samples]} samples"),
            TextColumn("{task.fields[rate]}"),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[failed]}"),
            console=console,
            transient=False,
        )
        self._task = self._progress.add_task("extract", total=None, samples="", rate="", failed="")

    def __call__(self, summary: ExtractionSummary) -> None:
        self.summary = summary
        ratio = "-" if math.isnan(summary.ratio) else f"{summary.ratio:.2f}x"
        self._progress.update(
            self._task,
            total=summary.tokens_total,
            completed=summary.tokens_done,
            samples=f"{summary.samples_done}/{summary.samples_total}",
            rate=f"{summary.tokens_per_s:,.0f} tok/s {summary.bytes_per_s / 1e6:.1f} MB/s {ratio}",
            failed=f"[red]{len(summary.failures)} failed" if summary.failures else "",
        )

    def __enter__(self) -> _ProgressView:
        self._progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._progress.stop()


class _LineProgress:
    """Plain progress lines where stderr is not a terminal (Slurm, nohup, CI): one at the start,
    then one after a sample once ``every`` seconds have passed since the last."""

    def __init__(self, every: float):
        self.summary: ExtractionSummary | None = None
        self._every = every
        self._last = -math.inf

    def __call__(self, summary: ExtractionSummary) -> None:
        self.summary = summary
        if time.monotonic() - self._last >= self._every:
            self._last = time.monotonic()
            console.print(_progress_line(summary), highlight=False, soft_wrap=True)

    def __enter__(self) -> _LineProgress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass


def _progress_line(summary: ExtractionSummary) -> str:
    eta = summary.eta_s
    left = "-" if eta is None else time.strftime("%H:%M:%S", time.gmtime(eta))
    return (
        f"progress: {summary.samples_done}/{summary.samples_total} samples, "
        f"{summary.tokens_per_s:,.0f} tokens/s, {summary.bytes_per_s / 1e9:.2f} GB/s, "
        f"ETA {left}, {len(summary.failures)} failed"
    )


def progress_view(log_every: float) -> _ProgressView | _LineProgress:
    """A live bar on a terminal, else a line every ``log_every`` seconds."""
    return _ProgressView() if console.is_terminal else _LineProgress(log_every)


def print_summary(
    summary: ExtractionSummary,
    failures_path: Path,
    *,
    fail_fast: bool = False,
    signalled: bool = False,
) -> None:
    """What a user acts on first (samples, tokens, sizes, rate, failures and where they are),
    then where the time went: one line of stages, one of the processes."""
    ratio = "n/a" if math.isnan(summary.ratio) else f"{summary.ratio:.2f}x"
    state = "done"
    if signalled or summary.interrupted:
        first_failure = fail_fast and summary.failures and not signalled
        state = "stopped at the first failure" if first_failure else "interrupted"
    if summary.recovered:
        shown = ", ".join(summary.recovered[:10]) + (", ..." if len(summary.recovered) > 10 else "")
        _say(
            f"[yellow]re-extracted {len(summary.recovered)} sample(s)[/] committed before an "
            f"unclean stop whose stored bytes failed their checksums: {shown}"
        )
    _say(
        f"{state}: {summary.samples_done} samples written, {summary.skipped} skipped, "
        f"{summary.tokens_done:,} tokens, {summary.bytes_raw / 1e6:.1f} MB raw, "
        f"{summary.bytes_stored / 1e6:.1f} MB stored ({ratio}), {summary.wall_s:.1f} s, "
        f"{summary.tokens_per_s:,.0f} tokens/s, {len(summary.failures)} failed"
    )
    if summary.failures:
        _say(f"[red]failures recorded in {failures_path}[/]")
    rates = summary.stage_rates()
    if rates:
        stages = ", ".join(
            f"{name} {summary.stages[name]:.2f} s ({gbs:.2f} GB/s x{busy:.1f})"
            for name, (gbs, busy) in rates.items()
        )
        waited = f"; samples waited most for {summary.limit}" if summary.limit else ""
        _say(f"stages (overlapping; GB/s while busy x samples in it): {stages}{waited}")
    _say(
        f"{summary.workers} worker process(es), {summary.cores_busy:.1f} cores busy, "
        f"peak memory {summary.peak_rss_bytes / 1e9:.2f} GB"
    )


def _say(line: str) -> None:
    """One line, never wrapped mid-phrase where the output is a log file."""
    console.print(line, highlight=False, soft_wrap=True)
