"""The ``hsdump`` command line: extract a dataset, serve the reference model, check a store.

Exit codes: 0 everything succeeded; 1 some samples or dataset lines failed (see the failures
file), a store check found damage or a stored layer differs from the model; 2 the run could not
start (bad arguments, server unreachable, store locked...) or stopped on a store error no retry
fixes (no space left...); 130 interrupted by SIGINT (Ctrl-C), 143 by SIGTERM (rerun the same
command to resume).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import inspect
import itertools
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn, TypedDict, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from hsdump._cli_report import console, print_summary, progress_view, stop_notice, summary_json
from hsdump._cores import EXTRACTION_SWITCH_INTERVAL_S, cores
from hsdump._exceptions import ConfigError, HsdumpError, StoreIOError
from hsdump._run.signals import GracefulStop, Stopped
from hsdump._store.objstore import is_url, local_side, store_may_exist

if TYPE_CHECKING:
    from hsdump import ExportSummary, ExtractionSummary, Failure, RunOptions
    from hsdump._run.inputs import Dataset, InputLimits, Shard

__all__ = ["app", "main"]

EXIT_OK, EXIT_FAILURES, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130
T = TypeVar("T")

app = typer.Typer(
    name="hsdump",
    help="Extract verified hidden states from an inference server into a compressed Zarr store.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
out = Console()


def _print_version(value: bool) -> None:
    if value:
        from hsdump import __version__

        out.print(f"hsdump {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Show the version."),
    ] = False,
) -> None:
    """Extract verified hidden states from an inference server into a compressed Zarr store."""


def _reflow(text: str) -> str:
    """Help text as rich prints it: a paragraph's lines joined (the terminal wraps them), a block
    with indented lines (examples) kept line for line."""
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(p if "\n " in p else p.replace("\n", " ") for p in paragraphs)


EXTRACT_HELP = _reflow("""Extract every sample of a JSONL DATASET into the store OUT.

Each line is {"id": ..., "input_ids": [...], "loss_mask": [...]} ("text" or chat "messages"
with --tokenizer). A rerun skips the samples already stored; failures are recorded in
OUT.failures.jsonl (for an s3:// store, NAME.failures.jsonl in the working directory).

Examples:
  hsdump extract bundled --out sample.zarr    # bundled data, built-in model
  hsdump extract data.jsonl --out hs.zarr --concurrency 8 \\
      --server-url http://127.0.0.1:30000 --dump-dir /dev/shm/hsdump
""")


def _data_path(dataset: str) -> Path:
    if dataset != "bundled":
        return Path(dataset)
    return Path(str(resources.files("hsdump") / "data" / "sample.jsonl"))


def _setup_logging(verbose: bool) -> None:
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        for name in ("httpx", "httpcore"):  # one INFO line per HTTP request drowns the rest
            logging.getLogger(name).setLevel(logging.WARNING)


def _run_guarded(job: Callable[[], int]) -> None:
    """Run a command body: one-line errors, never a traceback, and meaningful exit codes."""
    try:
        code = job()
    except HsdumpError as exc:
        console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        code = EXIT_ERROR
    except KeyboardInterrupt as exc:  # a Stopped says which signal: 130 or 143
        console.print("[yellow]interrupted[/]: committed samples are kept; rerun to resume")
        code = getattr(exc, "exit_code", EXIT_INTERRUPTED)
    raise typer.Exit(code)


@contextlib.contextmanager
def _server(
    server_url: str | None, dump_dir: Path | None, model: Path | None
) -> Iterator[tuple[str, Path | None]]:
    """The server to use: the one given, or an embedded reference server while the run lasts."""
    if server_url is not None:
        yield server_url, dump_dir
        return
    from hsdump._servers.reference import ReferenceServer

    with _temp_root(dump_dir) as root:
        where = "" if dump_dir is not None else f", dumping into {root}"
        console.print(
            f"starting the reference server ({model or 'built-in model'}{where})",
            highlight=False,
            soft_wrap=True,
        )
        with ReferenceServer(model, dump_dir=root) as server:
            yield server.url, root


@contextlib.contextmanager
def _temp_root(dump_dir: Path | None) -> Iterator[Path]:
    """``dump_dir``, or a temporary root removed at the end (or by the next run, if killed)."""
    if dump_dir is not None:
        yield dump_dir
        return
    from hsdump._client.janitor import TempRoot, remove_stale_roots

    remove_stale_roots(_shm())
    root = TempRoot(_shm())
    try:
        yield root.path
    finally:
        root.remove()


def _shm() -> str | None:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


class _ClientOptions(TypedDict, total=False):
    """The `HiddenStateClient` arguments ``extract`` sets from its options."""

    request_timeout: float
    dump_timeout: float
    watcher: Literal["inotify", "poll", "watchfiles"]


class _StoreOptions(TypedDict, total=False):
    """The `open_store` arguments ``extract`` sets from its options."""

    shard_tokens: int


@dataclasses.dataclass(frozen=True)
class _ExtractOptions:
    """``hsdump extract``'s options, checked by typer; ``shard`` and ``servers`` once parsed."""

    dataset: Path
    out: str
    writer_id: str | None
    concurrency: int
    workers: int
    retries: int
    fail_fast: bool
    tokenizer: Path | None
    request_timeout: float
    dump_timeout: float
    watcher: Literal["inotify", "poll", "watchfiles"] | None
    shard_tokens: int | None
    log_every: float
    verbose: bool = False
    as_json: bool = False
    shard: Shard | None = None
    servers: Sequence[tuple[str, Path | None]] = ()

    def client_options(self) -> _ClientOptions:
        options = _ClientOptions(
            request_timeout=self.request_timeout, dump_timeout=self.dump_timeout
        )
        if self.watcher is not None:
            options["watcher"] = self.watcher
        return options

    def store_options(self) -> _StoreOptions:
        return _StoreOptions(shard_tokens=self.shard_tokens) if self.shard_tokens else {}

    def run_options(
        self,
        failures_path: Path,
        progress: Callable[[ExtractionSummary], None],
        line_numbers: Mapping[str, int],
        prior: Sequence[Failure],
    ) -> RunOptions:
        """What every runner takes about the samples of this run."""
        from hsdump._run.common import RunOptions

        return RunOptions(
            concurrency=self.concurrency,
            retries=self.retries,
            fail_fast=self.fail_fast,
            failures_path=failures_path,
            progress=progress,
            line_numbers=line_numbers,
            prior_failures=prior,
        )

    def report(
        self, summary: ExtractionSummary, failures_path: Path, *, signalled: bool = False
    ) -> None:
        """The run's summary: on stderr, or with ``--json`` as one JSON object on stdout."""
        fail_fast = self.fail_fast
        if self.as_json:
            text = summary_json(summary, failures_path, fail_fast=fail_fast, signalled=signalled)
            out.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True)
            return
        print_summary(
            summary, failures_path, fail_fast=fail_fast, signalled=signalled, verbose=self.verbose
        )

    def tokenizer_or_none(self) -> Any:
        """The ``--tokenizer`` (a transformers tokenizer), loaded; None without the option."""
        from hsdump._run.inputs import load_tokenizer

        return load_tokenizer(self.tokenizer) if self.tokenizer else None


