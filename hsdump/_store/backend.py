"""The edges of the store: opening zarr roots, locking parts, checking samples, OS errors."""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from hsdump._exceptions import (
    InputError,
    NotAStoreError,
    PartLockedError,
    StoreCorruptedError,
    StoreError,
    StoreExistsError,
    StoreIOError,
    StoreNotFoundError,
)
from hsdump._store.codecs import torch_dtype_name
from hsdump._store.objstore import (
    dependency_error,
    describe_url,
    is_url,
    open_s3,
    redact,
    s3_location,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    import zarr

    from hsdump._types import HiddenStates

__all__ = [
    "LAYOUT_KEY",
    "LOCK_DIR_SUFFIX",
    "PART_PREFIX",
    "ROOT_KEY",
    "PartLock",
    "check_tensors",
    "child_groups",
    "describe",
    "ids_int32",
    "local_dir",
    "local_root",
    "lock_part",
    "moments_of",
    "open_root",
    "os_error",
    "part_released",
]

Mode = Literal["r", "a", "w"]
ROOT_KEY = "hsdump_store"
LAYOUT_KEY = "hsdump_layout"
# The root's attributes[LAYOUT_KEY]: how to read a sample with zarr alone, without hsdump's docs.
LAYOUT = (
    "Written by hsdump: hidden states keyed by sample id. Each writer's samples are in a group "
    "part-<writer_id>. Only the first <part>.attrs['committed_samples'] entries of the part's "
    "index arrays are committed; later entries and rows are not and must be ignored. Entry k: "
    "index/sample_id[k] is the sample id, index/rows[k] holds the columns named in "
    "index/rows.attrs['columns'] (offset, length, has_mask, crc32). The sample is rows "
    "[offset, offset + length) of input_ids (int32 token ids), loss_mask (uint8; the sample has "
    "no mask when has_mask is 0) and hidden ([tokens, K+1, H]: the K aux layers, ids in "
    "<part>.attrs['hsdump_part']['provenance']['layer_ids'], then the final hidden state), whose "
    "values are the raw bits of hidden.attrs['logical_dtype'] (uint16 for bfloat16: view them "
    "as that dtype). crc32 is zlib.crc32 of the hidden rows' bytes, then the int32 ids, then the "
    "mask if has_mask. An id committed in several parts is read from the first part by name."
)
# Writer locks live beside the store, in ``<store>.hsdump-locks/<part>.lock``: zarr's tree walk
# warns about every file inside the store that is not zarr's, directories included.
LOCK_DIR_SUFFIX = ".hsdump-locks"
#: A writer's part is the group ``part-<writer_id>`` of the store.
PART_PREFIX = "part-"
_LEGACY_LOCK_FILE = ".hsdump-writer.lock"  # inside the part, before the locks moved out


def describe(path: Any) -> str:
    """How messages name a store: its path, its URL without credentials, or its store type."""
    if is_url(path):
        return describe_url(path)
    if isinstance(path, (str, os.PathLike)):
        return str(path)
    location = s3_location(path)
    return location.url if location is not None else type(path).__name__


def _store_of(path: Any, mode: Mode, storage_options: Mapping[str, Any] | None) -> Any:
    from zarr.storage import LocalStore

    if is_url(path):
        return open_s3(path, storage_options, read_only=mode == "r")
    if storage_options:
        from hsdump._exceptions import ConfigError

        raise ConfigError(
            f"storage_options apply to s3:// URLs only, not to {describe(path)}: leave them out"
        )
    return LocalStore(os.fspath(path), read_only=mode == "r") if _is_local(path) else path


def open_root(
    path: Any, mode: Mode, storage_options: Mapping[str, Any] | None = None
) -> zarr.Group:
    """The store's root group, created for mode ``"a"``/``"w"`` when missing.

    Raises:
        StoreNotFoundError: No store (mode ``"r"``).
        StoreExistsError: A store exists (mode ``"w"``).
        NotAStoreError: A zarr group that is not an hsdump store.
        StoreIOError: The disk or S3 failed.
        StoreCorruptedError: The root's ``zarr.json`` does not decode.
    """
    import zarr

    store = _store_of(path, mode, storage_options)
    where = describe(path)
    try:
        root = zarr.open_group(store=store, mode="r")
    except (FileNotFoundError, zarr.errors.GroupNotFoundError) as exc:
        if mode == "r":
            raise StoreNotFoundError(
                f"no store at {where}: check the path, or write samples first"
            ) from exc
        created = _create_root(store, where)
        if created is not None:
            return created
        root = zarr.open_group(store=store, mode="r")  # another writer created it meanwhile
    except OSError as exc:
        raise os_error(exc, where) from exc
    except Exception as exc:  # zarr raises anything from TypeError to JSONDecodeError
        if (failed := dependency_error(exc, where, store=store)) is not None:
            raise failed from exc
        raise StoreCorruptedError(
            f"{where}/zarr.json is damaged: cannot decode: {type(exc).__name__}: {exc}. Restore "
            'it from a backup, or write it anew: {"zarr_format": 3, "node_type": "group", '
            f'"attributes": {{"{ROOT_KEY}": {{"format": "hsdump-store", "version": 1}}}}}}'
        ) from exc
    if ROOT_KEY not in root.attrs:
        raise NotAStoreError(
            f"{where} is a zarr group but not an hsdump store: choose another path"
        )
    if mode == "w":
        raise StoreExistsError(
            f"a store already exists at {where}: open it with mode='a' to append or resume, "
            "or delete it to start over"
        )
    if mode == "r":
        return root
    root = zarr.open_group(store=store, mode="r+")
    if root.attrs.get(LAYOUT_KEY) != LAYOUT:  # a store from before it was described, or older text
        root.update_attributes({LAYOUT_KEY: LAYOUT})
    return root


def _create_root(store: Any, where: str) -> zarr.Group | None:
    """Create the store's root group; None if another writer created it since it was missing."""
    import zarr

    try:
        return zarr.open_group(
            store=store,
            mode="a",
            attributes={ROOT_KEY: {"format": "hsdump-store", "version": 1}, LAYOUT_KEY: LAYOUT},
        )
    except zarr.errors.ContainsGroupError:
        return None
    except OSError as exc:
        raise os_error(exc, where) from exc


def child_groups(root: zarr.Group) -> list[str]:
    """Names of the root's children that hold a ``zarr.json``, without decoding any of them."""
    from hsdump._store import zarr_adapter

    store, path = root.store, root.path
    prefix = f"{path}/" if path else ""
    names = zarr_adapter.list_dir(store, path)
    return [n for n in names if zarr_adapter.exists(store, f"{prefix}{n}/zarr.json")]


def _is_local(path: Any) -> bool:
    return isinstance(path, os.PathLike) or (isinstance(path, str) and "://" not in path)


def os_error(exc: OSError, where: str) -> StoreIOError:
    """hsdump's error for an OS (or S3) error on the store at ``where``."""
    if (failed := dependency_error(exc, where)) is not None:
        return failed
    if exc.errno == errno.ENOSPC:
        return StoreIOError(
            f"no space left on the device of {where}: free space and rerun; committed samples "
            "are safe and the rerun resumes after them"
        )
    return StoreIOError(f"I/O error on the store at {where}: {redact(str(exc))}")


def check_tensors(hs: HiddenStates) -> str:
    aux, final, ids = hs.aux_hidden_states, hs.final_hidden_state, hs.input_ids
    t = int(ids.shape[0]) if ids.dim() == 1 else -1
    k = len(hs.layer_ids)
    if ids.dim() != 1 or t == 0 or aux.dim() != 3 or final.dim() != 2:
        raise InputError(
            f"expected input_ids [T], aux [T, K, H] and final [T, H], found {tuple(ids.shape)}, "
            f"{tuple(aux.shape)} and {tuple(final.shape)}",
            sample_id=hs.sample_id,
        )
    h = int(final.shape[1])
    if tuple(aux.shape) != (t, k, h) or int(final.shape[0]) != t:
        raise InputError(
            f"shapes do not fit: input_ids has T={t}, layer_ids K={k}, final H={h}, so aux must "
            f"be {(t, k, h)} and final {(t, h)}; found {tuple(aux.shape)} and {tuple(final.shape)}",
            sample_id=hs.sample_id,
        )
    if hs.loss_mask is not None and tuple(hs.loss_mask.shape) != (t,):
        raise InputError(
            f"loss_mask must be [{t}], found {tuple(hs.loss_mask.shape)}", sample_id=hs.sample_id
        )
    dtype = torch_dtype_name(aux)
    if final.dtype != aux.dtype:
        raise InputError(
            f"aux is {aux.dtype} but final is {final.dtype}: they must match",
            sample_id=hs.sample_id,
        )
    return dtype


def moments_of(hs: HiddenStates, layers: int) -> np.ndarray | None:
    """``hs.row_moments`` as a float32 array ``[T, layers, 2]``, or None when not given."""
    given = hs.row_moments
    if given is None:
        return None
    shape = (hs.num_tokens, layers, 2)
    if tuple(given.shape) != shape:
        raise InputError(
            f"row_moments must be {shape} (a sum and a sum of squares per vector), found "
            f"{tuple(given.shape)}",
            sample_id=hs.sample_id,
        )
    return np.ascontiguousarray(given.detach().cpu().numpy(), dtype=np.float32)


def ids_int32(hs: HiddenStates) -> np.ndarray:
    ids = hs.input_ids.detach().cpu().numpy()
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
        raise InputError(
            "input_ids must be in [0, 2**31): token ids are stored as int32", sample_id=hs.sample_id
        )
    return np.ascontiguousarray(ids, dtype=np.int32)


def local_dir(root: zarr.Group) -> Path | None:
    """The directory of a group in a local store (None for any other store)."""
    base = local_root(root.store)
    return None if base is None else base / root.path


def local_root(store: Any) -> Path | None:
    """The directory of a zarr ``LocalStore`` (None for any other store)."""
    from zarr.storage import LocalStore

    return Path(store.root) if isinstance(store, LocalStore) else None


def lock_dir(root: zarr.Group) -> Path | None:
    """The directory of a local store's writer locks (None for any other store).

    The path is resolved, so a store opened through a symlink shares its locks.
    """
    local = local_dir(root)
    if local is None:
        return None
    store = local.resolve()
    return store.parent / f"{store.name}{LOCK_DIR_SUFFIX}"


class PartLock(Protocol):
    """A writer's hold on one part: a local file lock, an S3 lease, or nothing."""

    def check(self) -> None:
        """Raise `PartLockLostError` if the part may no longer be committed to."""

    def release(self) -> None:
        """Let the part go (idempotent)."""


class _FileLock:
    """``flock`` on open descriptors (none: a store hsdump cannot lock, such as a zarr
    ``MemoryStore``, where distinct writer ids are up to the caller); the OS frees them if the
    process dies."""

    def __init__(self, fds: list[int]) -> None:
        self._fds = fds

    def check(self) -> None:
        return None

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def lock_part(
    root: zarr.Group, name: str, where: str, writer_id: str = "", *, ttl_s: float | None = None
) -> PartLock:
    """Hold the part exclusively while it is open: a file lock beside a local store, a lease
    object beside an S3 store (`hsdump._store.lease`), nothing for other stores.

    Raises:
        PartLockedError: Another live writer holds the part.
    """
    location = s3_location(root.store)
    if location is not None:
        from hsdump._store.lease import Lease

        if not location.prefix:
            raise StoreError(
                f"{where} is a whole bucket: a writer keeps its lease beside the store, so give "
                f"the store a prefix (s3://{location.bucket}/<name>.zarr)"
            )
        key = f"{location.bucket}/{location.prefix}{LOCK_DIR_SUFFIX}/{name}.lease"
        return Lease.acquire(root.store, name, writer_id or name, where, key=key, ttl_s=ttl_s)
    return _FileLock(_lock_local(root, name, where))


def _lock_local(root: zarr.Group, name: str, where: str) -> list[int]:
    """The descriptors holding a local part's locks (none for a store that is not local)."""
    local, locks = local_dir(root), lock_dir(root)
    if local is None or locks is None:
        return []
    locks.mkdir(exist_ok=True)
    fd = _flock(locks / f"{name}.lock", name, where, create=True)
    assert fd is not None  # created if missing
    fds = [fd]
    legacy = local / name / _LEGACY_LOCK_FILE
    try:
        # A part written before the locks moved out: an older hsdump may hold the old lock.
        old = _flock(legacy, name, where, create=False) if legacy.exists() else None
    except BaseException:
        os.close(fds[0])
        raise
    if old is not None:
        legacy.unlink(missing_ok=True)  # kept locked until release, so zarr's walk stays clean
        fds.append(old)
    return fds


def part_released(store: str, writer_id: str, timeout: float) -> bool:
    """Whether the lock of ``writer_id``'s part of the local store at ``store`` is free within
    ``timeout`` seconds (its writer's process is gone). True at once for object storage, whose
    parts are leased, and for a part that never opened."""
    if "://" in store:
        return True
    root = Path(store).resolve()
    lock = root.parent / f"{root.name}{LOCK_DIR_SUFFIX}" / f"{PART_PREFIX}{writer_id}.lock"
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return True
    freed = threading.Event()

    def take() -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # blocks until the dead writer's lock is released
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        freed.set()

    threading.Thread(target=take, name=f"hsdump-fence-{writer_id}", daemon=True).start()
    return freed.wait(timeout)


def _flock(path: Path, name: str, where: str, *, create: bool) -> int | None:
    """An open descriptor of ``path`` holding its exclusive lock (None: ``path`` vanished)."""
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
    except FileNotFoundError:
        if create:
            raise
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(fd)
        raise PartLockedError(
            f"another live process is writing part {name!r} of {where} (it holds {path}): give "
            "each concurrent writer its own writer_id (one part per writer)"
        ) from exc
    return fd
