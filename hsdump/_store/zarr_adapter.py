"""The one module that relies on zarr-python beyond its documented API.

Every other module of the store uses zarr's public API only (``zarr.open_group``,
``Group.create_array``, ``Array.resize``, ``Array.compressors``, ``zarr.storage``,
``zarr.codecs``, ``zarr.abc.store``, ``zarr.errors``) or this module. It relies on:

- ``zarr.core.sync.sync``: runs a store coroutine on zarr's own event-loop thread. zarr's
  ``Store`` API is async only, and an async store (``FsspecStore`` on s3fs) is bound to the loop
  zarr runs it on, so hsdump cannot run the coroutines on a loop of its own.
- ``Array.metadata.encode_chunk_key``: the key of a chunk (or shard) under the array's chunk key
  encoding; zarr 3.1 has no public function for it.
- ``Array.metadata.codecs[0]`` being the ``ShardingCodec`` (``zarr.codecs``) of a sharded array:
  its ``index_codecs`` and ``index_location`` say where a shard's index is and how it is
  checksummed. hsdump checks them against the only layout it writes (index ``bytes`` + ``crc32c``
  at the end, zarr's default) and refuses any other.
- The CRC-32C function that zarr's ``Crc32cCodec`` uses: ``google_crc32c`` (zarr 3.1.4 and later)
  or ``crc32c`` (before), whichever zarr brought in.
- The binary layout of a shard, which is the zarr v3 ``sharding_indexed`` specification rather
  than zarr-python's code: the encoded chunks, then ``n`` pairs of little-endian uint64
  ``(offset, nbytes)`` (``2**64 - 1`` twice for a chunk left out), then the CRC-32C of those
  pairs as a little-endian uint32. A chunk whose values are all the fill value may be left out.

Why hsdump encodes shards itself is in `hsdump._store.shardio`. ``tests/test_zarr_compat.py``
checks all of this against the installed zarr (zarr reads what hsdump writes and hsdump reads what
zarr writes, bit for bit); ``docs/store.md`` says which zarr versions it has been run on.
"""

from __future__ import annotations

import struct
from collections.abc import Coroutine
from dataclasses import dataclass
from functools import cache
from typing import Any, TypeVar

import numpy as np

__all__ = [
    "EMPTY",
    "ShardFormat",
    "ShardIndexError",
    "UnsupportedArrayError",
    "chunk_key",
    "crc32c",
    "delete",
    "exists",
    "get",
    "list_dir",
    "run",
    "set_bytes",
    "shard_format",
]

T = TypeVar("T")

EMPTY = np.uint64(2**64 - 1)  # both fields of an index entry for a chunk left out
_CRC_BYTES = 4


class UnsupportedArrayError(ValueError):
    """An array's metadata asks for a layout or codec that hsdump does not read or write."""


class ShardIndexError(ValueError):
    """A shard's index fails its CRC-32C or has the wrong size (the shard file is damaged)."""


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a zarr store coroutine to completion on zarr's event-loop thread (blocking)."""
    from zarr.core.sync import sync

    return sync(coro)


def get(store: Any, key: str, *, start: int | None = None, end: int | None = None) -> Any:
    """The bytes of ``key`` as a uint8 array (``[start, end)``, or the last ``-start`` bytes when
    ``start`` is negative), or None when the key is missing."""
    from zarr.abc.store import RangeByteRequest, SuffixByteRequest

    request: Any = None
    if start is not None and start < 0:
        request = SuffixByteRequest(-start)
    elif start is not None:
        request = RangeByteRequest(start, start if end is None else end)
    buffer = run(store.get(key, _prototype(), request))
    return None if buffer is None else buffer.as_numpy_array()


def set_bytes(store: Any, key: str, data: bytes) -> None:
    """Write ``data`` as the whole value of ``key``."""
    run(store.set(key, _prototype().buffer.from_bytes(data)))


def exists(store: Any, key: str) -> bool:
    """Whether ``key`` holds a value."""
    return bool(run(store.exists(key)))


def delete(store: Any, key: str) -> None:
    """Remove ``key`` (nothing happens if it is missing)."""
    run(store.delete(key))


def list_dir(store: Any, prefix: str) -> list[str]:
    """The names directly below ``prefix`` (keys and "directories")."""

    async def names() -> list[str]:
        return [name async for name in store.list_dir(prefix)]

    return run(names())