def _read_dataset(options: _ExtractOptions, limits: InputLimits) -> tuple[Dataset, list[Failure]]:
    from hsdump._run.inputs import read_dataset

    dataset = read_dataset(options.dataset, limits=limits, tokenizer=options.tokenizer_or_none())
    if options.shard is not None:
        dataset = options.shard.select(dataset)
    return dataset, _say_bad_lines(dataset)


def _say_bad_lines(dataset: Dataset) -> list[Failure]:
    """Name each bad line of ``dataset``; the failures that record them."""
    from hsdump._run.common import Failure

    for bad in dataset.bad_lines:
        # The message names file and line; rich would take a "[sample 'x']" prefix for markup.
        line = f"[red]bad line[/] {escape(bad.error.message)}"
        console.print(line, highlight=False, soft_wrap=True)
    return [Failure(b.sample_id, b.line, "InputError", str(b.error), 0) for b in dataset.bad_lines]


async def _until_stopped(stop: GracefulStop, job: Callable[[], Awaitable[int]]) -> int:
    """Run ``job`` in the event loop; a stop signal before it handles one ends it at once."""
    import anyio

    with anyio.CancelScope() as scope, stop.cancelling(scope):
        return await job()
    console.print("[yellow]interrupted[/] before the run began: nothing was written")
    return stop.exit_code or EXIT_INTERRUPTED


async def _extract(
    options: _ExtractOptions, url: str, dump_dir: Path | None, stop: GracefulStop
) -> int:
    import anyio

    from hsdump._client.client import HiddenStateClient
    from hsdump._run.common import failures_path_for
    from hsdump._run.inputs import InputLimits
    from hsdump._run.pipeline import run_extraction
    from hsdump._store.store import open_store

    client = HiddenStateClient(
        url,
        dump_dir=dump_dir,
        max_in_flight=options.concurrency,
        **options.client_options(),
    )
    async with client:
        limits = InputLimits.from_server_info(client.server_info)
        dataset, prior = _read_dataset(options, limits)
        failures_path = failures_path_for(local_side(options.out))
        store_options = options.store_options()
        view = progress_view(options.log_every)
        # A stop signal cancels the run alone: it flushes the store, and the summary follows.
        with (
            open_store(options.out, "a", writer_id=options.writer_id, **store_options) as store,
            view,
            anyio.CancelScope() as scope,
            stop.cancelling(scope),
        ):
            run = options.run_options(failures_path, view, dataset.line_numbers, prior)
            await run_extraction(dataset.samples, client=client, store=store, options=run)
    summary = view.summary  # the run's own summary, also when it was cancelled
    if summary is None:
        return stop.exit_code or EXIT_INTERRUPTED
    signalled = stop.signum is not None
    options.report(summary, failures_path, signalled=signalled)
    if signalled:
        return stop.exit_code or EXIT_INTERRUPTED
    return EXIT_OK if summary.ok else EXIT_FAILURES


