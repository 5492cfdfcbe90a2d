"""Checksums of a store's metadata, and the error that names a damaged metadata file.

A sample's bytes carry their own CRC-32 (``index/rows`` column 3). This module covers the rest:

- A part's committed state (its ``zarr.json`` attribute, with the counters, provenance and
  per-layer statistics) has a CRC-32 of its canonical JSON beside it, under `STATE_CRC_KEY`.
- The committed index (rows, sample ids, token digests) has three running CRC-32s in the state,
  each over its entries in order, so a commit extends them without reading the index back.
- Each sample records a digest of its token ids and loss mask, so a resumed run can tell that a
  dataset line changed since its id was stored.

Parts written before these checksums existed have none of them: "not covered", never "corrupt".
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict
from zlib_ng.zlib_ng import crc32

from hsdump._exceptions import StoreCorruptedError

__all__ = [
    "COMMITTED_SAMPLES_KEY",
    "COMMITTED_TOKENS_KEY",
    "STATE_CRC_KEY",
    "IndexChecksum",
    "committed_counts",
    "crc32",
    "damaged",
    "extend_index_checksum",
    "open_array",
    "sample_token_digest",
    "state_attributes",
    "state_crc",
    "stored_token_digest",
    "token_digest",
]


class IndexChecksum(BaseModel):
    """Running CRC-32s of a part's committed index entries, in order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rows: int
    sample_ids: int
    tokens: int


STATE_CRC_KEY = "hsdump_part_crc32"
# Copies of the state's counters for readers that know only zarr; written with the state.
COMMITTED_SAMPLES_KEY = "committed_samples"
COMMITTED_TOKENS_KEY = "committed_tokens"


def damaged(file: str, reason: str) -> StoreCorruptedError:
    """The error for a metadata file that cannot be decoded or fails its checksum."""
    return StoreCorruptedError(
        f"{file} is damaged: {reason}. The samples it describes cannot be trusted: restore the "
        "file from a backup, or regenerate that part's samples into a new store (`hsdump "
        "verify-store` checks the rest of the store)"
    )


def open_array(group: Any, key: str, where: str) -> Any:
    """``group[key]``; metadata that does not decode raises `StoreCorruptedError`.

    ``where`` names the store in the message, as in ``<where>/<part>/<key>/zarr.json``.
    """
    try:
        return group[key]
    except OSError:
        raise  # the store reports I/O errors as such
    except Exception as exc:  # zarr raises anything from KeyError to JSONDecodeError
        file = f"{where}/{group.path}/{key}/zarr.json"
        raise damaged(file, f"cannot decode: {type(exc).__name__}: {exc}") from exc


def state_crc(state: Any) -> int:
    """CRC-32 of a part state's canonical JSON (the same before and after a JSON round trip)."""
    text = json.dumps(state, sort_keys=True, separators=(",", ":"))
    return crc32(text.encode())


def state_attributes(state_key: str, state: dict[str, Any]) -> dict[str, Any]:
    """The attributes a commit writes, in one ``zarr.json``: the state, its checksum and
    `committed_counts`."""
    return {state_key: state, STATE_CRC_KEY: state_crc(state), **committed_counts(state)}


def committed_counts(state: dict[str, Any]) -> dict[str, int]:
    """The committed samples and tokens of a part state, as the attributes that name them."""
    return {
        COMMITTED_SAMPLES_KEY: state["n_committed"],
        COMMITTED_TOKENS_KEY: state["num_tokens"],
    }


def extend_index_checksum(
    base: IndexChecksum | None, rows: np.ndarray, sample_ids: Sequence[str], tokens: np.ndarray
) -> IndexChecksum:
    """``base`` extended by index entries appended after the ones it covers."""
    start = base or IndexChecksum(rows=0, sample_ids=0, tokens=0)
    # Each id is its JSON string and a comma: the concatenation is the same however the ids were
    # split into commits, and json.dumps encodes a whole list in C.
    ids = json.dumps(list(sample_ids), separators=(",", ":"))[1:-1] + "," if sample_ids else ""
    return IndexChecksum(
        rows=crc32(np.ascontiguousarray(rows, "<i8").data, start.rows),
        sample_ids=crc32(ids.encode(), start.sample_ids),
        tokens=crc32(np.ascontiguousarray(tokens, "<u8").data, start.tokens),
    )


def token_digest(ids_le_i8: bytes, n: int, mask: bytes | None) -> int:
    """The 64-bit digest of ``n`` token ids (little-endian int64) and an optional uint8 mask.

    Never 0: the index stores 0 for samples written before digests were recorded.
    """
    h = hashlib.blake2b(struct.pack("<QB", n, mask is not None), digest_size=8)
    h.update(ids_le_i8)
    if mask is not None:
        h.update(mask)
    return int.from_bytes(h.digest(), "little") or 1


def stored_token_digest(ids: np.ndarray, mask: np.ndarray | None) -> int:
    """`token_digest` of the int32 ids and uint8 mask a sample is stored with."""
    raw = None if mask is None else np.ascontiguousarray(mask, np.uint8).tobytes()
    return token_digest(np.ascontiguousarray(ids, "<i8").tobytes(), len(ids), raw)


def sample_token_digest(input_ids: Sequence[int], loss_mask: Sequence[int] | None) -> int | None:
    """`token_digest` of a dataset sample; None when the store could not hold its values."""
    try:
        ids = np.fromiter(input_ids, "<i8", len(input_ids))  # from a list: 1.5x np.asarray's speed
        mask = None if loss_mask is None else np.fromiter(loss_mask, np.uint8, len(loss_mask))
    except OverflowError:
        return None
    return token_digest(ids.tobytes(), len(ids), None if mask is None else mask.tobytes())
