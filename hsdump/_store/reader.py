"""Reading committed samples back from one part, and checking them against their checksums."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from hsdump._exceptions import StoreCorruptedError, StoreError
from hsdump._store.codecs import bits_dtype, bits_to_tensor
from hsdump._store.integrity import crc32, damaged
from hsdump._store.objstore import dependency_error
from hsdump._store.roots import os_error
from hsdump._store.shardio import DAMAGED
from hsdump._store.zarr_adapter import UnsupportedArrayError

if TYPE_CHECKING:
    import zarr

    from hsdump._store.part import PartIndex
    from hsdump._types import HiddenStates

__all__ = ["CorruptSample", "PartReader", "VerifyReport", "verify_parts"]

_SAMPLE_ARRAYS = ("hidden", "input_ids", "loss_mask")
_MASK_ROWS = 1024  # rows whose masks are summed from one read: a few MB at chat lengths


class CorruptSample(BaseModel):
    """A sample that failed verification."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sample_id: str
    part: str
    reason: str
    row: int = -1  # its row in the part's index


class VerifyReport(BaseModel):
    """The result of `HiddenStateStore.verify`.

    Attributes:
        checked: Samples re-read.
        ok: Samples whose bytes match their checksum.
        corrupted: Samples that could not be decoded or whose checksum differs.
        duplicates: Sample IDs committed by more than one part (readers use the first part).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    checked: int
    ok: int
    corrupted: list[CorruptSample]
    duplicates: list[str]

    @property
    def clean(self) -> bool:
        """True when every checked sample is intact and no ID is duplicated."""
        return not self.corrupted and not self.duplicates


class PartReader:
    """Reads samples of one part by row; opens the arrays on first use."""

    def __init__(self, root: zarr.Group, index: PartIndex, *, where: str) -> None:
        self._root = root
        self._where = where
        self._arrays: tuple[Any, Any, Any] | None = None
        self.index = index

    @property
    def index(self) -> PartIndex:
        """The committed rows this reader serves (replaced on commit or refresh)."""
        return self._index

    @index.setter
    def index(self, index: PartIndex) -> None:
        self._index = index
        rows = index.rows
        self._committed_end = int((rows[:, 0] + rows[:, 1]).max()) if len(rows) else 0
        if self._arrays is not None:
            self._arrays[0].stable_below = self._committed_end

    def _open(self) -> tuple[Any, Any, Any]:
        if self._arrays is None:
            from hsdump._store.integrity import open_array
            from hsdump._store.shardio import FlatChunks, ShardIO

            g: Any = self._root[self.index.name]
            hidden, ids, mask = (open_array(g, k, self._where) for k in _SAMPLE_ARRAYS)
            assert self.index.state.layout is not None
            try:
                shards = ShardIO(hidden, self.index.state.layout)
                self._arrays = (shards, FlatChunks(ids), FlatChunks(mask))
            except UnsupportedArrayError as exc:
                raise damaged(f"{self._where}/{self.index.name}", str(exc)) from exc
            shards.stable_below = self._committed_end
        return self._arrays

    def read_raw(
        self, row: int, holes: list[str] | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The stored bits ``[T, K+1, H]``, int32 ids and uint8 mask (or None) of a row.

        Rows of a shard or chunk that is not stored read as zeros, and its key is appended to
        ``holes`` (zarr leaves out chunks that hold only the fill value).

        Raises:
            ChunkDecodeError: A chunk does not decode.
            ShardIndexError: A shard's index fails its checksum.
        """
        offset, length, has_mask, _ = (int(v) for v in self.index.rows[row])
        shards, ids, mask = self._open()
        stop = offset + length
        assert self.index.state.layout is not None
        bits = shards.read(offset, stop, bits_dtype(self.index.state.layout.dtype), holes)
        return bits, ids.read(offset, stop), mask.read(offset, stop) if has_mask else None

    def loss_mask_counts(self, rows: np.ndarray) -> tuple[int, int]:
        """``(trained, tokens)`` of committed ``rows``: the tokens whose loss mask is 1 (every
        token of a row stored without a mask, as it reads back), and all their tokens."""
        picked = self.index.rows[rows]
        tokens = int(picked[:, 1].sum())
        masked = picked[picked[:, 2] != 0]
        trained = tokens - int(masked[:, 1].sum())
        masked = masked[np.argsort(masked[:, 0], kind="stable")]
        for first in range(0, len(masked), _MASK_ROWS):
            start, length = masked[first : first + _MASK_ROWS, :2].T
            low, high = int(start[0]), int((start + length).max())
            ones = np.concatenate([[0], np.cumsum(self._mask(low, high), dtype=np.int64)])
            trained += int((ones[start + length - low] - ones[start - low]).sum())
        return trained, tokens

    def _mask(self, start: int, stop: int) -> np.ndarray:
        try:
            return self._open()[2].read(start, stop)  # type: ignore[no-any-return]
        except DAMAGED as exc:
            reason = f"{type(exc).__name__}: {exc}"
            raise damaged(f"{self._where}/{self.index.name}/loss_mask", reason) from exc
        except OSError as exc:
            raise os_error(exc, self._where) from exc
        except Exception as exc:
            if (failed := dependency_error(exc, self._where)) is not None:
                raise failed from exc
            raise  # not about the stored bytes: a bug is raised as itself

    def checksum_error(self, row: int) -> str | None:
        """Why a row's stored bytes are bad, or None when they match the checksum."""
        holes: list[str] = []
        try:
            raw = self.read_raw(row, holes)
        except DAMAGED as exc:
            return f"cannot decode: {type(exc).__name__}: {exc}"
        except OSError as exc:  # the disk or S3 failed: nothing says the bytes are bad
            raise os_error(exc, self._where) from exc
        except Exception as exc:
            if (failed := dependency_error(exc, self._where)) is not None:
                raise failed from exc
            raise  # not about the stored bytes: a bug is raised as itself
        reason = _mismatch(raw, int(self.index.rows[row, 3]))
        if reason is not None and holes:
            return f"{reason}; not stored (read as zeros): {', '.join(holes)}"
        return reason

    def _read_checked(self, row: int, sid: str, where: str) -> tuple[Any, Any, Any]:
        """`read_raw` with hsdump's errors; rows read as zeros are checked."""
        holes: list[str] = []
        try:
            raw = self.read_raw(row, holes)
        except StoreCorruptedError as exc:  # damaged metadata: the message names the file
            raise StoreCorruptedError(str(exc), sample_id=sid) from exc
        except DAMAGED as exc:
            raise _corrupted(sid, self.index.name, where, f"{type(exc).__name__}: {exc}") from exc
        except OSError as exc:
            raise _for_sample(os_error(exc, where), sid) from exc
        except Exception as exc:
            if (failed := dependency_error(exc, where)) is not None:
                raise _for_sample(failed, sid) from exc
            raise  # not about the stored bytes: a bug is raised as itself
        if holes and (reason := _mismatch(raw, int(self.index.rows[row, 3]))) is not None:
            missing = ", ".join(holes)
            raise _corrupted(sid, self.index.name, where, f"{missing} missing ({reason})")
        return raw

    def read(self, row: int, *, verify: bool, where: str) -> HiddenStates:
        """Read a committed row as `HiddenStates`; tensors are views of the decoded bits."""
        import torch

        from hsdump._types import HiddenStates

        sid = self.index.sample_ids[row]
        if verify and (reason := self.checksum_error(row)) is not None:
            raise _corrupted(sid, self.index.name, where, reason)
        bits, ids, mask = self._read_checked(row, sid, where)
        state = self.index.state
        assert state.layout is not None and state.provenance is not None
        hidden = bits_to_tensor(bits, state.layout.dtype)
        k = state.layout.layers - 1
        return HiddenStates(
            sample_id=sid,
            input_ids=torch.from_numpy(ids.astype(np.int64)),
            aux_hidden_states=hidden[:, :k],
            final_hidden_state=hidden[:, k],
            layer_ids=list(state.provenance.layer_ids),
            loss_mask=None if mask is None else torch.from_numpy(mask),
            meta=None,
            attrs={
                "store": where,
                "part": self.index.name,
                "provenance": state.provenance.model_dump(mode="json"),
            },
        )


