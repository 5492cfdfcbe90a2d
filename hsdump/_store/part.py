"""One writer's part of a store: a ragged, sharded token axis, an index and a commit counter.

Layout of ``part-<writer_id>/``::

    zarr.json        attributes["hsdump_part"]: PartState, rewritten atomically (the commit point),
                     and "hsdump_part_crc32": its checksum (hsdump._store.integrity); copies of its
                     counters for zarr-only readers: "committed_samples", "committed_tokens"
    hidden     [tokens, K+1, H]  float bits (uint16 for bf16): K aux layers, then the final state;
                                 a sample's rows are contiguous and start on a chunk boundary
    input_ids  [tokens]          int32
    loss_mask  [tokens]          uint8
    index/rows      [n, 4] int64 offset, length, has_mask, crc32 of the sample's stored bytes
                           (attributes["columns"] names them)
    index/sample_id [n]    str
    index/tokens    [n]    uint64 digest of the sample's token ids and loss mask (0: not recorded)

Samples are gathered in an in-RAM shard buffer and a shard is written once it is full (appending to
an existing shard would make zarr read and rewrite it whole). A sample is committed when all of its
rows are on disk: its index row is written, then the counter in ``zarr.json``. Samples whose rows
are on disk are committed together, at most once per ``HSDUMP_COMMIT_INTERVAL_S`` while writing;
``flush()`` writes the partial shard too and commits everything. On resume the committed head of
the open shard is reloaded into the buffer, or the next full-shard write would zero it.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from hsdump._exceptions import DumpValidationError
from hsdump._store import zarr_adapter
from hsdump._store.codecs import bits_dtype, hidden_compressors, small_compressors
from hsdump._store.integrity import (
    COMMITTED_SAMPLES_KEY,
    STATE_CRC_KEY,
    IndexChecksum,
    committed_counts,
    damaged,
    extend_index_checksum,
    open_array,
    state_attributes,
    state_crc,
    stored_token_digest,
)
from hsdump._store.options import StoreOptions
from hsdump._store.provenance import Provenance
from hsdump._store.shardbuf import Piece, Placed, ShardBuffer, ValueCheck, place_sample
from hsdump._store.shardio import DAMAGED, FlatChunks, ShardIO, codec_pool
from hsdump._store.stats import LayerStats, RowStats, merge_layer_lists

if TYPE_CHECKING:
    import zarr

__all__ = [
    "INDEX_COLUMNS",
    "RECHECK_S",
    "PartIndex",
    "PartLayout",
    "PartState",
    "PartWriter",
    "Refused",
    "load_part_index",
]

logger = logging.getLogger(__name__)

STATE_KEY = "hsdump_part"
_SHARDS_PER_GROW = 64  # capacity grows a fixed step, so few metadata rewrites and few stray shards
_IDS_CHUNK_SHARDS = 16
_INDEX_CHUNK = 4096  # rows; rewritten (read-modify-write) on each commit
INDEX_COLUMNS = ("offset", "length", "has_mask", "crc32")  # of index/rows, in its attributes
# "c.12.0.0" instead of "c/12/0/0": one directory per array instead of two per shard.
_FLAT_KEYS: Any = {"name": "default", "separator": "."}
#: After an unclean stop, the samples a writer committed in its last this many seconds are re-read
#: against their checksums when its part is opened: a disk that lost flushed writes loses the
#: newest first (the kernel's own writeback of unflushed data takes up to ~30 s).
RECHECK_S = 30.0


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PartLayout(_Frozen):
    """Array geometry of a part, fixed by its first sample."""

    layers: int
    hidden_size: int
    dtype: str
    chunk_tokens: int
    shard_tokens: int
    compression: str


class PartState(_Frozen):
    """The committed state of a part (its ``zarr.json`` attribute ``hsdump_part``).

    ``index_crc`` is None in parts whose index was last committed before it existed.
    ``recheck_from``: while a writer has the part open, the first row of the commits of its last
    `RECHECK_S` seconds (None once it closed cleanly): after an unclean stop those rows are
    re-read against their checksums when the part is opened. ``dropped``: rows found damaged and
    dropped from the index (their ids are extracted again).
    """

    format: Literal["hsdump-part"] = "hsdump-part"
    version: Literal[1] = 1
    writer_id: str
    n_committed: int = 0
    num_tokens: int = 0
    bytes_raw: int = 0
    bytes_stored: int = 0
    open_shard: int = -1
    open_shard_bytes: int = 0
    layout: PartLayout | None = None
    provenance: Provenance | None = None
    stats: list[LayerStats] = []
    index_crc: IndexChecksum | None = None
    recheck_from: int | None = None
    dropped: list[int] = []


@dataclass
class PartIndex:
    """The committed rows of one part, held in RAM.

    ``tokens`` holds each sample's token digest (0 for samples written before digests existed).
    """

    name: str
    state: PartState
    sample_ids: list[str] = field(default_factory=list)
    rows: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), np.int64))
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))


def load_part_index(group: zarr.Group, name: str, where: str) -> PartIndex:
    """Read a part's committed state and index, checked against their checksums where recorded.

    Rows past the counter are never read.

    Raises:
        StoreCorruptedError: A metadata file cannot be decoded or fails its checksum (named).
    """
    state = _load_state(group, f"{where}/{name}/zarr.json")
    n = state.n_committed
    if not n:
        return PartIndex(name, state)
    base = f"{where}/{name}/index"
    rows = _read_index(group, "index/rows", n, f"{base}/rows").astype(np.int64)
    sids = [str(s) for s in _read_index(group, "index/sample_id", n, f"{base}/sample_id").tolist()]
    if state.index_crc is None:  # not covered: no digests were recorded either
        return PartIndex(name, state, sids, rows, np.zeros(n, np.uint64))
    tokens = _read_index(group, "index/tokens", n, f"{base}/tokens").astype(np.uint64)
    found = extend_index_checksum(None, rows, sids, tokens)
    for key, file in (("rows", "rows"), ("sample_ids", "sample_id"), ("tokens", "tokens")):
        got, want = getattr(found, key), getattr(state.index_crc, key)
        if got != want:
            raise damaged(f"{base}/{file}", f"checksum {got:#010x} != committed {want:#010x}")
    return PartIndex(name, state, sids, rows, tokens)


def _load_state(group: zarr.Group, file: str) -> PartState:
    attrs = group.attrs
    raw, crc = attrs.get(STATE_KEY), attrs.get(STATE_CRC_KEY)
    if crc is not None and crc != (found := state_crc(raw)):
        raise damaged(file, f"the part state's checksum {found:#010x} != recorded {crc!r}")
    try:
        state = PartState.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the state"
        raise damaged(file, f"the part state does not parse ({where}: {first['msg']})") from exc
    if COMMITTED_SAMPLES_KEY in attrs:  # absent in parts last committed before they existed
        for key, want in committed_counts(state.model_dump()).items():
            if attrs.get(key) != want:
                raise damaged(file, f"{key} is {attrs.get(key)!r}, the part state says {want}")
    return state


def _read_index(group: zarr.Group, key: str, n: int, file: str) -> np.ndarray:
    """The first ``n`` entries of an index array; every decode failure names the array."""
    try:
        values = np.asarray(group[key][:n])  # type: ignore[index]
    except OSError:
        raise  # the store reports I/O errors as such
    except Exception as exc:  # zarr and its codecs raise anything from KeyError to RuntimeError
        raise damaged(file, f"cannot decode: {type(exc).__name__}: {exc}") from exc
    if values.shape[0] != n:
        raise damaged(file, f"holds {values.shape[0]} entries, the part committed {n}")
    return values


@dataclass
class _Pending:
    sample_id: str
    offset: int
    length: int
    has_mask: int
    placed: Future[Placed]
    raw_bytes: int
    tokens: int


@dataclass(frozen=True)
class Refused:
    """A sample whose values placement refused (`ValueCheck`): not committed, its rows zeros."""

    sample_id: str
    num_tokens: int
    raw_bytes: int
    error: DumpValidationError


class PartWriter:
    """Appends samples to one part. Not thread-safe: the store serialises calls."""

    def __init__(
        self,
        group: zarr.Group,
        index: PartIndex,
        *,
        on_commit: Any,
        where: str,
        guard: Callable[[], None] | None = None,
        options: StoreOptions,
    ) -> None:
        """``options`` are resolved (`StoreOptions.resolved`): every field is set.

        Full shards are written ``options.shard_writers`` at once. Encoding a shard runs on the
        codec pool, but writing it is serial, and a sample waits for the oldest shard in flight:
        one process storing H=7168 samples on the 16-core GPU host stored 28.0k tok/s with 4
        writers, 33.6k with 8 and 29.9k with 16; with one writer (2 cores) the pool idled while
        each shard was written. Each one holds a shard buffer in RAM (235 MB at H=7168).
        """
        assert options.shard_writers is not None and options.commit_interval_s is not None
        self.group = group
        self._cores = options.cores
        self._guard = guard
        self.index = index
        self._where = where
        self._on_commit = on_commit
        self._pending: list[_Pending] = []
        self.pending_ids: set[str] = set()
        self.refused: list[Refused] = []
        self._pending_provenance: Provenance | None = None
        self._open: ShardBuffer | None = None
        self._next = 0
        self._flushed_to = 0
        self._arrays: dict[str, Any] = {}
        self._spare: list[ShardBuffer] = []
        self._inflight: collections.deque[tuple[int, Future[int], ShardBuffer]] = (
            collections.deque()
        )
        self._max_inflight = options.shard_writers
        self._small_chunks = threading.Lock()
        self._last_commit = time.monotonic()  # the first commit comes one interval after open
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (t, first row)
        # Each commit costs ~7 ms of zarr work (mostly holding the GIL); once per shard, it was a
        # third of the writer thread's time on 16 cores.
        self._commit_interval = options.commit_interval_s
        self._flusher = ThreadPoolExecutor(
            max_workers=self._max_inflight, thread_name_prefix="hsdump-shard-writer"
        )
        if index.state.layout is not None:
            self._open_arrays(index.state.layout)
            self._resume(index.state.layout)

    @property
    def state(self) -> PartState:
        """The last committed state."""
        return self.index.state

    @property
    def provenance(self) -> Provenance | None:
        """The part's provenance, committed or set by a sample still in the buffer."""
        return self.state.provenance or self._pending_provenance

    def set_layout(self, layout: PartLayout, provenance: Provenance) -> None:
        """Create the arrays for the first sample's geometry."""
        self._pending_provenance = provenance
        if self.state.layout is None:
            self._create_arrays(layout)
            self.index.state = self.state.model_copy(update={"layout": layout})

    # -- adding samples ------------------------------------------------------------------------

    def add(
        self,
        sample_id: str,
        aux: np.ndarray,
        final: np.ndarray,
        ids: np.ndarray,
        mask: np.ndarray | None,
        stats: RowStats,
        check: ValueCheck | None = None,
    ) -> None:
        """Reserve rows for one sample and place them on the codec pool; commit what is on disk.

        The rows are copied, checksummed and accounted in ``stats`` by a job while this thread
        takes the next sample; a shard is written once its jobs are done. A sample whose values
        fail ``check`` is not committed: it lands in `refused` when its shard is on disk.
        """
        offset, length = self._next, aux.shape[0]
        pieces, full = self._reserve(length, ids, mask)
        placed = codec_pool(self._cores).submit(
            place_sample, pieces, aux, final, ids, mask, stats, check
        )
        for piece in pieces:  # one piece per shard: a sample's pieces are consecutive shards
            piece.shard.placing.append(placed)
        for shard in full:
            self._flush_shard(shard, full=True)
        self._pad_after(offset + length)
        raw = aux.nbytes + final.nbytes
        tokens = stored_token_digest(ids, mask)
        self._pending.append(
            _Pending(sample_id, offset, length, int(mask is not None), placed, raw, tokens)
        )
        self.pending_ids.add(sample_id)
        self._commit_ready()

    def _reserve(
        self, length: int, ids: np.ndarray, mask: np.ndarray | None
    ) -> tuple[list[Piece], list[ShardBuffer]]:
        """The pieces of the next ``length`` rows (ids and mask set), and the shards they fill."""
        shard_tokens = self._layout.shard_tokens
        pieces, full, pos = [], [], 0
        while pos < length:
            cur = self._next + pos
            shard = self._open_shard(cur)
            row, take = cur - shard.start, min(length - pos, shard.start + shard_tokens - cur)
            shard.ids[row : row + take] = ids[pos : pos + take]
            shard.mask[row : row + take] = 1 if mask is None else mask[pos : pos + take]
            pieces.append(Piece(shard, row, pos, take))
            pos += take
            if row + take == shard_tokens:
                full.append(shard)
                self._open = None
        return pieces, full

    def _pad_after(self, end: int) -> None:
        ct = self._layout.chunk_tokens
        padded = -(-end // ct) * ct
        shard = self._open
        if padded > end and shard is not None:
            # Padding rows are written as zeros (they compress to nothing) so no stale bytes remain.
            row = end - shard.start
            shard.rows[row : row + padded - end] = 0
            shard.ids[row : row + padded - end] = 0
            shard.mask[row : row + padded - end] = 0
            if padded - shard.start == self._layout.shard_tokens:
                self._open = None
                self._flush_shard(shard, full=True)
        self._next = padded

    def _open_shard(self, cur: int) -> ShardBuffer:
        # A sample that straddles a shard boundary opens the next buffer before the full one is
        # handed to the writers: at most shard_writers + 2 buffers exist (filling, full, being
        # written).
        if self._open is None:
            layout = self._layout
            self._open = (
                self._spare.pop()
                if self._spare
                else ShardBuffer.allocate(
                    layout.shard_tokens, layout.layers, layout.hidden_size, bits_dtype(layout.dtype)
                )
            )
            self._open.start = cur - cur % layout.shard_tokens
        return self._open

    # -- writing and committing ----------------------------------------------------------------

    def flush(self) -> None:
        """Write the partial shard and commit every buffered sample."""
        self._wait_inflight()
        if self._open is not None and self._next > self._flushed_to:
            self._flush_shard(self._open, full=False)
        self._commit_ready(force=True)

    def close(self) -> None:
        """Flush and record the clean close, then stop the background shard writer."""
        try:
            self.flush()
            self.mark_clean()
        finally:
            self._flusher.shutdown(wait=True)

    def abandon(self) -> None:
        """Stop the background writer without writing anything more (after a failure)."""
        self._flusher.shutdown(wait=True, cancel_futures=True)

    def _flush_shard(self, shard: ShardBuffer, *, full: bool) -> None:
        # Full shards are written in the background while the next ones fill, up to
        # ``shard_writers`` at once; a partial shard (flush/close) is written before returning.
        self._wait_inflight(keep=self._max_inflight - 1 if full else 0)
        end = shard.start + self._layout.shard_tokens if full else self._next
        self._ensure_capacity(end)
        job = functools.partial(self._write_rows, shard, end)
        if full:
            self._inflight.append((end, self._flusher.submit(job), shard))
        else:
            self._apply_flush(end, job())

    def _write_rows(self, shard: ShardBuffer, end: int) -> int:
        shard.wait_placed()
        start, n = shard.start, end - shard.start
        size = self._shards.write(start // self._layout.shard_tokens, shard.rows[:n])
        with self._small_chunks:  # token-id and mask chunks span shards: read-modify-write
            self._ids_chunks.write(start, shard.ids[:n])
            self._mask_chunks.write(start, shard.mask[:n])
        return size

    def _wait_inflight(self, *, keep: int = 0, block: bool = True) -> None:
        """Account written shards in order, waiting until at most ``keep`` remain in flight."""
        while self._inflight:
            end, future, shard = self._inflight[0]
            if not future.done() and (not block or len(self._inflight) <= keep):
                return
            self._inflight.popleft()
            self._spare.append(shard)
            self._apply_flush(end, future.result())

    def _apply_flush(self, end: int, size: int) -> None:
        shard_tokens = self._layout.shard_tokens
        self._flushed_to = end
        self._account_shard((end - 1) // shard_tokens, size)

    def _account_shard(self, shard: int, size: int) -> None:
        state = self.state
        stored = (
            state.bytes_stored + size - (state.open_shard_bytes if shard == state.open_shard else 0)
        )
        self.index.state = state.model_copy(
            update={"bytes_stored": stored, "open_shard": shard, "open_shard_bytes": size}
        )

    def raw_bytes_awaiting_commit(self) -> int:
        """Raw bytes of the samples that are on disk but not committed yet."""
        return sum(p.raw_bytes for p in self._on_disk())

    def _on_disk(self) -> list[_Pending]:
        """Buffered samples whose rows are all written."""
        return [p for p in self._pending if p.offset + p.length <= self._flushed_to]

    def _commit_ready(self, *, force: bool = False) -> None:
        self._wait_inflight(block=False)
        # A commit rewrites the index chunks and zarr.json: once per commit interval at most
        # (a killed writer then redoes at most that much work), and on every flush.
        if not force and time.monotonic() - self._last_commit < self._commit_interval:
            return
        ready = self._on_disk()
        if not ready:
            return
        self._last_commit = time.monotonic()
        kept, refused = [], []
        for p in ready:
            why = p.placed.result().refused
            if why is None:
                kept.append(p)
            else:
                refused.append(Refused(p.sample_id, p.length, p.raw_bytes, why))
        if kept:
            self._commit(kept)
        self._pending = self._pending[len(ready) :]
        self.pending_ids.difference_update(p.sample_id for p in ready)
        self.refused.extend(refused)

    def _commit(self, ready: list[_Pending]) -> None:
        """Index ``ready`` (on disk, in order) and make them visible: the commit point."""
        n0, state = self.state.n_committed, self.state
        n1 = n0 + len(ready)
        rows = np.array(
            [[p.offset, p.length, p.has_mask, p.placed.result().crc] for p in ready], np.int64
        )
        sids = [p.sample_id for p in ready]
        tokens = np.array([p.tokens for p in ready], np.uint64)
        self._ensure_index_capacity(n1)
        self._arrays["rows"][n0:n1] = rows
        self._arrays["sample_id"][n0:n1] = np.array(sids, dtype=object)
        self._arrays["tokens"][n0:n1] = tokens
        covered = state.index_crc
        if covered is None:  # a part from before index checksums: cover what it holds from now on
            index = self.index
            covered = extend_index_checksum(None, index.rows, index.sample_ids, index.tokens)
        stats = state.stats
        for p in ready:
            stats = merge_layer_lists(stats, p.placed.result().stats)
        new_state = state.model_copy(
            update={
                "recheck_from": self._recheck_from(n0),
                "n_committed": n1,
                "num_tokens": state.num_tokens + sum(p.length for p in ready),
                "bytes_raw": state.bytes_raw + sum(p.raw_bytes for p in ready),
                "provenance": state.provenance or self._pending_provenance,
                "stats": stats,
                "index_crc": extend_index_checksum(covered, rows, sids, tokens),
            }
        )
        # The commit point: one atomic rewrite of the part's zarr.json (a rename on a local disk,
        # one PUT on S3), only while this writer still holds the part's lock or lease.
        if self._guard is not None:
            self._guard()
        self._write_state(new_state)
        self.index.sample_ids.extend(sids)
        self.index.rows = np.concatenate([self.index.rows, rows])
        self.index.tokens = np.concatenate([self.index.tokens, tokens])
        self._on_commit(self.index, n0, n1)

    def _recheck_from(self, first: int) -> int:
        """The first row of the commits of the last `RECHECK_S` seconds, this one included."""
        now = time.monotonic()
        self._recent.append((now, first))
        while self._recent[0][0] < now - RECHECK_S:
            self._recent.popleft()
        return self._recent[0][1]

    def _write_state(self, state: PartState) -> None:
        """Rewrite the part's ``zarr.json``: the commit point (durable when it returns)."""
        self.group.update_attributes(state_attributes(STATE_KEY, state.model_dump(mode="json")))
        self.index.state = state

    def drop(self, rows: list[int]) -> None:
        """Drop committed ``rows`` from the index (damaged: their ids are extracted again)."""
        if self._guard is not None:
            self._guard()
        dropped = sorted(set(self.state.dropped) | set(rows))
        self._write_state(self.state.model_copy(update={"dropped": dropped}))

    def mark_clean(self) -> None:
        """Record a clean close: nothing needs re-reading when the part is opened again."""
        if self.state.recheck_from is not None:
            if self._guard is not None:
                self._guard()
            self._write_state(self.state.model_copy(update={"recheck_from": None}))

    # -- arrays ----------------------------------------------------------------------------------

    @property
    def _layout(self) -> PartLayout:
        layout = self.state.layout
        assert layout is not None
        return layout

    def _create_arrays(self, layout: PartLayout) -> None:
        # Arrays left by a writer that failed or was killed before its first commit hold nothing
        # committed (the layout is committed with the first sample): replace them.
        shard, tokens = layout.shard_tokens, layout.shard_tokens * _SHARDS_PER_GROW
        row = (layout.layers, layout.hidden_size)
        self.group.create_array(
            "hidden",
            shape=(tokens, *row),
            chunks=(layout.chunk_tokens, *row),
            shards=(shard, *row),
            dtype=bits_dtype(layout.dtype),
            fill_value=0,
            compressors=hidden_compressors(layout.compression, bits_dtype(layout.dtype).itemsize),  # type: ignore[arg-type]
            attributes={"logical_dtype": layout.dtype, "axes": ["token", "layer", "hidden"]},
            chunk_key_encoding=_FLAT_KEYS,
            overwrite=True,
        )
        small: dict[str, Any] = {
            "chunks": (shard * _IDS_CHUNK_SHARDS,),
            "fill_value": 0,
            "compressors": small_compressors(),
            "chunk_key_encoding": _FLAT_KEYS,
            "overwrite": True,
        }
        self.group.create_array("input_ids", shape=(tokens,), dtype="int32", **small)
        self.group.create_array("loss_mask", shape=(tokens,), dtype="uint8", **small)
        idx: dict[str, Any] = {"compressors": small_compressors(), "overwrite": True}
        self.group.create_array(
            "index/rows",
            shape=(_INDEX_CHUNK, 4),
            chunks=(_INDEX_CHUNK, 4),
            dtype="int64",
            fill_value=0,
            **idx,
        )
        self.group.create_array(
            "index/sample_id", shape=(_INDEX_CHUNK,), chunks=(_INDEX_CHUNK,), dtype=str, **idx
        )
        self._open_arrays(layout)  # creates index/tokens

    def _create_tokens_index(self, capacity: int) -> None:
        self.group.create_array(
            "index/tokens",
            shape=(capacity,),
            chunks=(_INDEX_CHUNK,),
            dtype="uint64",
            fill_value=0,
            compressors=small_compressors(),
            overwrite=True,
        )

    def _open_arrays(self, layout: PartLayout) -> None:
        keys = {
            "hidden": "hidden",
            "input_ids": "input_ids",
            "loss_mask": "loss_mask",
            "rows": "index/rows",
            "sample_id": "index/sample_id",
        }
        self._arrays = {n: open_array(self.group, k, self._where) for n, k in keys.items()}
        if "columns" not in self._arrays["rows"].attrs:  # a new part, or one from before the names
            self._arrays["rows"].update_attributes({"columns": list(INDEX_COLUMNS)})
        if self.state.index_crc is None:
            # Nothing committed with digests (a new part, or one written before they existed):
            # every committed digest is 0, so the array is made anew.
            self._create_tokens_index(self._arrays["rows"].shape[0])
        self._arrays["tokens"] = open_array(self.group, "index/tokens", self._where)
        self._shards = ShardIO(self._arrays["hidden"], layout)
        self._ids_chunks = FlatChunks(self._arrays["input_ids"])
        self._mask_chunks = FlatChunks(self._arrays["loss_mask"])

    def _ensure_capacity(self, end: int) -> None:
        hidden = self._arrays["hidden"]
        if hidden.shape[0] >= end:
            return
        step = self._layout.shard_tokens * _SHARDS_PER_GROW
        cap = -(-end // step) * step
        for name in ("hidden", "input_ids", "loss_mask"):
            arr = self._arrays[name]
            arr.resize((cap, *arr.shape[1:]))

    def _ensure_index_capacity(self, n: int) -> None:
        if self._arrays["rows"].shape[0] >= n:
            return
        cap = -(-n // _INDEX_CHUNK) * _INDEX_CHUNK
        self._arrays["rows"].resize((cap, 4))
        self._arrays["sample_id"].resize((cap,))
        self._arrays["tokens"].resize((cap,))

    # -- resume ----------------------------------------------------------------------------------

    def _resume(self, layout: PartLayout) -> None:
        rows, ct, shard = self.index.rows, layout.chunk_tokens, layout.shard_tokens
        end = int(rows[-1, 0] + rows[-1, 1]) if len(rows) else 0
        self._next = self._flushed_to = -(-end // ct) * ct
        head = self._next % shard
        if head:
            # The next write of this shard rewrites it whole: keep its committed head.
            buf = self._open_shard(self._next)
            start = buf.start
            try:
                buf.rows[:head] = self._shards.read(start, self._next, buf.rows.dtype)
            except DAMAGED as exc:  # lost in a crash: its samples fail their checksums
                logger.warning(
                    "part %s: the last shard does not decode (%s); writing on from the next",
                    self.index.name, exc,
                )  # fmt: skip
                self._open = None
                self._spare.append(buf)
                self._next = self._flushed_to = start + shard
            else:
                buf.ids[:head] = self._arrays["input_ids"][start : self._next]
                buf.mask[:head] = self._arrays["loss_mask"][start : self._next]
        self._drop_stray_chunks(-(-self._next // shard))

    def _drop_stray_chunks(self, first_shard: int) -> None:
        """Delete shards (and id/mask chunks) written after the last commit by a killed writer."""
        hidden = self._arrays["hidden"]
        shard = self._layout.shard_tokens
        dropped = 0
        for i in range(first_shard, hidden.shape[0] // shard):
            dropped += self._delete_chunk(hidden, (i, 0, 0))
        per_ids = shard * _IDS_CHUNK_SHARDS
        for name in ("input_ids", "loss_mask"):
            arr = self._arrays[name]
            for i in range(-(-self._next // per_ids), arr.shape[0] // per_ids):
                dropped += self._delete_chunk(arr, (i,))
        if dropped:
            logger.info(
                "part %s: removed %d chunk files past the last commit", self.index.name, dropped
            )

    @staticmethod
    def _delete_chunk(arr: Any, coords: tuple[int, ...]) -> int:
        key = zarr_adapter.chunk_key(arr, coords)
        if not zarr_adapter.exists(arr.store, key):
            return 0
        zarr_adapter.delete(arr.store, key)
        return 1