def _extract_parallel(options: _ExtractOptions, url: str, dump_dir: Path | None) -> int:
    """``--workers`` > 1: extraction in worker processes, each with its own store part."""
    from hsdump._run.common import failures_path_for
    from hsdump._run.inputs import input_limits
    from hsdump._run.parallel import run_parallel_extraction

    # The workers' clients check the server; this process neither opens a client nor imports
    # torch, so the workers start (and import it) seconds sooner.
    dataset, prior = _read_dataset(options, input_limits(url))
    failures_path = failures_path_for(local_side(options.out))
    stopped: KeyboardInterrupt | None = None
    with progress_view(options.log_every) as view:
        try:
            summary = run_parallel_extraction(
                dataset.samples,
                url=url,
                dump_dir=dump_dir,
                store=options.out,
                writer_id=options.writer_id,
                servers=options.servers,
                workers=options.workers,
                options=options.run_options(failures_path, view, dataset.line_numbers, prior),
                client_options=options.client_options(),
                store_options=options.store_options(),
            )
        except KeyboardInterrupt as exc:
            stopped = exc
    if stopped is not None:  # the summary goes under the bar, once the bar is gone
        if view.summary is None:
            raise stopped
        view.summary.interrupted = True
        options.report(view.summary, failures_path, signalled=True)
        return getattr(stopped, "exit_code", EXIT_INTERRUPTED)  # 130 or 143
    options.report(summary, failures_path)
    return EXIT_OK if summary.ok else EXIT_FAILURES


def _extract_ray(
    options: _ExtractOptions, servers: Path | None, address: str | None, stop: GracefulStop
) -> int:
    """``--ray``: one actor per server of the servers file, each on its server's node."""
    from hsdump._exceptions import ConfigError
    from hsdump._run.common import failures_path_for
    from hsdump._run.inputs import input_limits
    from hsdump._run.ray_cluster import require_ray
    from hsdump._run.ray_driver import run_ray_extraction

    if servers is None:
        raise ConfigError("--ray needs --servers FILE (each server's url, dump_dir and node)")
    require_ray()
    listed = read_server_nodes(servers)
    dataset, prior = _read_dataset(options, input_limits(listed[0][0]))
    failures_path = failures_path_for(local_side(options.out))
    with progress_view(options.log_every) as view:
        try:
            summary = run_ray_extraction(
                dataset.samples, servers=listed, store=options.out, address=address,
                writer_id=options.writer_id,
                options=options.run_options(failures_path, view, dataset.line_numbers, prior),
                client_options=options.client_options(), store_options=options.store_options(),
            )  # fmt: skip
        except KeyboardInterrupt as exc:
            if stop.signum is None or isinstance(exc, Stopped):
                raise
            raise Stopped(stop.signum) from exc  # Ray's calls raise a new, plain one
    options.report(summary, failures_path)
    return EXIT_OK if summary.ok else EXIT_FAILURES


def read_servers(path: Path) -> list[tuple[str, Path | None]]:
    """The ``--servers`` file: a JSON list of ``{"url": ..., "dump_dir": ...}`` objects."""
    return [(url, root) for url, root, _ in read_server_nodes(path)]


def read_server_nodes(path: Path) -> list[tuple[str, Path | None, str | None]]:
    """The ``--servers`` file with each server's optional ``"node"`` (for ``--ray``)."""
    from hsdump._exceptions import ConfigError

    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the servers file {path}: {exc}") from exc
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path} must hold a non-empty JSON list of servers")
    servers = []
    for number, entry in enumerate(entries, 1):
        fields = entry if isinstance(entry, dict) else {}
        url, root, node = (fields.get(key) for key in ("url", "dump_dir", "node"))
        if not isinstance(url, str) or not all(
            v is None or isinstance(v, str) for v in (root, node)
        ):
            raise ConfigError(
                f'{path}, server {number}: expected {{"url": str, "dump_dir": str, "node": str '
                f"(optional)}}, found {entry!r}"
            )
        servers.append((url, Path(root) if root else None, node))
    return servers


