"""The hidden-state store: samples keyed by ID in a chunked, compressed Zarr store.

A store is a zarr group with one part per writer (see `hsdump._store.part`)::

    store.zarr/
      zarr.json              attributes["hsdump_store"] = {"format": "hsdump-store", "version": 1}
      part-<writer_id>/      one writer's samples and index

Readers merge the part indexes in RAM (a few ms for 37,000 samples); nothing lists samples on disk.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from hsdump._exceptions import (
    ConfigError,
    HsdumpError,
    InputError,
    PartLockedError,
    ProvenanceMismatch,
    SampleExistsError,
    SampleNotFoundError,
    StoreClosedError,
    StoreNotFoundError,
    StoreReadOnlyError,
    StoreWriteFailedError,
)
from hsdump._protocol import dtype_spec
from hsdump._store.codecs import (
    Compression,
    chunk_tokens_for,
    codec_description,
    hidden_compressors,
)
from hsdump._store.durable import PARTIAL_SUFFIX
from hsdump._store.intake import check_tensors, ids_int32, moments_of
from hsdump._store.integrity import (
    COMMITTED_SAMPLES_KEY,
    committed_counts,
    damaged,
    sample_token_digest,
    state_attributes,
)
from hsdump._store.locks import PartLock, break_lease, lock_part, part_holder
from hsdump._store.objstore import abort_uploads, dependency_error
from hsdump._store.options import StoreOptions
from hsdump._store.part import (
    STATE_KEY,
    PartIndex,
    PartLayout,
    PartState,
    PartWriter,
    Refused,
    load_part_index,
)
from hsdump._store.provenance import Provenance, check_compatible, provenance_of
from hsdump._store.reader import CorruptSample, PartReader, VerifyReport, verify_parts
from hsdump._store.roots import (
    PART_PREFIX,
    Mode,
    child_groups,
    describe,
    local_dir,
    open_root,
    os_error,
)
from hsdump._store.shardbuf import ValueCheck
from hsdump._store.stats import LayerStats, RowStats, merge_layer_lists

if TYPE_CHECKING:
    import zarr

    from hsdump._types import HiddenStates, Sample

__all__ = [
    "HiddenStateStore",
    "VerifyReport",
    "live_writers",
    "open_store",
    "tidy_store",
    "verify_store",
]

logger = logging.getLogger(__name__)

IfExists = Literal["error", "skip"]
DEFAULT_WRITER_ID = "default"
DEFAULT_SHARD_TOKENS = 4096


def open_store(
    path: str | os.PathLike[str] | Any,
    mode: Mode = "a",
    *,
    writer_id: str | None = None,
    compression: Compression = "zstd",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    chunk_tokens: int | None = None,
    verify_reads: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    options: StoreOptions | None = None,
) -> HiddenStateStore:
    """Open (or create) a hidden-state store.

    Args:
        path: A local directory, an ``s3://bucket/prefix`` URL (see docs/object-storage.md), or
            a zarr ``Store``.
        mode: ``"r"`` read only; ``"a"`` create or append, resuming this writer's part;
            ``"w"`` create a new store, refused if one already exists at ``path``.
        writer_id: Names this writer's part (default ``"default"``). A rerun with the same id
            resumes its part; concurrent writers need distinct ids.
        compression: Hidden-state codec: ``"zstd"`` (Blosc zstd level 1, byte shuffle, 1 MiB
            blocks; the default), ``"lz4"`` (faster decode, lower ratio) or ``"none"``.
        shard_tokens: Tokens per shard file (rounded up to a multiple of the chunk size).
        chunk_tokens: Tokens per compressed chunk (default: a power of two giving ~2 MiB
            chunks). Every sample starts on a chunk boundary.
        verify_reads: Recompute each sample's checksum when it is read.
        storage_options: For ``s3://`` URLs: s3fs options (``endpoint_url``, ``profile``,
            ``key``/``secret``, ``client_kwargs``...); credentials and the endpoint otherwise
            come from the AWS environment variables and config files. Never logged.
        options: How a writer commits, and the threads it uses (`StoreOptions`); each field
            left None falls back to its ``HSDUMP_*`` variable, then to its default.

    Returns:
        The open store; close it (or use it as a context manager) to commit buffered samples.

    Raises:
        ConfigError: A mode, size or option that does not exist or is out of range.
        InputError: A ``compression`` other than ``"zstd"``, ``"lz4"`` or ``"none"``.
        StoreNotFoundError: No store at ``path`` (mode ``"r"``).
        StoreExistsError: A store exists at ``path`` (mode ``"w"``).
        NotAStoreError: ``path`` is a zarr group that is not an hsdump store.
        PartLockedError: Another live writer holds this ``writer_id``'s part.
        StoreIOError: The disk or S3 failed.
        StoreCorruptedError: The store's or the part's metadata is damaged (the file is named).
    """
    if mode not in ("r", "a", "w"):
        raise ConfigError(f"mode must be 'r', 'a' or 'w', got {mode!r}")
    if shard_tokens < 1 or (chunk_tokens is not None and chunk_tokens < 1):
        raise ConfigError(
            f"shard_tokens and chunk_tokens must be positive, got {shard_tokens}, {chunk_tokens}"
        )
    hidden_compressors(compression, 2)  # refuses an unknown codec now, not at the first write
    resolved = (options or StoreOptions()).resolved()
    root = open_root(path, mode, storage_options)
    return HiddenStateStore(
        root,
        mode=mode,
        writer_id=writer_id or DEFAULT_WRITER_ID,
        compression=compression,
        shard_tokens=shard_tokens,
        chunk_tokens=chunk_tokens,
        verify_reads=verify_reads,
        where=describe(path),
        options=resolved,
    )


def verify_store(path: str | os.PathLike[str] | Any, *, drop: bool = False) -> VerifyReport:
    """Recompute the checksum of every committed sample of the store at ``path``.

    Args:
        path: The store.
        drop: Drop the samples that fail from the index (each part opened as its writer), so
            that a rerun of the extraction writes them again.

    Raises:
        StoreCorruptedError: A metadata file (a part's state or index) is damaged; it is named.
        PartLockedError: ``drop`` and a live writer holds a part with damaged samples.
    """
    with open_store(path, "r") as store:
        report = store.verify()
    by_part: dict[str, list[str]] = {}
    for bad in report.corrupted if drop else []:
        by_part.setdefault(bad.part, []).append(bad.sample_id)
    for part, ids in by_part.items():
        # Opening the part as its writer drops those found at open (`recovered`) by itself.
        with open_store(path, "a", writer_id=part.removeprefix(PART_PREFIX)) as writer:
            writer.drop([sid for sid in ids if sid in writer])
    return report


def tidy_store(
    path: str | os.PathLike[str],
    *,
    gone: Iterable[str] = (),
    storage_options: Mapping[str, Any] | None = None,
) -> list[str]:
    """Reopen, each as its writer, the parts whose writers stopped without closing them (killed
    processes, dead Ray actors), so that what they wrote past their last commit (shards, chunks,
    unfinished uploads, an S3 lease) is removed. Parts held by live writers are left alone.

    A run that writes no sample never opens those parts: a rerun of a complete store, or a Ray
    run whose actors' parts carry new names after a death.

    Args:
        path: The store.
        gone: Writer ids known to be dead (killed Ray actors): their S3 leases are deleted
            first, rather than waited out.
        storage_options: As for `open_store`.

    Returns:
        The writer ids of the parts tidied.
    """
    try:
        store = open_store(path, "r", storage_options=storage_options)
    except StoreNotFoundError:
        return []
    except HsdumpError as exc:  # a run that stored its samples does not fail over this
        logger.warning("could not tidy %s: %s", describe(path), exc)
        return []
    with store:
        # Never closed, or never committed (killed before its first commit); a live writer's too.
        states = store._states()
        left = [s.writer_id for s in states if s.recheck_from is not None or not s.n_committed]
        for writer_id in set(gone) & set(left):
            with contextlib.suppress(Exception):  # then it expires by itself
                break_lease(store._root, PART_PREFIX + writer_id)
    tidied = []
    for writer_id in left:
        try:
            open_store(path, "a", writer_id=writer_id, storage_options=storage_options).close()
        except PartLockedError:
            continue  # its writer lives
        except HsdumpError as exc:  # a run that stored its samples does not fail over this
            logger.warning("could not tidy part %s of %s: %s", writer_id, describe(path), exc)
            continue
        tidied.append(writer_id)
    return tidied


def live_writers(
    path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
) -> list[str]:
    """The parts of the store at ``path`` that live writers hold now (for an S3 lease, with its
    holder's pid and host); none when there is no store yet."""
    try:  # the parts' names only: no part's index is read
        root = open_root(path, "r", storage_options)
        names = [n for n in child_groups(root) if n.startswith(PART_PREFIX)]
    except OSError as exc:
        raise os_error(exc, describe(path)) from exc
    except HsdumpError:
        return []  # no store yet; or one the run itself will report on
    held = (part_holder(root, name) for name in sorted(names))
    return [h for h in held if h is not None]


class HiddenStateStore:
    """Samples' hidden states keyed by sample ID. Create it with `open_store`.

    Reading sees committed samples only: ``len(store)``, ``sample_id in store``, iteration and
    ``store[sample_id]``. Writing buffers samples until a shard is full; `flush` and
    `close` commit the rest. Other processes' commits become visible on `refresh`.

    Attributes:
        writer_id: This writer's part (``None`` when read-only).
        where: The path or store description, for messages.
        checks_values: True: states written with ``values_checked`` False are checked as they
            are placed, and a sample that fails is refused (`take_refused`), never committed.
    """

    checks_values = True

    def __init__(
        self,
        root: zarr.Group,
        *,
        mode: Mode,
        writer_id: str,
        compression: Compression,
        shard_tokens: int,
        chunk_tokens: int | None,
        verify_reads: bool,
        where: str,
        options: StoreOptions,
    ) -> None:
        self._root = root
        self._options = options
        self.where = where
        self.writer_id = None if mode == "r" else writer_id
        self._compression = compression
        self._shard_tokens = shard_tokens
        self._chunk_tokens = chunk_tokens
        self._verify_reads = verify_reads
        self._lock = threading.RLock()
        self._part_lock: PartLock | None = None
        self._closed = False
        self._failed: BaseException | None = None
        self._writer: PartWriter | None = None
        self._readers: dict[str, PartReader] = {}
        self._where: dict[str, tuple[str, int]] = {}
        self.duplicates: list[str] = []
        self._damaged: dict[str, list[CorruptSample]] = {}  # by part: rows re-read after a crash
        self.refresh()
        if mode != "r":
            self._writer = self._open_writer(writer_id)

    @property
    def recovered(self) -> list[CorruptSample]:
        """Samples committed just before an unclean stop of their writer (a crash, a kill, a power
        loss) whose stored bytes failed their checksum when the store was opened: they are not in
        the store, and an extraction run extracts them again. Only the commits of a writer's
        last `RECHECK_S` seconds before such a stop are re-read; `verify` reads everything."""
        return [c for found in self._damaged.values() for c in found]

    # -- opening ---------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Reload every part's committed index (sees other writers' new commits)."""
        with self._lock:
            own = self._writer.index if self._writer else None
            indexes = [
                own if own and own.name == name else self._load_index(g, name)
                for name, g in self._parts()
            ]
            self._readers = {
                i.name: self._readers.get(i.name) or PartReader(self._root, i, where=self.where)
                for i in indexes
            }
            for index in indexes:
                self._readers[index.name].index = index
            for index in indexes:
                if index is not own and index.name not in self._damaged:
                    self._recheck(index)  # once a part, when it is first seen
            self._where, self.duplicates = {}, []
            for index in indexes:
                self._add_rows(index, 0, index.state.n_committed)

    def _load_index(self, group: zarr.Group, name: str) -> PartIndex:
        try:
            return load_part_index(group, name, self.where)
        except OSError as exc:
            raise os_error(exc, self.where) from exc

    def _parts(self) -> list[tuple[str, zarr.Group]]:
        """The parts, each opened alone so that a damaged one is named."""
        try:
            names = [n for n in child_groups(self._root) if n.startswith(PART_PREFIX)]
        except OSError as exc:
            raise os_error(exc, self.where) from exc
        parts = []
        for name in sorted(names):
            group = self._open_part(name)
            attrs = group.attrs
            if STATE_KEY in attrs:
                parts.append((name, group))
            elif attrs:  # a part being created has no attributes yet; any other lost its state
                found = ", ".join(map(repr, attrs))
                raise damaged(
                    f"{self.where}/{name}/zarr.json",
                    f"no part state {STATE_KEY!r} among its attributes ({found})",
                )
        return parts

    def _open_part(self, name: str) -> zarr.Group:
        import zarr

        file = f"{self.where}/{name}/zarr.json"
        try:
            group = self._root[name]
        except OSError as exc:
            raise os_error(exc, self.where) from exc
        except Exception as exc:  # zarr raises anything from TypeError to JSONDecodeError
            raise damaged(file, f"cannot decode: {type(exc).__name__}: {exc}") from exc
        if not isinstance(group, zarr.Group):
            raise damaged(file, "it describes an array, not a part's group")
        return group

    def _recheck(self, index: PartIndex) -> None:
        """Re-read the rows a writer committed in its last seconds before an unclean stop."""
        start = index.state.recheck_from
        if start is None:
            self._damaged[index.name] = []
            return
        skip, reader = set(index.state.dropped), self._readers[index.name]
        found = []
        for row in range(start, index.state.n_committed):
            if row not in skip and (reason := reader.checksum_error(row)) is not None:
                sid = index.sample_ids[row]
                found.append(CorruptSample(sample_id=sid, part=index.name, reason=reason, row=row))
        if found:
            logger.warning(
                "%s/%s: %d sample(s) committed just before an unclean stop fail their checksum "
                "and are left out (extract them again): %s",
                self.where, index.name, len(found), ", ".join(c.sample_id for c in found),
            )  # fmt: skip
        self._damaged[index.name] = found

    def _add_rows(self, index: PartIndex, n0: int, n1: int) -> None:
        left_out = set(index.state.dropped) | {c.row for c in self._damaged.get(index.name, [])}
        for row in range(n0, n1):
            if row in left_out:
                continue
            sid = index.sample_ids[row]
            if sid in self._where:
                self.duplicates.append(sid)
            else:
                self._where[sid] = (index.name, row)

    def _open_writer(self, writer_id: str) -> PartWriter:
        if not writer_id or "/" in writer_id or writer_id.startswith("."):
            raise ConfigError(f"writer_id {writer_id!r} must be a non-empty name without '/'")
        name = PART_PREFIX + writer_id
        try:
            # The lock first: of two writers racing for a new part, the loser never touches it.
            ttl_s = self._options.lease_ttl_s or 0.0  # resolved: always set
            self._part_lock = lock_part(self._root, name, self.where, writer_id, ttl_s=ttl_s)
            group = self._root.require_group(name)
            writer = self._resume_part(group, name, writer_id, self._part_lock)
            if damaged := self._damaged.get(name):  # left out since the crash: now for good
                writer.drop([c.row for c in damaged])
        except OSError as exc:
            if self._part_lock is not None:
                self._part_lock.release()
            raise os_error(exc, self.where) from exc
        except BaseException:
            if self._part_lock is not None:
                self._part_lock.release()
            raise
        self._readers[name] = PartReader(self._root, writer.index, where=self.where)
        self._cleanup_partials(name)
        return writer

    def _resume_part(
        self, group: zarr.Group, name: str, writer_id: str, lock: PartLock
    ) -> PartWriter:
        try:
            if STATE_KEY not in group.attrs:
                state = PartState(writer_id=writer_id).model_dump(mode="json")
                group.update_attributes(state_attributes(STATE_KEY, state))
            index = load_part_index(group, name, self.where)
            if COMMITTED_SAMPLES_KEY not in group.attrs:  # last committed before they existed
                group.update_attributes(committed_counts(index.state.model_dump()))
            return PartWriter(
                group,
                index,
                on_commit=self._on_commit,
                where=self.where,
                guard=lock.check,
                options=self._options,
            )
        except OSError as exc:
            raise os_error(exc, self.where) from exc
        except HsdumpError:
            raise
        except Exception as exc:  # zarr could not decode the part's arrays to resume them
            if (failed := dependency_error(exc, self.where)) is not None:
                raise failed from exc
            raise damaged(
                f"{self.where}/{name}", f"cannot resume it: {type(exc).__name__}: {exc}"
            ) from exc

    def _cleanup_partials(self, name: str) -> None:
        local = local_dir(self._root)
        if local is None:
            # On S3 a write is one atomic PUT; a killed multipart upload is invisible but billed.
            try:
                abort_uploads(self._root.store, name)
            except Exception as exc:
                logger.warning("could not abort unfinished uploads of %s: %r", name, exc)
            return
        # A killed write (ours or zarr's) leaves its temp file; the key itself was never replaced.
        for leftover in (local / name).rglob(f"*{PARTIAL_SUFFIX}"):
            leftover.unlink(missing_ok=True)
            logger.info("removed leftover temp file %s", leftover)

    def _on_commit(self, index: PartIndex, n0: int, n1: int) -> None:
        self._readers[index.name].index = index
        self._add_rows(index, n0, n1)

    # -- writing ---------------------------------------------------------------------------------

    async def awrite(self, hs: HiddenStates, *, if_exists: IfExists = "error") -> bool:
        """Write one sample from asyncio; the work runs in a thread, so the event loop keeps going.

        Returns:
            True if the sample was written, False if it existed and ``if_exists="skip"``.
        """
        import anyio

        return await anyio.to_thread.run_sync(
            functools.partial(self.write, hs, if_exists=if_exists)
        )

    def write(self, hs: HiddenStates, *, if_exists: IfExists = "error") -> bool:
        """Write one sample (blocking; `awrite` from asyncio).

        It is committed when its shard is written, or on flush.

        Raises:
            SampleExistsError: The ID is committed or buffered and ``if_exists="error"``.
            ProvenanceMismatch: The sample was produced under other settings than the store's.
            InputError: The tensors' shapes or dtypes do not fit together.
        """
        with self._lock:
            writer = self._require_writer()
            if hs.sample_id in self._where or hs.sample_id in writer.pending_ids:
                if if_exists == "skip":
                    return False
                raise SampleExistsError(
                    f"already in the store at {self.where}: pass if_exists='skip' to skip "
                    "samples that are done, or use a new sample id",
                    sample_id=hs.sample_id,
                )
            with self._writing():
                self._write_locked(writer, hs)
            return True

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Translate I/O errors; after any failure that may have touched the part, refuse writes."""
        try:
            yield
        except (InputError, ProvenanceMismatch):
            raise  # refused before anything was written
        except OSError as exc:
            self._failed = exc
            raise os_error(exc, self.where) from exc
        except BaseException as exc:
            self._failed = exc
            if isinstance(exc, Exception) and (failed := dependency_error(exc, self.where)):
                raise failed from exc
            raise

    def _write_locked(self, writer: PartWriter, hs: HiddenStates) -> None:
        from hsdump._store.codecs import tensor_to_bits

        dtype = check_tensors(hs)
        prov = provenance_of(
            hs, dtype, codec_description(self._compression, dtype_spec(dtype).itemsize)
        )
        self._check_provenance(writer, prov, hs.sample_id)
        ids = ids_int32(hs)
        mask = None
        if hs.loss_mask is not None:
            mask = hs.loss_mask.detach().cpu().numpy().astype(np.uint8, copy=False)
        layers, hidden = len(hs.layer_ids) + 1, int(hs.final_hidden_state.shape[-1])
        if writer.state.layout is None:
            row_bytes = layers * hidden * hs.final_hidden_state.element_size()
            ct = self._chunk_tokens or chunk_tokens_for(row_bytes, self._shard_tokens)
            shard = -(-self._shard_tokens // ct) * ct
            writer.set_layout(
                PartLayout(
                    layers=layers,
                    hidden_size=hidden,
                    dtype=dtype,
                    chunk_tokens=ct,
                    shard_tokens=shard,
                    compression=self._compression,
                ),
                prov,
            )
        elif writer.provenance is None:
            writer.set_layout(writer.state.layout, prov)
        # Strided views are placed as they are: a sample read from a store (aux and final are views
        # of one [T, L, H] array) cost a copy into fresh pages (3.5x a write's page faults).
        aux, final = tensor_to_bits(hs.aux_hidden_states), tensor_to_bits(hs.final_hidden_state)
        # The statistics are taken from the stored rows as they are placed, on the codec pool,
        # with the producer's row moments where it declared them.
        stats = RowStats(dtype, [*hs.layer_ids, "final"], moments_of(hs, layers))
        check = None
        if not hs.values_checked:  # the client left the check to this pass (`take_refused`)
            rid = hs.meta.rid if hs.meta is not None else None
            check = ValueCheck(hs.sample_id, rid, len(hs.layer_ids))
        writer.add(hs.sample_id, aux, final, ids, mask, stats, check)

    def _check_provenance(self, writer: PartWriter, prov: Provenance, sample_id: str) -> None:
        known = writer.provenance
        if known is not None:
            check_compatible(known, prov, where=self.where, sample_id=sample_id)
            return
        for reader in self._readers.values():
            other = reader.index.state.provenance
            if other is not None:
                check_compatible(
                    other, prov, where=f"{self.where} ({reader.index.name})", sample_id=sample_id
                )

    def _require_writer(self) -> PartWriter:
        if self._closed:
            raise StoreClosedError(f"the store at {self.where} is closed: open it again to write")
        if self._failed is not None:
            raise StoreWriteFailedError(
                f"an earlier write to {self.where} failed ({self._failed!r}); samples buffered "
                "since the last commit were not written: close the store and open it again to "
                "resume after the last commit"
            )
        if self._writer is None:
            raise StoreReadOnlyError(
                f"the store at {self.where} is open read-only: open it with mode='a' to write"
            )
        return self._writer

    def drop(self, sample_ids: Iterable[str]) -> None:
        """Drop committed samples of this writer's part from the store (damaged ones `verify`
        found, say): they are no longer in it, and a later extraction writes them again.

        Raises:
            SampleNotFoundError: A sample is not committed in this writer's part.
        """
        ids = list(sample_ids)
        with self._lock:
            writer = self._require_writer()
            rows = []
            for sid in ids:
                part, row = self._where.get(sid, ("", -1))
                if part != writer.index.name:
                    raise SampleNotFoundError(
                        f"not committed in this writer's part of {self.where} "
                        f"({writer.index.name}): open the store as the part's writer to drop it",
                        sample_id=sid,
                    )
                rows.append(row)
            with self._writing():
                writer.drop(rows)
            for sid in ids:
                self._where.pop(sid, None)

    def take_refused(self) -> list[Refused]:
        """The samples written unchecked (`HiddenStates.values_checked` False) whose values were
        refused since the last call: not committed, and not in the store. Each holds its
        `DumpValidationError`. They show once their shard is on disk, at the latest on `flush`."""
        with self._lock:
            if self._writer is None:
                return []
            refused, self._writer.refused = self._writer.refused, []
            return refused

    async def aflush(self) -> None:
        """Async `flush`."""
        import anyio

        await anyio.to_thread.run_sync(self.flush)

    def flush(self) -> None:
        """Commit every buffered sample (writes the partial shard)."""
        with self._lock:
            if self._writer is not None and not self._closed:
                writer = self._require_writer()
                with self._writing():
                    writer.flush()

    def close(self) -> None:
        """Commit buffered samples and release this writer's part. Idempotent."""
        with self._lock:
            if self._closed:
                return
            try:
                if self._writer is not None and self._failed is None:
                    with self._writing():
                        self._writer.close()
                elif self._writer is not None:
                    self._writer.abandon()
            finally:
                self._closed = True
                if self._part_lock is not None:
                    self._part_lock.release()
                    self._part_lock = None

    async def aclose(self) -> None:
        """Async `close`."""
        import anyio

        await anyio.to_thread.run_sync(self.close)

    def __enter__(self) -> HiddenStateStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> HiddenStateStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- reading ---------------------------------------------------------------------------------

    def __getitem__(self, sample_id: str) -> HiddenStates:
        return self.get(sample_id)

    def get(self, sample_id: str, *, verify: bool | None = None) -> HiddenStates:
        """Read one committed sample; ``verify`` recomputes its checksum (default: the store's).

        Raises:
            SampleNotFoundError: The sample is not committed.
            StoreCorruptedError: Its bytes cannot be decoded or do not match the checksum.
        """
        with self._lock:
            loc = self._where.get(sample_id)
            reader = self._readers[loc[0]] if loc else None
        if loc is None or reader is None:
            raise SampleNotFoundError(
                f"not committed in the store at {self.where} ({len(self._where)} samples)",
                sample_id=sample_id,
            )
        check = self._verify_reads if verify is None else verify
        return reader.read(loc[1], verify=check, where=self.where)

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._where

    def __len__(self) -> int:
        return len(self._where)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._where))

    def committed_ids(self) -> set[str]:
        """The IDs of every committed sample (from the in-RAM index)."""
        return set(self._where)

    def lengths(self) -> dict[str, int]:
        """Tokens per committed sample, for length-bucketed batching."""
        out = {}
        for sid, (part, row) in self._where.items():
            out[sid] = int(self._readers[part].index.rows[row, 1])
        return out

    def locate(self, sample_id: str) -> tuple[str, int, int]:
        """Where a committed sample lives: ``(part, token offset, length)``.

        Rows ``[offset, offset + length)`` of ``<part>/hidden``, ``<part>/input_ids`` and
        ``<part>/loss_mask`` hold it, readable with plain zarr.
        """
        part, row = self._where[sample_id]
        offset, length = self._readers[part].index.rows[row, :2]
        return part, int(offset), int(length)

    @property
    def provenance(self) -> Provenance | None:
        """The settings the store's samples were produced under (``None`` while empty)."""
        if self._writer is not None and self._writer.provenance is not None:
            return self._writer.provenance
        return next(
            (r.index.state.provenance for r in self._readers.values() if r.index.state.provenance),
            None,
        )

    def _states(self) -> list[PartState]:
        return [r.index.state for r in self._readers.values()]

    @property
    def bytes_raw(self) -> int:
        """Raw hidden-state bytes of the committed samples."""
        return sum(s.bytes_raw for s in self._states())

    @property
    def bytes_stored(self) -> int:
        """Compressed bytes of the hidden-state shards written so far."""
        return sum(s.bytes_stored for s in self._states())

    @property
    def bytes_raw_written(self) -> int:
        """Raw hidden-state bytes of the samples in the shards written so far (committed, or
        waiting for the next commit): with `bytes_stored`, the compression ratio."""
        pending = self._writer.raw_bytes_awaiting_commit() if self._writer is not None else 0
        return self.bytes_raw + pending

    @property
    def num_tokens(self) -> int:
        """Tokens of the committed samples."""
        return sum(s.num_tokens for s in self._states())

    def loss_mask_counts(self) -> tuple[int, int]:
        """``(trained, tokens)`` over the committed samples: the tokens whose loss mask is 1
        (every token of a sample stored without a mask, as it reads back), and all tokens.

        Reads the parts' mask arrays (a byte a token); `hsdump stats` shows the masked fraction.
        """
        by_part: dict[str, list[int]] = {}
        with self._lock:
            for part, row in self._where.values():
                by_part.setdefault(part, []).append(row)
            readers = {part: self._readers[part] for part in by_part}
        counts = [readers[p].loss_mask_counts(np.asarray(r)) for p, r in by_part.items()]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)

    def stats(self) -> list[LayerStats]:
        """Per-layer statistics over every committed sample (aux layers, then ``"final"``)."""
        out: list[LayerStats] = []
        for state in self._states():
            out = merge_layer_lists(out, state.stats)
        return out

    def token_mismatch(self, sample: Sample) -> str | None:
        """How a committed sample's recorded tokens differ from ``sample``'s, or None.

        None also when ``sample.id`` is not committed, or was written before token digests were
        recorded (nothing to compare). A resumed extraction reports a difference as a failure.
        """
        with self._lock:
            loc = self._where.get(sample.id)
            index = self._readers[loc[0]].index if loc else None
        if loc is None or index is None or not (stored := int(index.tokens[loc[1]])):
            return None
        found = sample_token_digest(sample.input_ids, sample.loss_mask)
        if found == stored:
            return None
        length, has_mask = int(index.rows[loc[1], 1]), bool(index.rows[loc[1], 2])
        dataset = "values out of the store's range" if found is None else f"{found:016x}"
        return (
            f"stored token digest {stored:016x} ({length} tokens, "
            f"{'with' if has_mask else 'no'} loss mask) != dataset token digest {dataset} "
            f"({len(sample.input_ids)} tokens, "
            f"{'no' if sample.loss_mask is None else 'with'} loss mask)"
        )

    def verify(self, sample_ids: list[str] | None = None, *, progress: Any = None) -> VerifyReport:
        """Re-read committed samples and compare their checksums; see `VerifyReport`.

        Every part's state and index are re-read from the store first and checked too.

        Raises:
            StoreCorruptedError: A metadata file is damaged; it is named.
        """
        for name, group in self._parts():
            self._load_index(group, name)
        targets = list(self._where) if sample_ids is None else sample_ids
        report = verify_parts(
            self._readers, self._where, targets, self.duplicates, progress=progress
        )
        left_out = [c for c in self.recovered if sample_ids is None or c.sample_id in sample_ids]
        if not left_out:
            return report
        return report.model_copy(
            update={
                "checked": report.checked + len(left_out),
                "corrupted": [*report.corrupted, *left_out],
            }
        )
