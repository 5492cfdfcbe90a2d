"""Stores on object storage: ``s3://bucket/prefix`` through zarr's ``FsspecStore`` and s3fs.

Credentials and the endpoint are found the way the AWS SDKs find them (botocore's chain:
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and the
shared config files, instance roles; ``AWS_ENDPOINT_URL`` for another S3 API server), or from
``storage_options`` (s3fs's ``key``, ``secret``, ``token``, ``profile``, ``endpoint_url``,
``client_kwargs``...). None of them is ever put in a message: stores are described by their
URL without user info or query, and dependency messages pass through `redact`.

This module imports nothing heavy at import time (the CLI imports it); s3fs and botocore are
imported when an ``s3://`` store is opened, and missing ones name the ``hsdump[s3]`` extra.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from hsdump._exceptions import ConfigError, StoreIOError, StoreNotFoundError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from zarr.storage import FsspecStore

__all__ = [
    "S3Location",
    "abort_uploads",
    "check_bucket",
    "dependency_error",
    "describe_url",
    "is_url",
    "local_side",
    "open_s3",
    "parse_s3_url",
    "redact",
    "s3_location",
    "store_may_exist",
]

logger = logging.getLogger(__name__)

# Bucket names as S3 accepts them for new buckets (3-63 characters, no uppercase or '_').
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_SECRET_OPTIONS = {"key", "secret", "token", "password"}
_SECRET_OPTIONS |= {"aws_access_key_id", "aws_secret_access_key", "aws_session_token"}
_SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
_DEPENDENCIES = ("botocore", "aiobotocore", "aiohttp", "s3fs", "fsspec")
# Values from storage_options seen by this process: never printed, whatever carries them.
_secrets: set[str] = set()
_filesystems: dict[tuple[Any, ...], Any] = {}


@dataclass(frozen=True)
class S3Location:
    """Where an ``s3://`` store lives: its bucket and its key prefix (``""`` for the bucket)."""

    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        """``s3://bucket/prefix``, safe to print."""
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def is_url(path: Any) -> bool:
    """Whether ``path`` is a URL string (``scheme://...``) rather than a local path."""
    return isinstance(path, str) and "://" in path


def describe_url(url: str) -> str:
    """``url`` without user info, query or fragment: what messages and logs may show."""
    scheme, _, rest = url.partition("://")
    rest = re.split(r"[?#]", rest, maxsplit=1)[0]
    host, slash, path = rest.partition("/")
    return f"{scheme}://{host.rpartition('@')[2]}{slash}{path}"


def parse_s3_url(url: str) -> S3Location:
    """The bucket and prefix of ``s3://bucket/prefix``.

    Raises:
        ConfigError: Another scheme, credentials or a query in the URL, or a bad bucket name.
    """
    safe = describe_url(url)
    parts = urlsplit(url)
    if parts.scheme.lower() != "s3":
        raise ConfigError(
            f"unsupported store URL {safe}: hsdump opens local paths and s3://bucket/prefix "
            "URLs (or a zarr Store object passed to open_store)"
        )
    if "@" in parts.netloc or parts.query or parts.fragment:
        raise ConfigError(
            f"the store URL {safe} holds user info or a query: give only s3://bucket/prefix, "
            "and credentials through AWS_* environment variables, AWS_PROFILE or storage_options"
        )
    bucket, prefix = parts.netloc, parts.path.strip("/")
    if not _BUCKET.fullmatch(bucket):
        raise ConfigError(
            f"{safe}: {bucket!r} is not an S3 bucket name (3-63 characters of a-z, 0-9, '.' "
            "and '-'): write s3://bucket/prefix"
        )
    if any(seg in ("", ".", "..") for seg in prefix.split("/")) and prefix:
        raise ConfigError(f"{safe}: the prefix {prefix!r} has an empty, '.' or '..' segment")
    return S3Location(bucket, prefix)


def local_side(path: str | os.PathLike[str]) -> Path:
    """A local path for files kept beside a store (the failures file): for a URL, the store's
    last name in the working directory."""
    if is_url(path):
        name = describe_url(str(path)).rstrip("/").rpartition("/")[2]
        return Path(name or "store")
    return Path(path)


def store_may_exist(path: str | os.PathLike[str]) -> bool:
    """False only when ``path`` is local and missing (a URL has to be opened to know)."""
    return is_url(path) or Path(path).exists()


def redact(text: str) -> str:
    """``text`` with every known credential value (storage_options, AWS_* variables) masked."""
    values = set(_secrets)
    values.update(v for name in _SECRET_ENV if (v := os.environ.get(name)))
    for value in sorted(values, key=len, reverse=True):
        if len(value) >= 4:
            text = text.replace(value, "***")
    return text


def _remember_secrets(options: Mapping[str, Any]) -> None:
    for name, value in options.items():
        if isinstance(value, dict):
            _remember_secrets(value)
        elif name.lower() in _SECRET_OPTIONS and isinstance(value, str) and value:
            _secrets.add(value)


def open_s3(url: str, storage_options: Mapping[str, Any] | None, *, read_only: bool) -> FsspecStore:
    """zarr's ``FsspecStore`` for an ``s3://`` URL, its bucket checked (see `check_bucket`).

    Listings are never cached (other writers add parts).
    """
    location = parse_s3_url(url)
    try:
        from zarr.storage import FsspecStore
    except ImportError as exc:  # pragma: no cover - zarr needs fsspec for FsspecStore
        raise ConfigError(
            f"{location.url}: s3:// stores need fsspec: pip install 'hsdump[s3]'"
        ) from exc
    options = {"use_listings_cache": False, **(storage_options or {})}
    _remember_secrets(options)
    path = f"{location.bucket}/{location.prefix}".rstrip("/")
    store = FsspecStore(_filesystem(options, location), read_only=read_only, path=path)
    check_bucket(store, location)
    return store