def default_workers(dataset: Path) -> int:
    """Worker processes for ``--workers 0``: one per eight of this process's cores (its CPU
    affinity, or ``HSDUMP_CORES``), 1 to 8; this process alone for a dataset of one line.

    Each process sizes its thread pools by its share of the cores. Measured at H=7168 on a
    16-core H200 host: two store processes of 8 cores each stored 25.4k tok/s, four of 4 cores
    17.2k. A single sample gains nothing from a worker process, which only adds its start-up
    (13.5 s against 9.2 s from launch to exit on the 16-core GPU host).
    """
    with contextlib.suppress(OSError), dataset.open("rb") as lines:
        if sum(1 for line in itertools.islice(filter(bytes.strip, lines), 2)) < 2:
            return 1
    return max(1, min(8, cores() // 8))


_INPUT, _SERVER, _RUN, _STORE, _OUTPUT = "Input", "Server", "Run", "Store", "Output"


@app.command(help=EXTRACT_HELP)
def extract(
    dataset: Annotated[
        str,
        typer.Argument(metavar="DATASET", help="JSONL dataset, or 'bundled' for the sample."),
    ],
    *,  # the options in the order of their panels
    tokenizer: Annotated[
        Path | None,
        typer.Option(
            help="Local tokenizer directory for 'text'/'messages' lines.", rich_help_panel=_INPUT
        ),
    ] = None,
    shard: Annotated[
        str | None,
        typer.Option(
            metavar="I/N",
            help="Extract only the samples of shard I of N (by a hash of each sample id), for "
            "one job of a Slurm array, torchrun or Kubernetes job.",
            rich_help_panel=_INPUT,
        ),
    ] = None,
    server_url: Annotated[
        str | None,
        typer.Option(
            help="A running server; none: start the reference server.", rich_help_panel=_SERVER
        ),
    ] = None,
    dump_dir: Annotated[
        Path | None,
        typer.Option(
            help="The server's dump root (default: HSDUMP_DUMP_DIR).", rich_help_panel=_SERVER
        ),
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option(
            help="Model directory for the embedded reference server.", rich_help_panel=_SERVER
        ),
    ] = None,
    servers: Annotated[
        Path | None,
        typer.Option(
            "--servers",
            help='A JSON file listing servers, [{"url": ..., "dump_dir": ...}, ...] ("node": ... '
            "for --ray): the dataset is spread over them (--workers workers and --concurrency "
            "requests each).",
            rich_help_panel=_SERVER,
        ),
    ] = None,
    request_timeout: Annotated[
        float,
        typer.Option(
            min=0.001,
            metavar="SECONDS",
            help="Seconds to wait for the server's HTTP response.",
            rich_help_panel=_SERVER,
        ),
    ] = 600.0,
    dump_timeout: Annotated[
        float,
        typer.Option(
            metavar="SECONDS", help="Seconds to wait for a dump.", rich_help_panel=_SERVER
        ),
    ] = 60.0,
    watcher: Annotated[
        Literal["inotify", "poll", "watchfiles"] | None,
        typer.Option(
            metavar="NAME",
            help="How to wait for dumps: inotify, poll or watchfiles (default: HSDUMP_WATCHER, "
            "else inotify).",
            rich_help_panel=_SERVER,
        ),
    ] = None,
    concurrency: Annotated[
        int, typer.Option(min=1, help="Requests at the server at once.", rich_help_panel=_RUN)
    ] = 1,
    workers: Annotated[
        int,
        typer.Option(
            min=0,
            help="Processes that check and store dumps, each into its own store part "
            "(0: one per eight cores, 1 to 8; 1: this process only).",
            rich_help_panel=_RUN,
        ),
    ] = 0,
    retries: Annotated[
        int, typer.Option(min=0, help="Retries of a transient failure.", rich_help_panel=_RUN)
    ] = 3,
    fail_fast: Annotated[
        bool, typer.Option("--fail-fast", help="Stop at the first failure.", rich_help_panel=_RUN)
    ] = False,
    ray: Annotated[
        bool,
        typer.Option(
            "--ray",
            help="Run one extraction actor per server of --servers on a Ray cluster, on the "
            'server\'s "node" (pip install hsdump\\[ray]).',
            rich_help_panel=_RUN,
        ),
    ] = False,
    ray_address: Annotated[
        str | None,
        typer.Option(
            help="The Ray cluster (default: RAY_ADDRESS, else the one on this node).",
            rich_help_panel=_RUN,
        ),
    ] = None,
    out: Annotated[
        str,
        typer.Option(
            "--out",
            "-o",
            help="The Zarr store to write (resumed): a path or s3:// URL.",
            rich_help_panel=_STORE,
        ),
    ],
    writer_id: Annotated[
        str | None,
        typer.Option(
            help="This run's store part (default: 'default', or shardIofN with --shard); "
            "concurrent runs into one store need distinct ones.",
            rich_help_panel=_STORE,
        ),
    ] = None,
    shard_tokens: Annotated[
        int | None,
        typer.Option(
            help="Tokens per store shard (store default when unset).", rich_help_panel=_STORE
        ),
    ] = None,
    log_every: Annotated[
        float,
        typer.Option(
            min=0,
            metavar="SECONDS",
            help="Most seconds between progress lines when stderr is not a terminal (a line "
            "also at every tenth of the run).",
            rich_help_panel=_OUTPUT,
        ),
    ] = 30.0,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            help="Log each sample; the summary adds where the time went.",
            rich_help_panel=_OUTPUT,
        ),
    ] = False,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print the summary as one JSON object on stdout.",
            rich_help_panel=_OUTPUT,
        ),
    ] = False,
) -> None:
    """Extract a dataset into a store (see EXTRACT_HELP)."""
    from hsdump._run.inputs import Shard

    _setup_logging(verbose)
    given = _ExtractOptions(
        dataset=_data_path(dataset), out=out, writer_id=writer_id, concurrency=concurrency,
        workers=workers, retries=retries, fail_fast=fail_fast,
        tokenizer=tokenizer, request_timeout=request_timeout, dump_timeout=dump_timeout,
        watcher=watcher, shard_tokens=shard_tokens, log_every=log_every, verbose=verbose,
        as_json=as_json,
    )  # fmt: skip

    def job() -> int:
        import anyio

        options = given
        _check_readable(options.dataset)  # before any server starts
        if not options.workers:
            options = dataclasses.replace(options, workers=default_workers(options.dataset))
        if shard is not None:
            parsed = Shard.parse(shard)
            options = dataclasses.replace(
                options, shard=parsed, writer_id=writer_id or parsed.writer_id
            )
        left = _nothing_left(options, lambda: _limits(server_url, servers, model))
        if left is not None:
            _tidy(options.out, server_url, dump_dir, None if ray else servers)
            return left
        if shard is None:
            _warn_live_writers(options.out)
        if ray:  # the dump roots are on the Ray nodes
            with GracefulStop() as stop:
                return _extract_ray(options, servers, ray_address, stop)
        if servers is not None:
            options = dataclasses.replace(options, servers=read_servers(servers))
            _refuse_other_setting(options.out, options.servers)
            _warn_small_pages([root for _, root in options.servers])
            with GracefulStop():
                return _extract_parallel(options, *options.servers[0])
        _warn_small_pages([dump_dir])
        with (
            GracefulStop(stop_notice()) as stop,
            _server(server_url, dump_dir, model) as (url, root),
        ):
            _refuse_other_setting(options.out, [(url, root)])
            if options.workers > 1:
                return _extract_parallel(options, url, root)
            run = functools.partial(_extract, options, url, root, stop)
            return anyio.run(_until_stopped, stop, run)

    _run_guarded(job)


