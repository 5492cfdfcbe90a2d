"""How ``hsdump extract`` reports a run on the console: live progress, then the summary.

A terminal gets a live bar (percent, samples, tokens/s, MB/s, compression ratio, elapsed time, ETA,
failures); anywhere else (Slurm, nohup, CI) a plain progress line at each tenth of the run, at least
every ``--log-every`` seconds, and at the end. The summary says what a user acts on first; with
``-v`` it adds the stages and which one samples waited for longest.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Column

if TYPE_CHECKING:
    from hsdump import ExtractionSummary

__all__ = ["console", "print_summary", "progress_view", "stop_notice", "summary_json"]

#: Where the command's messages go (stderr; stdout carries only what a command outputs).
console = Console(stderr=True)


def stop_notice() -> str:
    """What the first Ctrl-C writes: on a line of its own, also below a live progress bar."""
    newline = "\n" if console.is_terminal else ""  # the bar's line has none
    return f"{newline}stopping: committing what is done, then cleaning up\n"


def _failed(summary: ExtractionSummary) -> tuple[int, int]:
    """Failed samples (requests were sent) and rejected dataset lines (none was)."""
    lines = sum(1 for f in summary.failures if f.attempts == 0)
    return len(summary.failures) - lines, lines


def _failures_text(summary: ExtractionSummary) -> str:
    samples, lines = _failed(summary)
    parts = [f"{samples} samples failed"] if samples else []
    parts += [f"{lines} dataset lines rejected"] if lines else []
    return ", ".join(parts) or "no failures"


def _clock(seconds: float | None) -> str:
    """``H:MM:SS``, as rich's live bar shows the elapsed time."""
    if seconds is None:
        return "-:--:--"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02}:{secs:02}"


def _percent(summary: ExtractionSummary) -> float:
    return 100 * summary.tokens_done / summary.tokens_total if summary.tokens_total else 100.0


class _Resuming:
    """Says once that a rerun resumes, as soon as the run knows how much is stored."""

    said = False

    def resuming(self, summary: ExtractionSummary) -> None:
        if not self.said and summary.skipped:
            self.said = True
            total = summary.skipped + summary.samples_total
            _say(f"resuming: {summary.skipped} of {total} samples already stored")


class _ProgressView(_Resuming):
    """Rich progress: percent, samples, tokens/s, MB/s, ratio, elapsed, ETA by tokens, failures."""

    def __init__(self) -> None:
        self.summary: ExtractionSummary | None = None
        self._progress = Progress(
            TextColumn("[bold]extract"),
            BarColumn(bar_width=10),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            # One column: on a narrow terminal its end is cut, not every figure.
            TextColumn("{task.fields[figures]}", table_column=Column(no_wrap=True, ratio=1)),
            console=console,
            transient=False,
            expand=True,
        )
        self._task = self._progress.add_task("extract", total=None, figures="")

    def __call__(self, summary: ExtractionSummary) -> None:
        self.summary = summary
        self.resuming(summary)
        ratio = "-" if math.isnan(summary.ratio) else f"{summary.ratio:.2f}x"
        samples, lines = _failed(summary)
        failed = [f"{samples} failed"] * bool(samples) + [f"{lines} bad lines"] * bool(lines)
        figures = (
            f"ETA {_clock(summary.eta_s)} {summary.samples_done}/{summary.samples_total} samples"
        )
        if failed:
            figures += f" [red]{', '.join(failed)}[/]"
        figures += (
            f" {summary.tokens_per_s:,.0f} tok/s {summary.bytes_per_s / 1e6:,.1f} MB/s {ratio}"
        )
        self._progress.update(
            self._task,
            total=summary.tokens_total,
            completed=summary.tokens_done,
            figures=figures,
        )

    def __enter__(self) -> _ProgressView:
        self._progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._progress.stop()


