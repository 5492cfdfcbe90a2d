"""The writer lock of a part on S3: a lease object taken and renewed with conditional writes.

Object storage has no ``flock``. A writer of ``part-<id>`` of ``s3://b/p/s.zarr`` holds the
object ``s3://b/p/s.zarr.hsdump-locks/part-<id>.lease`` (beside the store, like local locks):

- taken with ``PUT If-None-Match: *`` (created only if absent), holding a random owner token, the
  holder's host, machine and pid, and the lease's ``ttl_s``;
- renewed every ``ttl_s / 3`` with ``PUT If-Match: <its ETag>`` (fails if anyone replaced it);
- expired when its ``LastModified`` is more than ``ttl_s`` old, both times read from the S3
  server (``LastModified`` and the response's ``Date``), so the clocks of the writers never
  matter. An expired lease, or one whose holder is a dead process on this same machine, is taken
  over with ``PUT If-Match``, so two writers racing for it cannot both win;
- deleted with ``DELETE If-Match`` on close.

Before each commit the writer checks that its lease is still its own and renewed recently
(`Lease.check`); a lease replaced by another writer stops it. See docs/object-storage.md.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from hsdump._exceptions import (
    PartLockedError,
    PartLockLostError,
    StoreClosedError,
    StoreError,
    StoreIOError,
)
from hsdump._store import zarr_adapter
from hsdump._store.objstore import call_s3, dependency_error, error_code

__all__ = ["Lease", "LeaseHolder", "lease_holder"]

logger = logging.getLogger(__name__)

_CONFLICTS = ("PreconditionFailed", "ConditionalRequestConflict")
_LOST = (*_CONFLICTS, "NoSuchKey")  # a renewal that finds the lease replaced or deleted
_ATTEMPTS = 3  # the lease changed under us this often: give up with a message


class LeaseHolder(BaseModel):
    """What a lease object holds (JSON)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: str = "hsdump-lease"
    version: int = 1
    owner: str
    writer_id: str
    host: str
    machine: str
    pid: int
    pid_start: str | None
    ttl_s: float
    acquired_at: str
    renewals: int = 0


@cache
def _machine() -> str:
    """This machine and pid namespace ("" where /proc does not tell): pids compare within it."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{socket.gethostname()}/{boot}/{namespace}"


def _start_time(pid: int) -> str | None:
    """A live process's start time (clock ticks since boot); None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def _holder_dead(holder: LeaseHolder) -> bool:
    """The holder ran on this machine and its process no longer exists."""
    if not holder.machine or holder.machine != _machine() or holder.pid_start is None:
        return False
    return _start_time(holder.pid) != holder.pid_start


class _Found:
    """A lease object as read: its holder, ETag and age by the server's clock."""

    def __init__(self, holder: LeaseHolder | None, etag: str, age_s: float) -> None:
        self.holder, self.etag, self.age_s = holder, etag, age_s

    @property
    def expired(self) -> bool:
        return self.holder is None or self.age_s >= self.holder.ttl_s

    @property
    def free(self) -> bool:
        """Whether it may be taken: expired, or its holder is a dead process of this machine."""
        return self.expired or (self.holder is not None and _holder_dead(self.holder))


def _read_lease(store: Any, bucket: str, key: str) -> _Found | None:
    """The lease object at ``bucket``/``key`` as read now; None when there is none."""

    async def get() -> tuple[bytes, dict[str, Any]]:
        resp = await store.fs._call_s3("get_object", Bucket=bucket, Key=key)
        body = resp["Body"]
        try:
            return await body.read(), resp
        finally:
            body.close()

    try:
        data, resp = zarr_adapter.run(get())
    except FileNotFoundError:
        return None
    date = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    now = parsedate_to_datetime(date) if date else datetime.now(UTC)
    age = (now - resp["LastModified"]).total_seconds()
    try:
        holder: LeaseHolder | None = LeaseHolder.model_validate(json.loads(data))
    except (ValueError, ValidationError):
        holder = None  # not a lease hsdump wrote: judged expired, so it is replaced
    return _Found(holder, str(resp["ETag"]), age)


