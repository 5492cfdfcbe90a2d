"""Encode and decode whole shards of the hidden-state array, with every core.

The bytes are exactly zarr v3's ``sharding_indexed`` format as the array's metadata declares it
(inner chunks ``bytes`` + ``blosc``; index ``bytes`` + ``crc32c`` at the end), so any zarr reader
opens the store, and shards zarr wrote are read here. hsdump encodes and decodes the inner chunks
itself because zarr-python 3.1 encodes a shard's chunks one after another through numcodecs, which
holds the GIL: on two cores that caps writes at ~250 MB/s, against ~650 MB/s for the same codec
run on a thread pool. What this relies on in zarr is in `hsdump._store.zarr_adapter`.
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np

from hsdump._cores import cores
from hsdump._store import zarr_adapter
from hsdump._store.durable import write_file_atomic
from hsdump._store.roots import local_root
from hsdump._store.zarr_adapter import EMPTY, ShardIndexError, UnsupportedArrayError

if TYPE_CHECKING:
    from collections.abc import Callable

    from hsdump._store.part import PartLayout

__all__ = [
    "DAMAGED",
    "ChunkDecodeError",
    "FlatChunks",
    "ShardIO",
]

_SHUFFLE = {"shuffle": 1, "bitshuffle": 2, "noshuffle": 0}


class ChunkDecodeError(ValueError):
    """A stored chunk does not decode to the bytes its array declares (the file is damaged)."""


# What stored bytes that are damaged raise when read; anything else is not about the bytes.
DAMAGED = (ChunkDecodeError, ShardIndexError)


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def codec_pool(configured_cores: int | None = None) -> ThreadPoolExecutor:
    """The process-wide pool for codec and statistics work, made on first use with one thread
    per core (``configured_cores``, else `hsdump._cores.cores`); `shutdown_codec_pool` stops it,
    also at interpreter exit."""
    global _pool
    with _pool_lock:
        if _pool is None:
            import numcodecs.blosc

            # Without this, Blosc on a thread other than the main one may take its global context
            # and lock: the pool's encodes then ran one at a time (1.0 core busy on 2 threads).
            numcodecs.blosc.use_threads = False
            _hook_process()
            threads = max(2, cores(configured_cores))
            _pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hsdump-codec")
        return _pool


def _forget_pool() -> None:
    global _pool
    _pool = None


@cache
def _hook_process() -> None:
    """Once, when the first pool is made: nothing is registered at import."""
    # A forked child (a DataLoader worker) inherits the pool object but not its threads.
    os.register_at_fork(after_in_child=_forget_pool)
    atexit.register(shutdown_codec_pool)


def shutdown_codec_pool() -> None:
    """Stop the codec pool's threads once its work is done; the next use makes a new pool."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=True)


def _decode(codec: Any, data: Any, key: str, out: np.ndarray | None = None) -> Any:
    """``codec.decode``; the errors numcodecs raises for damaged input become ChunkDecodeError."""
    try:
        return codec.decode(data, out=out) if out is not None else codec.decode(data)
    except (RuntimeError, ValueError) as exc:  # numcodecs' answer to bytes that do not decode
        raise ChunkDecodeError(f"{key}: {exc}") from exc


def _as_rows(raw: Any, dtype: np.dtype[Any], shape: tuple[int, ...], key: str) -> np.ndarray:
    flat = np.frombuffer(raw, dtype=dtype)
    if flat.size != int(np.prod(shape)):
        raise ChunkDecodeError(f"{key}: a chunk of {flat.size} values, expected {shape}")
    return flat.reshape(shape)