def chunk_key(array: Any, coords: tuple[int, ...]) -> str:
    """The store key of the chunk (or, for a sharded array, the shard) at grid ``coords``."""
    key = array.metadata.encode_chunk_key(coords)
    return f"{array.path}/{key}" if array.path else str(key)


@cache
def _prototype() -> Any:
    from zarr.buffer import default_buffer_prototype

    return default_buffer_prototype()


@cache
def _crc32c_function() -> Any:
    try:
        import google_crc32c

        return lambda data: int(google_crc32c.value(data))
    except ImportError:
        from crc32c import crc32c as function

        return lambda data: int(function(data))


def crc32c(data: bytes | memoryview) -> int:
    """CRC-32C of ``data``, computed by the library zarr's ``Crc32cCodec`` uses."""
    return int(_crc32c_function()(bytes(data)))


@dataclass(frozen=True)
class ShardFormat:
    """How the shards of one sharded array lay out their index."""

    chunks_per_shard: int

    @property
    def index_nbytes(self) -> int:
        """Bytes at the end of a shard holding the index and its checksum."""
        return self.chunks_per_shard * 16 + _CRC_BYTES

    def encode_index(self, sizes: list[int]) -> list[bytes]:
        """The index and checksum of a shard holding chunks of ``sizes`` bytes, in order, from
        its first byte; the chunks after them are left out."""
        index = np.full((self.chunks_per_shard, 2), EMPTY, dtype="<u8")
        offsets = np.cumsum([0, *sizes[:-1]]) if sizes else np.zeros(0)
        index[: len(sizes), 0] = offsets
        index[: len(sizes), 1] = sizes
        raw = index.tobytes()
        return [raw, struct.pack("<I", crc32c(raw))]

    def decode_index(self, raw: np.ndarray) -> np.ndarray:
        """The ``[chunks, 2]`` ``(offset, nbytes)`` of a shard's last `index_nbytes` bytes.

        Raises:
            ShardIndexError: The bytes have the wrong size or fail their CRC-32C.
        """
        if raw.nbytes != self.index_nbytes:
            raise ShardIndexError(
                f"the shard index is {raw.nbytes} bytes, expected {self.index_nbytes}"
            )
        data = np.ascontiguousarray(raw, dtype=np.uint8)
        (want,) = struct.unpack("<I", data[-_CRC_BYTES:].tobytes())
        found = crc32c(data[:-_CRC_BYTES].data)
        if found != want:
            raise ShardIndexError(f"the shard index's CRC-32C {found:#010x} != stored {want:#010x}")
        return data[:-_CRC_BYTES].view("<u8").reshape(-1, 2)


def shard_format(array: Any) -> ShardFormat:
    """The shard layout of a sharded array whose inner chunks split only its first axis.

    Raises:
        UnsupportedArrayError: The array is not sharded that way, or its index is not ``bytes`` +
            ``crc32c`` at the end of each shard (the only layout hsdump reads and writes).
    """
    from zarr.codecs import ShardingCodec

    codecs = array.metadata.codecs
    if len(codecs) != 1 or not isinstance(codecs[0], ShardingCodec):
        raise UnsupportedArrayError(f"{array.path} is not a sharded array (codecs {codecs})")
    sharding = codecs[0]
    index: list[dict[str, Any]] = [c.to_dict() for c in sharding.index_codecs]
    names = [c["name"] for c in index]
    location = getattr(sharding.index_location, "value", sharding.index_location)
    little = index[0].get("configuration", {}).get("endian", "little") == "little"
    if names != ["bytes", "crc32c"] or not little or location != "end":
        raise UnsupportedArrayError(
            f"{array.path}: unsupported shard index (codecs {index}, at the {location}): hsdump "
            "reads shards whose index is 'bytes' (little-endian) + 'crc32c' at the end"
        )
    shard, inner = tuple(array.shards), tuple(sharding.chunk_shape)
    if shard[1:] != inner[1:] or shard[0] % inner[0]:
        raise UnsupportedArrayError(
            f"{array.path}: inner chunks {inner} do not split shards {shard} by rows"
        )
    return ShardFormat(chunks_per_shard=shard[0] // inner[0])