def lease_holder(store: Any, bucket: str, key: str) -> str | None:
    """``"pid P on HOST"`` of the live lease at ``bucket``/``key``; None when there is none, it
    expired, or its holder is a dead process of this machine."""
    try:
        found = _read_lease(store, bucket, key)
    except Exception as exc:  # as `Lease` says what S3 refused, with the lease's URL
        raise dependency_error(exc, f"s3://{bucket}/{key}", store=store) or StoreIOError(
            f"cannot read the lease s3://{bucket}/{key}: {type(exc).__name__}"
        ) from exc
    if found is None or found.holder is None or found.free:
        return None
    return f"pid {found.holder.pid} on {found.holder.host}"


class Lease:
    """A held lease on one part; create it with `acquire`."""

    def __init__(self, store: Any, key: str, url: str, holder: LeaseHolder, etag: str) -> None:
        self._store, self._key, self.url = store, key, url
        self._bucket, _, self._object = key.partition("/")
        self._holder, self._etag = holder, etag
        self._renewed = time.monotonic()
        self._lost: StoreError | None = None  # PartLockLostError, or StoreClosedError
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name="hsdump-lease", daemon=True)

    @classmethod
    def acquire(
        cls, store: Any, part: str, writer_id: str, where: str, *, key: str, ttl_s: float
    ) -> Lease:
        """Take the lease of ``part`` of the S3 store ``store``, kept at ``key`` (``bucket/...``),
        living ``ttl_s`` without renewal (`StoreOptions.lease_ttl_s`); or refuse.

        Raises:
            PartLockedError: A live writer holds it (the message names the lease, its holder and
                age, and what to do).
            StoreIOError: S3 failed.
        """
        url = f"s3://{key}"
        start = _start_time(os.getpid())
        holder = LeaseHolder(
            owner=secrets.token_hex(16), writer_id=writer_id, host=socket.gethostname(),
            machine=_machine(), pid=os.getpid(), pid_start=start, ttl_s=ttl_s,
            acquired_at=datetime.now(UTC).isoformat(timespec="seconds"),
        )  # fmt: skip
        lease = cls(store, key, url, holder, "")
        lease._take(part, where)
        lease._thread.start()
        return lease

    # -- S3 calls --------------------------------------------------------------------------------

    def _put(self, holder: LeaseHolder, **condition: str) -> str:
        body = holder.model_dump_json().encode()
        out = call_s3(
            self._store, "put_object", Bucket=self._bucket, Key=self._object, Body=body,
            ContentType="application/json", **condition,
        )  # fmt: skip
        return str(out["ETag"])

    def _read(self) -> _Found | None:
        return _read_lease(self._store, self._bucket, self._object)

    # -- taking ----------------------------------------------------------------------------------

    def _take(self, part: str, where: str) -> None:
        for _ in range(_ATTEMPTS):
            found = self._call(self._read, where)
            if found is None:
                if self._try(where, IfNoneMatch="*"):
                    return
                continue
            if not found.free:
                raise self._held(found, part, where)
            if self._try(where, IfMatch=found.etag):
                self._log_takeover(found)
                return
        raise PartLockedError(
            f"the lease {self.url} of part {part!r} of {where} changed {_ATTEMPTS} times while "
            "this writer tried to take it: another writer is starting on this part; give each "
            "concurrent writer its own writer_id"
        )

    def _try(self, where: str, **condition: str) -> bool:
        """Write our lease under ``condition``; False when another write won."""
        try:
            self._etag = self._put(self._holder, **condition)
        except Exception as exc:
            if isinstance(exc, FileExistsError) or error_code(exc) in _CONFLICTS:
                return False
            raise self._failed(exc, where) from exc
        self._renewed = time.monotonic()
        return True

    def _call(self, fn: Any, where: str) -> Any:
        try:
            return fn()
        except Exception as exc:
            raise self._failed(exc, where) from exc

    def _failed(self, exc: Exception, where: str) -> StoreIOError:
        return dependency_error(exc, where, store=self._store) or StoreIOError(
            f"cannot use the lease {self.url}: {type(exc).__name__}"
        )

    def _held(self, found: _Found, part: str, where: str) -> PartLockedError:
        h = found.holder
        assert h is not None
        left = max(0.0, h.ttl_s - found.age_s)
        if h.machine and h.machine == _machine():  # alive: a dead holder here is taken over
            then = "that process runs on this machine: stop it, and a rerun takes the part over"
        else:
            then = (
                f"if that writer is dead, a rerun on {h.host} takes the part over at once, and "
                f"one elsewhere once the lease has expired ({left:.0f} s); or delete {self.url} "
                f"(`aws s3 rm {self.url}`) when you are sure no process writes this part"
            )
        return PartLockedError(
            f"part {part!r} of {where} is being written by another writer: its lease {self.url} "
            f"is held by pid {h.pid} on {h.host} (since {h.acquired_at}), renewed "
            f"{found.age_s:.0f} s ago, and expires in {left:.0f} s unless renewed. Give each "
            f"concurrent writer its own writer_id (one part per writer); {then}"
        )

    def _log_takeover(self, found: _Found) -> None:
        h = found.holder
        who = f"pid {h.pid} on {h.host}" if h else "an unreadable holder"
        logger.warning(
            "took over the lease %s from %s (renewed %.0f s ago): its writer is gone; "
            "samples it had not committed are written again",
            self.url,
            who,
            found.age_s,
        )

    # -- holding ---------------------------------------------------------------------------------

    def check(self) -> None:
        """Before a commit: renew the lease, so the commit follows a proof that it is ours.

        One conditional PUT per commit (commits come at most once a second): a writer whose
        lease was taken over learns it here, before it rewrites the part's state.

        Raises:
            PartLockLostError: Another writer took the lease over, or it could not be renewed in
                time.
            StoreClosedError: The lease was released.
        """
        with self._mutex:
            if self._lost is not None:
                raise self._lost
            self._renew_locked()

    def _renew_locked(self) -> None:
        started = time.monotonic()
        holder = self._holder.model_copy(update={"renewals": self._holder.renewals + 1})
        try:
            self._etag = self._put(holder, IfMatch=self._etag)
        except Exception as exc:
            if isinstance(exc, FileNotFoundError) or error_code(exc) in _LOST:
                self._lost = PartLockLostError(
                    f"this writer lost its lease {self.url}: another writer took the part over "
                    "(or the lease was deleted), so this one stops; samples it had not "
                    "committed were not written"
                )
                raise self._lost from exc
            if time.monotonic() - self._renewed > self._holder.ttl_s * 0.75:
                raise PartLockLostError(
                    f"cannot renew the lease {self.url} ({type(exc).__name__}) and it is about "
                    "to expire: this writer stops before another one may take the part over"
                ) from exc
            raise
        self._holder, self._renewed = holder, started

    def _renew_loop(self) -> None:
        while not self._stop.wait(self._holder.ttl_s / 3):
            try:
                with self._mutex:
                    if self._lost is not None:
                        return
                    self._renew_locked()
            except Exception as exc:  # retried on the next tick; check() reports a lost lease
                logger.warning("renewing the lease %s failed: %s", self.url, type(exc).__name__)

    def release(self) -> None:
        """Stop renewing and delete the lease (only if it is still this writer's)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        with self._mutex:
            if self._lost is not None:
                return
            try:
                call_s3(
                    self._store, "delete_object", Bucket=self._bucket, Key=self._object,
                    IfMatch=self._etag,
                )  # fmt: skip
            except Exception as exc:  # it expires by itself
                logger.warning("could not delete the lease %s: %s", self.url, type(exc).__name__)
            self._lost = StoreClosedError(f"the lease {self.url} was released: the store is closed")