def _refuse_other_setting(store_path: str, servers: Sequence[tuple[str, Path | None]]) -> None:
    """Refuse a store made under another setting than the servers' producers dump, before any
    request: each sample would be extracted only for the store to refuse it."""
    from hsdump._protocol import read_manifests
    from hsdump._settings import setting
    from hsdump._store.provenance import check_server
    from hsdump._store.store import open_store

    try:
        if not store_may_exist(store_path):
            return
        with open_store(store_path, "r") as store:
            provenance, where = store.provenance, store.where
    except (OSError, HsdumpError):
        return  # the run itself says what is wrong with the store
    if provenance is None:
        return
    for url, dump_dir in servers:
        try:
            live = [m for m in read_manifests(dump_dir or setting("dump_dir")) if m.is_alive()]
        except (OSError, HsdumpError):
            continue  # no producer there: the run's client says so
        if live:
            check_server(provenance, live[0], where=where, url=url)


def _check_readable(dataset: Path) -> None:
    """Refuse a dataset file that cannot be opened, naming it and why."""
    from hsdump._exceptions import InputError

    try:
        with dataset.open("rb"):
            pass
    except OSError as exc:
        raise InputError(f"cannot read the dataset {dataset}: {exc.strerror or exc}") from exc


def _tidy(store: str, server_url: str | None, dump_dir: Path | None, servers: Path | None) -> None:
    """Remove what exited writers left in the store and exited clients in this node's dump roots
    (the late dump of a timed-out request): a run with nothing to extract opens no part and no
    client, whose opening would do it. Live writers' parts and clients' dumps are kept."""
    from hsdump._client.janitor import remove_stale
    from hsdump._settings import setting
    from hsdump._store.store import tidy_store

    tidy_store(store)

    if servers is not None:
        roots = [root for _, root in read_servers(servers)]
    else:
        roots = [dump_dir or setting("dump_dir")] if server_url is not None else []
    for root in roots:
        if root is not None:
            remove_stale(Path(root))


def _warn_live_writers(store: str) -> None:
    """Say so when another run writes the store now: runs without --shard each extract every
    sample they are given."""
    if not store_may_exist(store):
        return  # a new store: no writers, and no need to import zarr yet
    from hsdump._store.store import live_writers

    held = live_writers(store)
    if held:
        console.print(
            f"[yellow]warning: another run is writing {store} now (live writers hold "
            f"{', '.join(held)}). Without --shard, each run extracts every sample it is given: "
            "samples in both datasets are stored twice (verify-store lists them). Split one "
            "dataset between concurrent runs with --shard I/N, or let the other run finish.[/]",
            highlight=False,
            soft_wrap=True,
        )


def _warn_small_pages(roots: Sequence[Path | None]) -> None:
    """Warn about each dump root on a tmpfs with 4 KB pages (the server's log says so too)."""
    from hsdump._protocol import small_page_warning

    for root in roots:
        warning = None if root is None else small_page_warning(root)
        if warning is not None:
            console.print(f"[yellow]warning: {warning}[/]", highlight=False, soft_wrap=True)


