"""Encode and decode whole shards of the hidden-state array, with every core.

The bytes are exactly zarr v3's ``sharding_indexed`` format as the array's metadata declares it
(inner chunks ``bytes`` + ``blosc``; index ``bytes`` + ``crc32c`` at the end), so any zarr reader
opens the store. hsdump encodes and decodes the inner chunks itself because zarr-python 3.1
encodes a shard's chunks one after another through numcodecs, which holds the GIL: on two cores
that caps writes at ~250 MB/s, against ~650 MB/s for the same codec run on a thread pool.
"""

from __future__ import annotations

import os
import struct
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from hsdump._part import PartLayout

__all__ = ["FlatChunks", "ShardIO"]

_EMPTY = np.uint64(2**64 - 1)
_SHUFFLE = {"shuffle": 1, "bitshuffle": 2, "noshuffle": 0}


@cache
def codec_pool() -> ThreadPoolExecutor:
    """The process-wide pool for codec and statistics work (one thread per core)."""
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 2, thread_name_prefix="hsdump-codec")


# A forked child (a DataLoader worker) inherits the pool object but not its threads.
os.register_at_fork(after_in_child=codec_pool.cache_clear)


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
        # Indexes of shards that are never rewritten (all rows committed), by shard number.
        self._index_cache: dict[int, np.ndarray] = {}
        self.stable_below = 0

    def _key(self, shard: int) -> str:
        return f"{self._array.path}/{self._array.metadata.encode_chunk_key((shard, 0, 0))}"

    # -- writing ---------------------------------------------------------------------------------

    def encode(self, rows: np.ndarray) -> bytes:
        """A shard holding ``rows`` (a multiple of the chunk size, at most one shard)."""
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
        return b"".join([*parts, index_bytes, struct.pack("<I", _crc32c(index_bytes))])

    def _encode_chunk(self, chunk: np.ndarray) -> bytes:
        data = np.ascontiguousarray(chunk)
        return bytes(self._codec.encode(data)) if self._codec is not None else data.tobytes()

    def write(self, shard: int, rows: np.ndarray) -> int:
        """Write a shard (replacing it whole); returns its size in bytes."""
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        data = self.encode(rows)
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
    """Reads ranges of an unsharded 1-D array (token ids, masks) straight from its chunks.

    Saves zarr's per-call overhead (about a millisecond), which matters next to a sample read.
    """

    def __init__(self, array: Any) -> None:
        from numcodecs import Zstd

        self._array = array
        self._chunk = int(array.chunks[0])
        self._dtype = array.dtype
        names = [c.to_dict()["name"] for c in array.metadata.codecs]
        if names not in (["bytes"], ["bytes", "zstd"]):
            raise ValueError(f"unexpected codecs {names}")
        self._zstd = Zstd() if names[-1] == "zstd" else None

    def read(self, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)``; missing chunks read as the fill value 0."""
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        out = np.zeros(stop - start, self._dtype)
        for c in range(start // self._chunk, -(-stop // self._chunk)):
            key = f"{self._array.path}/{self._array.metadata.encode_chunk_key((c,))}"
            raw = sync(self._array.store.get(key, default_buffer_prototype()))
            if raw is None:
                continue
            data = raw.as_numpy_array()
            chunk = np.frombuffer(self._zstd.decode(data) if self._zstd else data, self._dtype)
            base = c * self._chunk
            a, b = max(start, base), min(stop, base + self._chunk)
            out[a - start : b - start] = chunk[a - base : b - base]
        return out