class ShardIO:
    """Reads and writes shards of one part's ``hidden`` array through its zarr store."""

    def __init__(self, array: Any, layout: PartLayout) -> None:
        self._array = array
        self._ct = layout.chunk_tokens
        self._format = zarr_adapter.shard_format(array)
        self._per_shard = self._format.chunks_per_shard
        self._row = (layout.layers, layout.hidden_size)
        self._codec = _blosc_of(array)
        self._local_root = local_root(array.store)
        # Indexes of shards that are never rewritten (all rows committed), by shard number.
        self._index_cache: dict[int, np.ndarray] = {}
        self.stable_below = 0

    def _key(self, shard: int) -> str:
        return zarr_adapter.chunk_key(self._array, (shard, 0, 0))

    # -- writing ---------------------------------------------------------------------------------

    def encode(self, rows: np.ndarray) -> list[bytes | memoryview]:
        """The pieces of a shard holding ``rows`` (a multiple of the chunk size, at most one
        shard): its encoded chunks, then its index and the index's checksum."""
        n = -(-rows.shape[0] // self._ct)
        parts = list(
            codec_pool().map(
                self._encode_chunk, (rows[i * self._ct : (i + 1) * self._ct] for i in range(n))
            )
        )
        return [*parts, *self._format.encode_index([len(p) for p in parts])]

    def _encode_chunk(self, chunk: np.ndarray) -> bytes | memoryview:
        data = np.ascontiguousarray(chunk)
        return bytes(self._codec.encode(data)) if self._codec is not None else data.data.cast("B")

    def write(self, shard: int, rows: np.ndarray) -> int:
        """Write a shard (replacing it whole); returns its size in bytes."""
        pieces = self.encode(rows)
        if self._local_root is not None:
            write_file_atomic(self._local_root / self._key(shard), pieces)
            return sum(len(p) for p in pieces)
        data = b"".join(pieces)
        zarr_adapter.set_bytes(self._array.store, self._key(shard), data)
        return len(data)

    # -- reading ---------------------------------------------------------------------------------

    def read(
        self, start: int, stop: int, dtype: np.dtype[Any], holes: list[str] | None = None
    ) -> np.ndarray:
        """Rows ``[start, stop)`` decoded into one new array (chunks decoded in parallel).

        Rows of a missing shard, or of a chunk its shard leaves out, read as the fill value 0,
        as zarr reads them (zarr leaves out chunks that hold only the fill value); their keys are
        appended to ``holes``.

        Raises:
            ChunkDecodeError: A chunk does not decode.
            ShardIndexError: A shard's index fails its checksum.
        """
        out = np.empty((stop - start, *self._row), dtype)
        shard_tokens = self._per_shard * self._ct
        jobs = []
        for shard in range(start // shard_tokens, -(-stop // shard_tokens)):
            base = shard * shard_tokens
            lo, hi = max(start, base) - base, min(stop, base + shard_tokens) - base
            jobs += self._read_shard(shard, lo, hi, out[lo + base - start : hi + base - start])
        found = list(codec_pool().map(lambda job: job(), jobs))
        if holes is not None:
            holes.extend(key for key in found if key)
        return out

    def _index(self, shard: int, key: str) -> np.ndarray | None:
        """The shard's ``(offset, nbytes)`` per chunk; None when the shard is missing."""
        index = self._index_cache.get(shard)
        if index is None:
            raw = zarr_adapter.get(self._array.store, key, start=-self._format.index_nbytes)
            if raw is None:
                return None
            index = self._format.decode_index(raw)
            stable = (shard + 1) * self._per_shard * self._ct <= self.stable_below
            if stable and len(self._index_cache) < 8192:
                self._index_cache[shard] = index
        return index

    def _read_shard(
        self, shard: int, lo: int, hi: int, target: np.ndarray
    ) -> list[Callable[[], str]]:
        """Jobs that decode rows ``[lo, hi)`` of a shard into ``target``; each returns the key
        of what it read as the fill value, or ``""``."""
        key = self._key(shard)
        index = self._index(shard, key)
        first, last = lo // self._ct, (hi - 1) // self._ct
        entries = None if index is None else index[first : last + 1]
        present = [] if entries is None else [i for i, e in enumerate(entries) if e[0] != EMPTY]
        if entries is None or not present:
            return [functools.partial(_fill, target, key)]
        begin = int(entries[present[0], 0])
        end = max(int(entries[i, 0] + entries[i, 1]) for i in present)
        blob = zarr_adapter.get(self._array.store, key, start=begin, end=end)
        if blob is None:  # the shard went away since its index was read
            return [functools.partial(_fill, target, key)]
        jobs: list[Callable[[], str]] = []
        for i, (offset, size) in enumerate(entries):
            c0 = (first + i) * self._ct
            a, b = max(lo, c0), min(hi, c0 + self._ct)
            rows = target[a - lo : b - lo]
            if offset == EMPTY:
                jobs.append(functools.partial(_fill, rows, f"{key} chunk {first + i}"))
                continue
            data = blob[int(offset) - begin : int(offset + size) - begin]
            jobs.append(functools.partial(self._decode_into, data, rows, a - c0, key))
        return jobs

    def _decode_into(self, data: np.ndarray, target: np.ndarray, skip: int, key: str) -> str:
        """Decode one chunk and copy its rows ``[skip, skip + len(target))`` into ``target``."""
        if self._codec is not None and skip == 0 and target.shape[0] == self._ct:
            _decode(self._codec, data, key, out=target)  # whole chunk: decode in place
            return ""
        raw = _decode(self._codec, data, key) if self._codec is not None else data
        chunk = _as_rows(raw, target.dtype, (self._ct, *self._row), key)
        target[...] = chunk[skip : skip + target.shape[0]]
        return ""


def _fill(target: np.ndarray, key: str) -> str:
    target[...] = 0
    return key


def _codec_chain(array: Any) -> list[dict[str, Any]]:
    """The array's (inner-chunk) serializer, then its compressors, as JSON; ``bytes`` must be
    little-endian and no filter is allowed (hsdump writes neither otherwise)."""
    chain = [array.serializer.to_dict(), *(c.to_dict() for c in array.compressors)]
    endian = chain[0].get("configuration", {}).get("endian", "little")
    if array.filters or chain[0]["name"] != "bytes" or endian != "little":
        found = f"filters {array.filters}, {chain}"
        raise UnsupportedArrayError(f"{array.path}: unsupported codecs ({found})")
    return chain


def _blosc_of(array: Any) -> Any:
    """The numcodecs Blosc matching the array's inner-chunk codec (None when uncompressed)."""
    from numcodecs import Blosc

    chain = _codec_chain(array)
    names = [c["name"] for c in chain]
    if names == ["bytes"]:
        return None
    if names != ["bytes", "blosc"]:
        raise UnsupportedArrayError(f"{array.path}: unexpected inner codecs {chain}")
    cfg = chain[1]["configuration"]
    return Blosc(
        cname=cfg["cname"],
        clevel=cfg["clevel"],
        shuffle=_SHUFFLE[cfg["shuffle"]],
        blocksize=cfg.get("blocksize", 0),
    )


class FlatChunks:
    """Reads and writes ranges of an unsharded 1-D array (token ids, masks) straight from its
    chunk files.

    Saves zarr's per-call overhead (a millisecond or more of the GIL per call, most of it in
    zarr's event-loop thread), which matters next to a sample read or a shard write.
    """

    def __init__(self, array: Any) -> None:
        from numcodecs import Zstd

        self._array = array
        self._chunk = int(array.chunks[0])
        self._dtype = array.dtype
        self._root = local_root(array.store)
        codecs = _codec_chain(array)
        names = [c["name"] for c in codecs]
        if names not in (["bytes"], ["bytes", "zstd"]):
            raise UnsupportedArrayError(f"{array.path}: unexpected codecs {codecs}")
        self._zstd = None
        if names[-1] == "zstd":
            cfg = codecs[-1].get("configuration", {})
            self._zstd = Zstd(level=cfg.get("level", 0), checksum=cfg.get("checksum", False))

    def _key(self, chunk: int) -> str:
        return zarr_adapter.chunk_key(self._array, (chunk,))

    def _read_chunk(self, chunk: int) -> np.ndarray | None:
        data: Any
        key = self._key(chunk)
        if self._root is not None:
            try:
                data = (self._root / key).read_bytes()
            except FileNotFoundError:
                return None
        else:
            data = zarr_adapter.get(self._array.store, key)
            if data is None:
                return None
        raw = _decode(self._zstd, data, key) if self._zstd else data
        return _as_rows(raw, self._dtype, (self._chunk,), key)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)``; missing chunks read as the fill value 0."""
        out = np.zeros(stop - start, self._dtype)
        for c in range(start // self._chunk, -(-stop // self._chunk)):
            chunk = self._read_chunk(c)
            if chunk is None:
                continue
            base = c * self._chunk
            a, b = max(start, base), min(stop, base + self._chunk)
            out[a - start : b - start] = chunk[a - base : b - base]
        return out

    def write(self, start: int, values: np.ndarray) -> None:
        """Set elements ``[start, start + len(values))``, rewriting each chunk they touch whole."""
        stop = start + len(values)
        if self._root is None:
            self._array[start:stop] = values
            return
        for c in range(start // self._chunk, -(-stop // self._chunk)):
            base = c * self._chunk
            old = self._read_chunk(c)
            chunk = np.zeros(self._chunk, self._dtype) if old is None else old.copy()
            a, b = max(start, base), min(stop, base + self._chunk)
            chunk[a - base : b - base] = values[a - start : b - start]
            data = self._zstd.encode(chunk) if self._zstd else chunk.tobytes()
            write_file_atomic(self._root / self._key(c), [data])