def _limits(server_url: str | None, servers: Path | None, model: Path | None) -> InputLimits:
    """The input limits of the server a run will use, found without starting one."""
    from hsdump._client.limits import InputLimits, local_model_config
    from hsdump._run.inputs import input_limits

    if server_url is not None:
        return input_limits(server_url)
    if servers is not None:
        return InputLimits()  # checked by the run, against each server
    if model is None:
        from hsdump._servers.reference import DEFAULT_CONFIG as config
    else:
        config = local_model_config(str(model))
    return InputLimits.from_server_info(
        {
            "vocab_size": config.get("vocab_size"),
            "context_length": config.get("max_position_embeddings"),
        }
    )


def _nothing_left(options: _ExtractOptions, limits: Callable[[], InputLimits]) -> int | None:
    """When the store holds every good sample of the dataset, say so and return the exit code
    (1 when bad lines remain, named with the failures file): no server is started. Else None."""
    from hsdump._run.common import ExtractionSummary, FailureLog, failures_path_for
    from hsdump._run.inputs import read_dataset

    path, store_path = options.dataset, options.out
    failures = failures_path_for(local_side(store_path))
    try:
        lines = _count_lines(path) if store_may_exist(store_path) else 0
        if not lines:
            return None
        from hsdump._store.store import open_store  # zarr: only for a store that may be there

        with open_store(store_path, "r") as store:
            if len(store) + _rejected_lines(failures) < lines:
                return None  # found without parsing the dataset
            dataset = read_dataset(path, limits=limits(), tokenizer=options.tokenizer_or_none())
            if options.shard is not None:
                dataset = options.shard.select(dataset)
            mismatch = getattr(store, "token_mismatch", lambda sample: None)
            done = all(s.id in store and mismatch(s) is None for s in dataset.samples)
    except (OSError, HsdumpError) as exc:
        if is_url(store_path) and isinstance(exc, (ConfigError, StoreIOError)):
            raise  # the URL, credentials or endpoint: said before any server is asked
        return None  # the run itself reports what is wrong
    if not done:
        return None
    prior = _say_bad_lines(dataset)
    with FailureLog(failures, prior):  # the file records what is left: these lines, or none
        pass
    held = f"{store_path} holds all {len(dataset.samples)} samples of {path} (no server started)"
    if options.as_json:  # what a run would report: every sample skipped
        summary = ExtractionSummary(skipped=len(dataset.samples), failures=prior)
        summary.finished = summary.started
        options.report(summary, failures)
    elif not prior:
        console.print(f"done: nothing to extract, {held}", highlight=False, soft_wrap=True)
    else:
        console.print(
            f"nothing left to extract: {held}; {len(prior)} dataset lines rejected: see "
            f"{failures}, fix them and rerun",
            highlight=False,
            soft_wrap=True,
        )
    return EXIT_FAILURES if prior else EXIT_OK


def _rejected_lines(failures: Path) -> int:
    """Dataset lines the last run rejected, from its failures file (0 without one)."""
    try:
        records = [json.loads(line) for line in failures.read_text().splitlines() if line]
    except (OSError, ValueError):
        return 0
    return sum(1 for r in records if isinstance(r, dict) and r.get("attempts") == 0)


def _count_lines(path: Path) -> int:
    with path.open("rb") as lines:
        return sum(1 for line in lines if line.strip())


@app.command("serve-reference")
def serve_reference(
    model: Annotated[
        Path | None, typer.Option(help="Local transformers model directory; none: built-in.")
    ] = None,
    dump_dir: Annotated[
        Path | None, typer.Option(help="Dump root (default $HSDUMP_DUMP_DIR or /dev/shm/hsdump).")
    ] = None,
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: any free port).")] = 30000,
    layer_ids: Annotated[
        str | None, typer.Option(help="Comma-separated aux layer ids (default 2,N//2,N-3).")
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="cpu or cuda (default: cuda if present).")
    ] = None,
    final_norm: Annotated[
        Literal["post_norm", "pre_norm"],
        typer.Option(help="Final state: post_norm (SpecForge) or pre_norm (speculators)."),
    ] = "post_norm",
) -> None:
    """Serve a transformers model with SGLang's API, dumping hidden states like SGLang + hsdump.

    Examples:
      hsdump serve-reference --dump-dir /dev/shm/hsdump --port 30000
      hsdump serve-reference --model ./my-llama --layer-ids 1,8,13

    Ctrl-C or SIGTERM stops it.
    """
    from hsdump._exceptions import ConfigError

    def job() -> int:
        from hsdump._servers.reference import ReferenceServer

        try:
            layers = [int(x) for x in layer_ids.split(",")] if layer_ids else None
        except ValueError as exc:
            raise ConfigError(
                f"--layer-ids takes comma-separated integers, got {layer_ids!r}"
            ) from exc
        stop = _block_stop_signals()  # before the server's threads start: they inherit it
        server = ReferenceServer(
            model,
            dump_dir=dump_dir,
            host=host,
            port=port,
            layer_ids=layers,
            device=device,
            final_norm=final_norm,
        )
        with server:
            console.print(
                f"serving on {server.url}, layers {server.layer_ids} -> {server.dump_dir}"
            )
            console.print(
                f"extract with: hsdump extract DATASET --out STORE --server-url {server.url} "
                f"--dump-dir {server.dump_dir}",
                soft_wrap=True,
            )
            signal.sigwait(stop)
        return EXIT_OK

    _run_guarded(job)