class _LineProgress(_Resuming):
    """Plain progress lines where stderr is not a terminal (Slurm, nohup, CI): one at the start,
    one each time the run passes another tenth of its tokens or ``every`` seconds have passed
    since the last, and one at the end."""

    def __init__(self, every: float):
        self.summary: ExtractionSummary | None = None
        self._every = every
        self._last = -math.inf
        self._tenth = -1
        self._unprinted = False  # the last report came between lines

    def __call__(self, summary: ExtractionSummary) -> None:
        self.summary = summary
        self.resuming(summary)
        tenth = int(_percent(summary) // 10)
        self._unprinted = tenth <= self._tenth and time.monotonic() - self._last < self._every
        if not self._unprinted:
            self._tenth, self._last = tenth, time.monotonic()
            _say(_progress_line(summary))

    def __enter__(self) -> _LineProgress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.summary is not None and self._unprinted:
            _say(_progress_line(self.summary))  # the last line shows where the run ended


def _progress_line(summary: ExtractionSummary) -> str:
    return (
        f"progress: {summary.samples_done}/{summary.samples_total} samples "
        f"({_percent(summary):.0f}%), {summary.tokens_per_s:,.0f} tokens/s, "
        f"{summary.bytes_per_s / 1e6:,.1f} MB/s, elapsed {_clock(summary.wall_s)}, "
        f"ETA {_clock(summary.eta_s)}, {_failures_text(summary)}"
    )


def progress_view(log_every: float) -> _ProgressView | _LineProgress:
    """A live bar on a terminal, else a line at each tenth of the run or ``log_every`` seconds."""
    return _ProgressView() if console.is_terminal else _LineProgress(log_every)


def _state(summary: ExtractionSummary, fail_fast: bool, signalled: bool) -> str:
    if not (signalled or summary.interrupted):
        return "done"
    first_failure = fail_fast and summary.failures and not signalled
    return "stopped at the first failure" if first_failure else "interrupted"


def print_summary(
    summary: ExtractionSummary,
    failures_path: Path,
    *,
    fail_fast: bool = False,
    signalled: bool = False,
    verbose: bool = False,
) -> None:
    """What a user acts on first (samples, tokens, sizes, rate, failures and where they are);
    with ``verbose``, where the time went: one line of stages, one of the processes."""
    ratio = "n/a" if math.isnan(summary.ratio) else f"{summary.ratio:.2f}x"
    state = _state(summary, fail_fast, signalled)
    if summary.recovered:
        shown = ", ".join(summary.recovered[:10]) + (", ..." if len(summary.recovered) > 10 else "")
        _say(
            f"[yellow]re-extracted {len(summary.recovered)} sample(s)[/] committed before an "
            f"unclean stop whose stored bytes failed their checksums: {shown}"
        )
    _say(
        f"{state}: {summary.samples_done} samples written, {summary.skipped} skipped, "
        f"{summary.tokens_done:,} tokens in {summary.wall_s:.1f} s "
        f"({summary.tokens_per_s:,.0f} tokens/s, {summary.bytes_per_s / 1e6:,.1f} MB/s)"
    )
    _say(
        f"stored {summary.bytes_stored / 1e6:,.1f} MB, {summary.bytes_raw / 1e6:,.1f} MB raw "
        f"(compression {ratio})"
    )
    if summary.failures:
        _say(f"[red]{escape(_failures_text(summary))}[/]: see {escape(str(failures_path))}")
    if state == "interrupted":
        stored = summary.skipped + summary.samples_done
        _say(f"rerun the same command to resume: the store keeps its {stored} samples")
    if verbose:
        _print_stages(summary)


def _print_stages(summary: ExtractionSummary) -> None:
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


def summary_json(
    summary: ExtractionSummary,
    failures_path: Path,
    *,
    fail_fast: bool = False,
    signalled: bool = False,
) -> str:
    """The summary as one JSON object (``hsdump extract --json``)."""
    samples_failed, lines_rejected = _failed(summary)
    record: dict[str, Any] = {
        "state": _state(summary, fail_fast, signalled),
        "samples_written": summary.samples_done,
        "samples_skipped": summary.skipped,
        "samples_failed": samples_failed,
        "lines_rejected": lines_rejected,
        "failures_file": str(failures_path) if summary.failures else None,
        "tokens": summary.tokens_done,
        "bytes_raw": summary.bytes_raw,
        "bytes_stored": summary.bytes_stored,
        "compression_ratio": None if math.isnan(summary.ratio) else round(summary.ratio, 4),
        "wall_s": round(summary.wall_s, 3),
        "tokens_per_s": round(summary.tokens_per_s, 1),
        "bytes_per_s": round(summary.bytes_per_s, 1),
        "retries": summary.retries,
        "recovered": summary.recovered,
        "stages_s": {name: round(s, 4) for name, s in summary.stages.items()},
        "workers": summary.workers,
        "cores_busy": round(summary.cores_busy, 2),
        "peak_rss_bytes": summary.peak_rss_bytes,
    }
    return json.dumps(record)


def _say(line: str) -> None:
    """One line, never wrapped mid-phrase where the output is a log file."""
    console.print(line, highlight=False, soft_wrap=True)
