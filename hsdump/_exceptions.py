"""Every error hsdump raises.

Callers catch `HsdumpError` (or one of its branches) and never an ``httpx``, ``pydantic``,
``zarr`` or ``OSError`` from inside hsdump: those are translated at the boundary with
``raise ... from exc``. Each message names the sample, the request id, what was expected, what was
found, and what to do.

The tree::

    HsdumpError
    ├── ConfigError (ValueError)            bad settings or arguments
    │   └── InvalidRequestId                      a request id that cannot name a dump
    ├── InputError (ValueError)             a bad sample or dataset line
    ├── ServerError                         talking to the inference server
    │   ├── ServerUnavailable (ConnectionError)   refused, reset, unreachable       [transient]
    │   ├── ServerTimeout (TimeoutError)          no HTTP answer in time            [transient]
    │   ├── ServerResponseError                   a non-2xx status or a malformed body
    │   │                                         (5xx are transient, 4xx are not)
    │   ├── ServerNotDumping                      no producer manifest in the dump root
    │   ├── ServerStartError (RuntimeError)       a server hsdump runs could not start
    │   └── ServerConfigError                     settings that would truncate captures
    ├── DumpError                           a request's dump
    │   ├── DumpTimeout (TimeoutError)            the dump never completed         [transient]
    │   ├── DumpFailed                            the producer published an error marker [transient]
    │   └── DumpValidationError (ValueError)      the dump is not this sample's hidden states
    │       ├── RidMismatch
    │       ├── TokenMismatch
    │       ├── ShapeMismatch
    │       ├── LayerMismatch
    │       ├── DtypeMismatch
    │       ├── NonFiniteValues
    │       └── DegenerateValues
    ├── StoreError                          the Zarr store
    │   ├── StoreNotFoundError                    no store (or no bucket) at the path, mode "r"
    │   ├── NotAStoreError                        a zarr group that is not an hsdump store
    │   ├── StoreExistsError                      a store exists where mode "w" would create one
    │   ├── StoreReadOnlyError                    a write to a store opened with mode "r"
    │   ├── StoreClosedError                      a write to a store after close()
    │   ├── StoreWriteFailedError                 a write after an earlier one failed
    │   ├── PartLockedError                       another live writer holds the part
    │   ├── PartLockLostError                     this writer lost its hold on the part (S3 lease)
    │   ├── StoreIOError                          the disk or S3 failed (no space, access, network)
    │   ├── SampleExistsError
    │   ├── SampleNotFoundError (KeyError)
    │   ├── ProvenanceMismatch
    │   └── StoreCorruptedError
    ├── ExportError                         a store a trainer cannot take (export, batches)
    └── WorkerError                         a worker process could not start or kept dying

``exc.transient`` says whether retrying the sample with a fresh request may succeed.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DegenerateValues",
    "DtypeMismatch",
    "DumpError",
    "DumpFailed",
    "DumpTimeout",
    "DumpValidationError",
    "ExportError",
    "HsdumpError",
    "InputError",
    "InvalidRequestId",
    "LayerMismatch",
    "NonFiniteValues",
    "NotAStoreError",
    "PartLockLostError",
    "PartLockedError",
    "ProvenanceMismatch",
    "RidMismatch",
    "SampleExistsError",
    "SampleNotFoundError",
    "ServerConfigError",
    "ServerError",
    "ServerNotDumping",
    "ServerResponseError",
    "ServerStartError",
    "ServerTimeout",
    "ServerUnavailable",
    "ShapeMismatch",
    "StoreClosedError",
    "StoreCorruptedError",
    "StoreError",
    "StoreExistsError",
    "StoreIOError",
    "StoreNotFoundError",
    "StoreReadOnlyError",
    "StoreWriteFailedError",
    "TokenMismatch",
    "WorkerError",
]


class HsdumpError(Exception):
    """Base class of every hsdump error.

    Attributes:
        message: What went wrong, without the ``[sample ..., request ...]`` prefix of ``str()``.
        sample_id: The sample being processed, when known.
        rid: The request id sent to the server, when known.
        transient: Whether a retry with a fresh request may succeed.
    """

    transient: bool = False

    def __init__(self, message: str, *, sample_id: str | None = None, rid: str | None = None):
        self.message = message
        self.sample_id = sample_id
        self.rid = rid
        context = ", ".join(
            f"{name} {value!r}"
            for name, value in (("sample", sample_id), ("request", rid))
            if value
        )
        super().__init__(f"[{context}] {message}" if context else message)


class ConfigError(HsdumpError, ValueError):
    """A setting or argument is invalid."""


class InvalidRequestId(ConfigError):
    """A request id is not safe as a dump's directory name."""