def _for_sample(error: StoreError, sid: str) -> StoreError:
    """``error`` again, of the same class, naming the sample."""
    return type(error)(str(error), sample_id=sid)


def _mismatch(raw: tuple[np.ndarray, np.ndarray, np.ndarray | None], expected: int) -> str | None:
    """How the checksum of a row's bits, ids and mask differs from ``expected``, or None."""
    bits, ids, mask = raw
    crc = crc32(ids.data, crc32(np.ascontiguousarray(bits).data))
    if mask is not None:
        crc = crc32(mask.data, crc)
    return None if crc == expected else f"checksum {crc:#010x} != committed {expected:#010x}"


def _corrupted(sid: str, part: str, where: str, reason: str) -> StoreCorruptedError:
    return StoreCorruptedError(
        f"stored bytes in {where} ({part}) are damaged: {reason}. Run `hsdump verify-store` to "
        "list every damaged sample, then regenerate them into a new store",
        sample_id=sid,
    )


def verify_parts(
    readers: dict[str, PartReader],
    where: dict[str, tuple[str, int]],
    sample_ids: list[str],
    duplicates: list[str],
    *,
    progress: Callable[[int], Any] | None = None,
) -> VerifyReport:
    """Recompute the checksums of ``sample_ids``; ``progress(n)`` is called after each sample."""
    bad: list[CorruptSample] = []
    for n, sid in enumerate(sample_ids, 1):
        part, row = where[sid]
        reason = readers[part].checksum_error(row)
        if reason is not None:
            bad.append(CorruptSample(sample_id=sid, part=part, reason=reason, row=row))
        if progress is not None:
            progress(n)
    return VerifyReport(
        checked=len(sample_ids), ok=len(sample_ids) - len(bad), corrupted=bad, duplicates=duplicates
    )