def _block_stop_signals() -> set[signal.Signals]:
    """Hold SIGINT/SIGTERM for ``sigwait``, so the server stops cleanly on either."""
    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    return stop


@app.command("verify-store")
def verify_store(
    store: Annotated[
        str,
        typer.Argument(metavar="STORE", help="The Zarr store to check (a path or s3:// URL)."),
    ],
    drop: Annotated[
        bool,
        typer.Option(
            "--drop", help="Drop corrupted samples from the store, so a rerun extracts them again."
        ),
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the report as one JSON object on stdout.")
    ] = False,
) -> None:
    """Re-read every committed sample and compare its checksum.

    Example:
      hsdump verify-store hs.zarr
      hsdump verify-store hs.zarr --drop     # then rerun hsdump extract

    Exit code 0 when every sample is intact, 1 when one is corrupted or duplicated.
    """

    def job() -> int:
        from hsdump._store.store import verify_store as verify

        report = verify(store, drop=drop)
        code = EXIT_OK if report.clean else EXIT_FAILURES
        if as_json:
            dropped = len(report.corrupted) if drop else 0
            text = json.dumps({**report.model_dump(mode="json"), "dropped": dropped})
            out.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True)
            return code
        for bad in report.corrupted:
            console.print(
                f"[red]corrupted[/] {bad.sample_id} ({bad.part}): {bad.reason}", highlight=False
            )
        for sample_id in report.duplicates:
            console.print(f"[red]duplicate[/] {sample_id}", highlight=False)
        out.print(
            f"checked {report.checked} samples: {report.ok} intact, "
            f"{len(report.corrupted)} corrupted, {len(report.duplicates)} duplicated"
        )
        if drop and report.corrupted:
            out.print(f"dropped {len(report.corrupted)} corrupted: rerun the extraction")
        return code

    _run_guarded(job)


VERIFY_HELP = _reflow(
    """Recompute K random samples of STORE with MODEL_DIR and judge each stored layer.

For each stored layer (the aux layers by transformers' hidden_states index, then the final state,
post- or pre-norm as the store records) the stored difference is max |stored - fp32| / max |fp32|
over a sample's tokens, the largest over the K samples. The noise floor is the same metric between
a bf16 and an fp32 forward of the same model and tokens. A layer passes when its difference is at
most 1.5 x the noise floor + 0.001: zero states, a layer offset, another model or a broken chunked
prefill are far above it. Exit code 0 when every layer passes, 1 when one fails, 2 when the check
could not run (no model, no store, a model that does not fit the store).

Examples:
  hsdump verify hs.zarr --against ./my-llama --samples 8
  hsdump verify sample.zarr --against builtin   # the reference server's model
"""
)


@app.command("verify", help=VERIFY_HELP)
def verify_model(
    store: Annotated[str, typer.Argument(metavar="STORE", help="The Zarr store to check.")],
    against: Annotated[
        str,
        typer.Option(
            metavar="MODEL_DIR",
            help="The model the server ran: a local transformers model directory, or builtin.",
        ),
    ],
    samples: Annotated[int, typer.Option(min=1, help="Samples to recompute.")] = 4,
    seed: Annotated[int, typer.Option(help="Seeds the choice of samples.")] = 0,
    device: Annotated[
        Literal["cpu", "cuda"] | None, typer.Option(help="Where to run (default: cuda if present).")
    ] = None,
) -> None:
    def job() -> int:
        from hsdump._training.verify_model import verify_against_model

        def say(line: str) -> None:
            console.print(line, markup=False, highlight=False, soft_wrap=True)

        report = verify_against_model(
            store, against, samples=samples, seed=seed, device=device, progress=say
        )
        table = Table()
        table.add_column("layer", no_wrap=True)  # the name the summary line repeats, never cut
        for column in ("stored diff", "bf16 floor", "limit", "verdict", "worst sample"):
            table.add_column(column)
        for layer in report.layers:
            verdict = "[green]pass[/]" if layer.passed else "[bold red]FAIL[/]"
            table.add_row(
                layer.layer, f"{layer.stored_diff:.3g}", f"{layer.noise_floor:.3g}",
                f"{layer.limit:.3g}", verdict, layer.worst_sample,
            )  # fmt: skip
        out.print(table)
        failed = [layer.layer for layer in report.layers if not layer.passed]
        where = f"{len(report.sample_ids)} samples on {report.device}"
        if failed:
            line = f"FAIL: {', '.join(failed)} differ from the model ({where})"
            out.print(line, highlight=False, soft_wrap=True)
            return EXIT_FAILURES
        out.print(f"pass: every layer matches the model ({where})", highlight=False, soft_wrap=True)
        return EXIT_OK

    _run_guarded(job)


