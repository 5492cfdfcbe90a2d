"""Encode and decode whole shards of the hidden-state array, with every core.

The bytes are exactly zarr v3's ``sharding_indexed`` format as the array's metadata declares it
(inner chunks ``bytes`` + ``blosc``; index ``bytes`` + ``crc32c`` at the end), so any zarr reader
opens the store. hsdump encodes and decodes the inner chunks itself because zarr-python 3.1
encodes a shard's chunks one after another through numcodecs, which holds the GIL: on two cores
that caps writes at ~250 MB/s, against ~650 MB/s for the same codec run on a thread pool.
"""

from __future__ import annotations

import atexit
import os
import struct
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hsdump._cores import cores
from hsdump._store.backend import local_root

if TYPE_CHECKING:
    from hsdump._store.part import PartLayout

__all__ = ["PARTIAL_SUFFIX", "FlatChunks", "ShardIO", "write_file_atomic"]

_EMPTY = np.uint64(2**64 - 1)
_IOV_MAX = 1024  # Linux's limit on buffers per writev
# A file being written; zarr's LocalStore uses the same suffix, and reopening a part for writing
# removes leftovers of a killed writer (HiddenStateStore._cleanup_partials).
PARTIAL_SUFFIX = ".partial"
_SHUFFLE = {"shuffle": 1, "bitshuffle": 2, "noshuffle": 0}


@cache
def codec_pool() -> ThreadPoolExecutor:
    """The process-wide pool for codec and statistics work (one thread per core it may use),
    made on first use; :func:`shutdown_codec_pool` stops it, also at interpreter exit."""
    import numcodecs.blosc

    # Without this, Blosc on a thread other than the main one may take its global context and
    # lock: the pool's encodes then ran one at a time (1.0 core busy on 2 threads).
    numcodecs.blosc.use_threads = False
    _hook_process()
    return ThreadPoolExecutor(max_workers=max(2, cores()), thread_name_prefix="hsdump-codec")


@cache
def _hook_process() -> None:
    """Once, when the first pool is made: nothing is registered at import."""
    # A forked child (a DataLoader worker) inherits the pool object but not its threads.
    os.register_at_fork(after_in_child=codec_pool.cache_clear)
    atexit.register(shutdown_codec_pool)


def shutdown_codec_pool() -> None:
    """Stop the codec pool's threads once its work is done; the next use makes a new pool."""
    if codec_pool.cache_info().currsize:
        pool = codec_pool()
        codec_pool.cache_clear()
        pool.shutdown(wait=True)


def _crc32c(data: bytes | memoryview) -> int:
    import google_crc32c

    return int(google_crc32c.value(bytes(data)))