def _filesystem(options: dict[str, Any], location: S3Location) -> Any:
    """One s3fs filesystem per process, options and AWS environment.

    fsspec's own instance cache would keep a filesystem made under other AWS_* variables, and
    one per store would leave an HTTP session per store open.
    """
    try:
        import s3fs
    except ImportError as exc:
        raise ConfigError(
            f"{location.url}: s3:// stores need s3fs: pip install 'hsdump[s3]'"
        ) from exc
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    token = (os.getpid(), repr(sorted(options.items())), env)
    fs = _filesystems.get(token)
    if fs is None:
        try:
            fs = s3fs.S3FileSystem(asynchronous=True, skip_instance_cache=True, **options)
        except (TypeError, ValueError) as exc:  # s3fs refuses an unknown or ill-typed option
            raise ConfigError(
                f"storage_options for {location.url} were refused: {redact(str(exc))}"
            ) from exc
        _filesystems[token] = fs
    return fs


def s3_location(store: Any) -> S3Location | None:
    """The bucket and prefix of a zarr ``FsspecStore`` on s3fs (None for any other store)."""
    fs = getattr(store, "fs", None)
    if type(fs).__name__ != "S3FileSystem" or not isinstance(getattr(store, "path", None), str):
        return None
    bucket, _, prefix = store.path.strip("/").partition("/")
    return S3Location(bucket, prefix)


def call_s3(store: Any, method: str, **kwargs: Any) -> Any:
    """One S3 API call through the store's s3fs client, on zarr's event loop (blocking)."""
    from hsdump._store import zarr_adapter

    return zarr_adapter.run(store.fs._call_s3(method, **kwargs))


def check_bucket(store: Any, location: S3Location) -> None:
    """Fail early, clearly, when the bucket is missing, forbidden or the endpoint unreachable."""
    try:
        call_s3(store, "head_bucket", Bucket=location.bucket)
    except FileNotFoundError as exc:  # HEAD has no body: S3 says only "404 Not Found"
        raise StoreNotFoundError(
            f"the bucket of {location.url} does not exist at {endpoint(store)}: create it "
            f"(`aws s3 mb s3://{location.bucket}`), or check the URL and AWS_ENDPOINT_URL"
        ) from exc
    except TypeError as exc:  # the client was made with an option botocore does not take
        raise ConfigError(
            f"storage_options for {location.url} were refused: {redact(str(exc))}"
        ) from exc
    except Exception as exc:
        raise dependency_error(exc, location.url, store=store) or _unexpected(
            exc, location.url
        ) from exc


def _unexpected(exc: BaseException, where: str) -> StoreIOError:
    return StoreIOError(f"S3 request for {where} failed: {type(exc).__name__}: {redact(str(exc))}")


def endpoint(store: Any) -> str:
    """The S3 endpoint a store talks to, for messages."""
    fs = getattr(store, "fs", None)
    client = getattr(fs, "_s3", None)
    url = getattr(getattr(client, "meta", None), "endpoint_url", None)
    url = url or (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")
    url = url or getattr(fs, "endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL")
    return describe_url(url) if url else "AWS S3's default endpoint"


def dependency_error(exc: BaseException, where: str, *, store: Any = None) -> StoreIOError | None:
    """hsdump's error for an S3 or network failure from s3fs/botocore (None for other errors).

    Missing buckets and keys, refused credentials and unreachable endpoints each get their own
    message saying what to check.
    """
    name, module = type(exc).__name__, type(exc).__module__.partition(".")[0]
    from_s3 = module in _DEPENDENCIES or _cause_module(exc) in _DEPENDENCIES
    if not from_s3:
        return None
    text = redact(str(exc))
    at = endpoint(store)
    if isinstance(exc, PermissionError) or name in (
        "NoCredentialsError",
        "PartialCredentialsError",
    ):
        return StoreIOError(
            f"S3 refused access to {where} at {at} ({name}: {text}): check the credentials "
            "(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or storage_options key "
            "and secret) and the bucket's policy"
        )
    if "Connect" in name or "Timeout" in name or isinstance(exc, (ConnectionError, TimeoutError)):
        return StoreIOError(
            f"cannot reach the S3 endpoint {at} for {where} ({name}): check AWS_ENDPOINT_URL "
            "(or storage_options endpoint_url) and the network, then rerun; committed samples "
            "are safe"
        )
    return StoreIOError(f"S3 request for {where} at {at} failed: {name}: {text}")


def _cause_module(exc: BaseException) -> str:
    cause = exc.__cause__
    return type(cause).__module__.partition(".")[0] if cause is not None else ""


def error_code(exc: BaseException) -> str | None:
    """The S3 error code (``PreconditionFailed``...) behind an s3fs or botocore exception."""
    for err in (exc, exc.__cause__):
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            return str(code) if code is not None else None
    return None


def abort_uploads(store: Any, prefix: str) -> int:
    """Abort unfinished multipart uploads under ``prefix`` (left by a killed writer).

    They are invisible to readers but billed until aborted. Returns how many were aborted.
    """
    location = s3_location(store)
    if location is None:
        return 0
    key = f"{location.prefix}/{prefix}/" if location.prefix else f"{prefix}/"
    listed = call_s3(store, "list_multipart_uploads", Bucket=location.bucket, Prefix=key)
    uploads = listed.get("Uploads", [])
    for upload in uploads:
        call_s3(
            store,
            "abort_multipart_upload",
            Bucket=location.bucket,
            Key=upload["Key"],
            UploadId=upload["UploadId"],
        )
    if uploads:
        logger.info(
            "aborted %d unfinished uploads under s3://%s/%s", len(uploads), location.bucket, key
        )
    return len(uploads)