class InputError(HsdumpError, ValueError):
    """A sample or a dataset line is invalid."""


class ServerError(HsdumpError):
    """Talking to the inference server failed."""


class ServerUnavailable(ServerError, ConnectionError):
    """The server refused, reset or dropped the connection."""

    transient = True


class ServerTimeout(ServerError, TimeoutError):
    """The server did not answer the HTTP request in time."""

    transient = True


class ServerResponseError(ServerError):
    """The server answered with an error status or a body hsdump cannot use."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        sample_id: str | None = None,
        rid: str | None = None,
    ):
        self.status_code = status_code
        self.transient = status_code is not None and status_code >= 500
        super().__init__(message, sample_id=sample_id, rid=rid)


class ServerNotDumping(ServerError):
    """No producer has announced itself in the dump root: the server is not dumping there."""


class ServerStartError(ServerError, RuntimeError):
    """A server that hsdump runs itself (the reference or fake server) did not start serving."""


class ServerConfigError(ServerError):
    """The server runs with settings that would truncate or corrupt captures."""


class DumpError(HsdumpError):
    """A request's dump is missing, failed, or wrong."""


class DumpTimeout(DumpError, TimeoutError):
    """The request's dump did not complete in time."""

    transient = True


class DumpFailed(DumpError):
    """The producer published an ``error`` marker for the request."""

    transient = True


class DumpValidationError(DumpError, ValueError):
    """The dump does not hold this sample's hidden states."""


class RidMismatch(DumpValidationError):
    """The dump or response belongs to another request."""


class TokenMismatch(DumpValidationError):
    """The server processed other token ids than those sent."""


class ShapeMismatch(DumpValidationError):
    """A tensor has the wrong number of rows, layers or hidden size."""


class LayerMismatch(DumpValidationError):
    """The dump holds other layers than expected."""


class DtypeMismatch(DumpValidationError):
    """The dump's dtype differs from what was expected."""


class NonFiniteValues(DumpValidationError):
    """A tensor holds NaN or infinite values."""


class DegenerateValues(DumpValidationError):
    """A tensor holds an all-zero row or layer."""


class MomentsMismatch(DumpValidationError):
    """The row moments a producer declared (``moments.bin``) differ from the dump's values."""


class StoreError(HsdumpError):
    """The hidden-state store refused an operation or is damaged."""


class StoreNotFoundError(StoreError):
    """No store (or, on S3, no bucket) exists where one was to be read."""


class NotAStoreError(StoreError):
    """The path holds a zarr group that hsdump did not create."""


class StoreExistsError(StoreError):
    """A store already exists where mode ``"w"`` was to create one."""


class StoreReadOnlyError(StoreError):
    """The store was opened with mode ``"r"``: it takes no writes."""


class StoreClosedError(StoreError):
    """The store was closed: open it again to write."""


class StoreWriteFailedError(StoreError):
    """An earlier write failed, so the store takes no more: close it and open it again."""


class PartLockedError(StoreError):
    """Another live writer holds the part (its file lock, or its lease on S3)."""


class PartLockLostError(StoreError):
    """This writer lost its hold on its part (its S3 lease was taken over or could not be
    renewed), so it may not commit."""


class StoreIOError(StoreError):
    """The disk or the object store failed: no space left, access refused, endpoint unreachable."""


class SampleExistsError(StoreError):
    """The sample is already committed to the store."""


class SampleNotFoundError(StoreError, KeyError):
    """The sample is not committed to the store."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ProvenanceMismatch(StoreError):
    """The sample was produced under other settings than the store's."""


class StoreCorruptedError(StoreError):
    """Stored bytes do not match their checksum, or the store's structure is damaged."""


class ExportError(HsdumpError):
    """A store cannot be exported or batched for a trainer as asked: the trainer needs what the
    store does not hold (a convention that cannot be converted), or the output directory belongs
    to another export."""


class WorkerError(HsdumpError):
    """A worker process of a multi-process extraction could not start or kept dying."""
