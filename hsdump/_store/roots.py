"""Opening a store's root, on a local disk or S3, and where its parts and locks live."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from hsdump._exceptions import (
    NotAStoreError,
    StoreCorruptedError,
    StoreExistsError,
    StoreIOError,
    StoreNotFoundError,
)
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

__all__ = [
    "LAYOUT_KEY",
    "LOCK_DIR_SUFFIX",
    "PART_PREFIX",
    "ROOT_KEY",
    "Mode",
    "child_groups",
    "describe",
    "local_dir",
    "local_root",
    "lock_dir",
    "open_root",
    "os_error",
]


Mode = Literal["r", "a", "w"]


ROOT_KEY = "hsdump_store"


LAYOUT_KEY = "hsdump_layout"
# The root's attributes[LAYOUT_KEY]: how to read a sample with zarr alone, without hsdump's docs.


LAYOUT = (
    "Written by hsdump: hidden states keyed by sample id. Each writer's samples are in a group "
    "part-<writer_id>. Only the first <part>.attrs['committed_samples'] entries of the part's "
    "index arrays are committed; later entries and rows are not and must be ignored, and so are "
    "entries k listed in <part>.attrs['hsdump_part']['dropped'] (found damaged). Entry k: "
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

    from hsdump._store.durable import DurableLocalStore

    if is_url(path):
        return open_s3(path, storage_options, read_only=mode == "r")
    if storage_options:
        from hsdump._exceptions import ConfigError

        raise ConfigError(
            f"storage_options apply to s3:// URLs only, not to {describe(path)}: leave them out"
        )
    if _is_local(path):
        return DurableLocalStore(os.fspath(path), read_only=mode == "r")
    if isinstance(path, LocalStore) and not isinstance(path, DurableLocalStore):
        return DurableLocalStore(path.root, read_only=path.read_only)  # its writes on disk too
    return path


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