@app.command()
def stats(
    store: Annotated[str, typer.Argument(metavar="STORE", help="The Zarr store to summarise.")],
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the summary as one JSON object on stdout.")
    ] = False,
) -> None:
    """The store's provenance, the masked fraction of its tokens (loss mask 0), then a per-layer
    summary: count, mean, std, max |x|, non-finite.

    Example:
      hsdump stats hs.zarr

    Exit code 1 when a layer holds non-finite values.
    """

    def job() -> int:
        from hsdump._store.provenance import describe
        from hsdump._store.store import open_store

        with open_store(store, "r") as opened:
            layers = opened.stats()
            trained, tokens = opened.loss_mask_counts()
            masked = (tokens - trained) / tokens if tokens else 0.0
            summary = {
                "store": store, "samples": len(opened), "tokens": tokens,
                "trained_tokens": trained, "masked_fraction": masked,
                "provenance": opened.provenance and opened.provenance.model_dump(mode="json"),
                "layers": [layer.summary() for layer in layers],
            }  # fmt: skip
            lines = [
                f"{len(opened)} samples, {tokens:,} tokens in {store}",
                f"loss mask: {masked:.1%} of the tokens masked (0: not trained on), "
                f"{trained:,} trained on",
                *describe(opened.provenance),
            ]
        code = EXIT_FAILURES if any(layer.non_finite for layer in layers) else EXIT_OK
        if as_json:
            text = json.dumps(summary)
            out.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True)
            return code
        for line in lines:
            out.print(line, markup=False, highlight=False, soft_wrap=True)
        table = Table("layer", "values", "mean", "std", "max |x|", "non-finite")
        for layer in layers:
            row = layer.summary()
            table.add_row(
                str(row["layer"]), f"{row['count']:,}", f"{row['mean']:.4g}", f"{row['std']:.4g}",
                f"{row['max_abs']:.4g}", str(row["non_finite"]),
            )  # fmt: skip
        out.print(table)
        return code

    _run_guarded(job)


@app.command("export")
def export(
    store: Annotated[str, typer.Argument(metavar="STORE", help="The Zarr store to export.")],
    destination: Annotated[
        Path, typer.Argument(metavar="OUT", help="The export directory (created, or resumed).")
    ],
    fmt: Annotated[
        Literal["specforge", "speculators"],
        typer.Option("--format", help="The trainer whose files to write."),
    ],
    ids: Annotated[
        Path | None,
        typer.Option(help="File of sample ids, one per line: export these, in this order."),
    ] = None,
    final_norm: Annotated[
        Literal["post_norm", "pre_norm"] | None,
        typer.Option(help="What the final state is, for a store that does not record it."),
    ] = None,
) -> None:
    """Write a store's samples as the files a drafter trainer reads; a rerun resumes.

    Examples:
      hsdump export hs.zarr sf-data --format specforge     # for SpecForge
      hsdump export hs.zarr sp-data --format speculators   # for speculators

    SpecForge reads OUT as data.hidden_states_path, in its YAML or as an override:
      specforge train -c CONFIG data.hidden_states_path=OUT
    speculators reads it as --data-path OUT.
    It ends by naming the layer ids to train with.
    """

    def job() -> int:
        from hsdump._training.export import export_store, read_ids_file

        sample_ids = read_ids_file(ids) if ids is not None else None
        progress = Progress(
            TextColumn("[bold]export"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} samples {task.fields[rate]}"),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        )
        task = progress.add_task("export", total=None, rate="")

        def show(s: ExportSummary) -> None:
            rate = f"{s.bytes_per_s / 1e6:,.0f} MB/s"
            progress.update(task, total=s.samples_total, completed=s.samples_done, rate=rate)

        with progress:
            summary = export_store(
                store,
                destination,
                format=fmt,
                sample_ids=sample_ids,
                final_norm=final_norm,
                progress=show,
            )
        where = "model.aux_hidden_state_layer_ids" if fmt == "specforge" else "target_layer_ids"
        console.print(
            f"exported {summary.samples_total} samples to {destination}: {summary.written} "
            f"written, {summary.skipped} already there, {summary.bytes_written / 1e6:,.1f} MB in "
            f"{summary.wall_s:.1f} s ({summary.bytes_per_s / 1e6:,.0f} MB/s); train with "
            f"{where} {summary.layer_ids}",
            highlight=False,
        )
        return EXIT_OK

    _run_guarded(job)


def main() -> None:
    """The ``hsdump`` console script."""
    sys.setswitchinterval(EXTRACTION_SWITCH_INTERVAL_S)  # this process is hsdump's own
    try:
        app()
    except SystemExit as exc:
        _exit(exc.code)
    _exit(0)


def _exit(code: str | int | None) -> NoReturn:
    """End the process once the command has: its exit handlers run, its output is flushed, but
    the interpreter does not tear down every module, which took 0.4 s after the last commit with
    torch imported (2 cores)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more to say
            stream.flush()
    if isinstance(code, str):
        print(code, file=sys.stderr)
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)