class ShardIO:
    """Reads and writes shards of one part's ``hidden`` array through its zarr store."""

    def __init__(self, array: Any, layout: PartLayout) -> None:
        self._array = array
        self._ct = layout.chunk_tokens
        self._per_shard = layout.shard_tokens // layout.chunk_tokens
        self._row = (layout.layers, layout.hidden_size)
        self._codec = _blosc_of(array)
        self._local_root = local_root(array.store)
        # Indexes of shards that are never rewritten (all rows committed), by shard number.
        self._index_cache: dict[int, np.ndarray] = {}
        self.stable_below = 0

    def _key(self, shard: int) -> str:
        return f"{self._array.path}/{self._array.metadata.encode_chunk_key((shard, 0, 0))}"

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
        index = np.full((self._per_shard, 2), _EMPTY, dtype="<u8")
        offset = 0
        for i, part in enumerate(parts):
            index[i] = (offset, len(part))
            offset += len(part)
        index_bytes = index.tobytes()
        return [*parts, index_bytes, struct.pack("<I", _crc32c(index_bytes))]

    def _encode_chunk(self, chunk: np.ndarray) -> bytes | memoryview:
        data = np.ascontiguousarray(chunk)
        return bytes(self._codec.encode(data)) if self._codec is not None else data.data.cast("B")

    def write(self, shard: int, rows: np.ndarray) -> int:
        """Write a shard (replacing it whole); returns its size in bytes."""
        pieces = self.encode(rows)
        if self._local_root is not None:
            write_file_atomic(self._local_root / self._key(shard), pieces)
            return sum(len(p) for p in pieces)
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        data = b"".join(pieces)
        buffer = default_buffer_prototype().buffer.from_bytes(data)
        sync(self._array.store.set(self._key(shard), buffer))
        return len(data)

    # -- reading ---------------------------------------------------------------------------------

    def read(self, start: int, stop: int, dtype: np.dtype[Any]) -> np.ndarray:
        """Rows ``[start, stop)`` decoded into one new array (chunks decoded in parallel)."""
        out = np.empty((stop - start, *self._row), dtype)
        shard_tokens = self._per_shard * self._ct
        jobs = []
        for shard in range(start // shard_tokens, -(-stop // shard_tokens)):
            base = shard * shard_tokens
            jobs += self._read_shard(
                shard,
                max(start, base) - base,
                min(stop, base + shard_tokens) - base,
                out,
                base - start,
            )
        list(codec_pool().map(lambda job: job(), jobs))
        return out

    def _read_shard(self, shard: int, lo: int, hi: int, out: np.ndarray, shift: int) -> list[Any]:
        from zarr.abc.store import RangeByteRequest, SuffixByteRequest
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        store, key, proto = self._array.store, self._key(shard), default_buffer_prototype()
        index = self._index_cache.get(shard)
        if index is None:
            raw_index = sync(store.get(key, proto, SuffixByteRequest(self._per_shard * 16 + 4)))
            if raw_index is None:
                raise FileNotFoundError(f"shard {key} is missing")
            index = raw_index.as_numpy_array()[:-4].view("<u8").reshape(-1, 2)
            if (shard + 1) * self._per_shard * self._ct <= self.stable_below and len(
                self._index_cache
            ) < 8192:
                self._index_cache[shard] = index
        first, last = lo // self._ct, (hi - 1) // self._ct
        begin = int(index[first, 0])
        end = int(index[last, 0] + index[last, 1])
        if (index[first : last + 1] == _EMPTY).any():
            raise FileNotFoundError(f"shard {key} lacks some of chunks {first}..{last}")
        blob = sync(store.get(key, proto, RangeByteRequest(begin, end)))
        if blob is None:
            raise FileNotFoundError(f"shard {key} lacks chunks {first}..{last}")
        view = blob.as_numpy_array()  # the bytes read, without another copy
        jobs = []
        for c in range(first, last + 1):
            off, size = int(index[c, 0]) - begin, int(index[c, 1])
            jobs.append(self._decode_job(view[off : off + size], c * self._ct, lo, hi, out, shift))
        return jobs

    def _decode_job(
        self, data: np.ndarray, c0: int, lo: int, hi: int, out: np.ndarray, shift: int
    ) -> Any:
        a, b = max(lo, c0), min(hi, c0 + self._ct)

        def job() -> None:
            target = out[a + shift : b + shift]
            if self._codec is not None and (a, b) == (c0, c0 + self._ct):
                self._codec.decode(data, out=target)  # whole chunk: decode in place
                return
            raw = self._codec.decode(data) if self._codec is not None else data
            chunk = np.frombuffer(raw, dtype=out.dtype).reshape(self._ct, *self._row)
            target[...] = chunk[a - c0 : b - c0]

        return job


def write_file_atomic(path: Path, pieces: list[bytes | memoryview]) -> None:
    """Write ``pieces`` to ``path`` as one file that appears whole or not at all.

    Like zarr's ``LocalStore`` (a temporary file, then a rename), but the pieces go to the kernel
    in one ``writev`` instead of being joined first, and no event loop is involved: a shard write
    costs one copy of its bytes and almost no time holding the GIL.
    """
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}{PARTIAL_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            _writev_all(fd, [memoryview(p) for p in pieces])
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _writev_all(fd: int, views: list[memoryview]) -> None:
    while views:
        written = os.writev(fd, views[:_IOV_MAX])
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def _blosc_of(array: Any) -> Any:
    """The numcodecs Blosc matching the array's inner-chunk codec (None when uncompressed)."""
    from numcodecs import Blosc

    sharding = array.metadata.codecs[0]
    inner = [c.to_dict() for c in sharding.codecs]
    names = [c["name"] for c in inner]
    if names == ["bytes"]:
        return None
    if names != ["bytes", "blosc"] or inner[0]["configuration"].get("endian") != "little":
        raise ValueError(f"unexpected inner codecs {inner}")
    cfg = inner[1]["configuration"]
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
        codecs = [c.to_dict() for c in array.metadata.codecs]
        names = [c["name"] for c in codecs]
        if names not in (["bytes"], ["bytes", "zstd"]):
            raise ValueError(f"unexpected codecs {names}")
        self._zstd = None
        if names[-1] == "zstd":
            cfg = codecs[-1].get("configuration", {})
            self._zstd = Zstd(level=cfg.get("level", 0), checksum=cfg.get("checksum", False))

    def _key(self, chunk: int) -> str:
        return f"{self._array.path}/{self._array.metadata.encode_chunk_key((chunk,))}"

    def _read_chunk(self, chunk: int) -> np.ndarray | None:
        data: Any
        if self._root is not None:
            try:
                data = (self._root / self._key(chunk)).read_bytes()
            except FileNotFoundError:
                return None
        else:
            from zarr.core.buffer import default_buffer_prototype
            from zarr.core.sync import sync

            raw = sync(self._array.store.get(self._key(chunk), default_buffer_prototype()))
            if raw is None:
                return None
            data = raw.as_numpy_array()
        return np.frombuffer(self._zstd.decode(data) if self._zstd else data, self._dtype)

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
