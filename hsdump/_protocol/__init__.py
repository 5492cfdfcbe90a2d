"""Dump protocol v1: the on-disk contract between a producer (a server) and the client.

This package is the only implementation of the format; ``docs/protocol.md`` is its specification.
It imports nothing heavier than pydantic (numpy and torch only inside the functions that need
them), so the SGLang plugin, the reference server, the test fakes and the client all share it
without pulling in the client's dependencies. It also holds the one table of the float formats
(`DTYPES`): every part of hsdump that needs a dtype's size, bits or finite check asks it.

Layout of a dump root::

    <root>/
      _producers/<host>-<pid>-<rank>.json   producer manifests (who is dumping here)
      .tmp-req_<rid>-<pid>-<hex>/           a dump being written (never read by clients)
      req_<rid>/                            a published dump, renamed into place atomically
        meta.json  aux.bin  final.bin  done     on success
        moments.bin                             with them, if the producer announces row_moments
        error                                   on failure (JSON with a reason)

A dump is read and removed without following a symbolic link (``O_NOFOLLOW``, then every file
relative to the opened directory): whoever else can write into the root could otherwise point
``req_<rid>`` or one of its files anywhere, and make the client read or delete it.

Modules: ``_names`` (the root's directories, files and request ids), ``_dtypes`` (the float
formats), ``_moments`` (the row moments a producer may declare), ``_models`` (the JSON
documents), ``_writing`` (the producer's side), ``_reading`` (the consumer's side).
"""

from __future__ import annotations

from hsdump._protocol._dtypes import (
    DTYPES,
    DtypeSpec,
    dtype_itemsize,
    dtype_of_torch,
    dtype_spec,
)
from hsdump._protocol._memfs import small_page_tmpfs, small_page_warning
from hsdump._protocol._models import (
    Capabilities,
    DumpErrorInfo,
    DumpMeta,
    FinalNorm,
    ProducerInfo,
    ProducerManifest,
)
from hsdump._protocol._moments import (
    MOMENTS_FILE,
    SPOT_ROWS,
    moments_error,
    row_moments,
    spot_rows,
)
from hsdump._protocol._names import (
    AUX_FILE,
    DEFAULT_DUMP_DIR,
    DEFAULT_RID_PREFIX,
    DONE_MARKER,
    ENV_DUMP_DIR,
    ERROR_MARKER,
    FINAL_FILE,
    META_FILE,
    PRODUCERS_DIR,
    PROTOCOL_VERSION,
    REQ_PREFIX,
    TMP_PREFIX,
    DType,
    default_dump_dir,
    is_opted_in,
    request_dir,
    validate_rid,
)
from hsdump._protocol._reading import (
    check_file_size,
    open_dump_dir,
    open_dump_file,
    read_manifests,
    read_meta,
    remove_dump,
)
from hsdump._protocol._values import value_error
from hsdump._protocol._writing import (
    DumpWriter,
    write_dump,
    write_error,
    write_manifest,
)

__all__ = [
    "AUX_FILE",
    "DEFAULT_DUMP_DIR",
    "DEFAULT_RID_PREFIX",
    "DONE_MARKER",
    "DTYPES",
    "ENV_DUMP_DIR",
    "ERROR_MARKER",
    "FINAL_FILE",
    "META_FILE",
    "MOMENTS_FILE",
    "PRODUCERS_DIR",
    "PROTOCOL_VERSION",
    "REQ_PREFIX",
    "SPOT_ROWS",
    "TMP_PREFIX",
    "Capabilities",
    "DType",
    "DtypeSpec",
    "DumpErrorInfo",
    "DumpMeta",
    "DumpWriter",
    "FinalNorm",
    "ProducerInfo",
    "ProducerManifest",
    "check_file_size",
    "default_dump_dir",
    "dtype_itemsize",
    "dtype_of_torch",
    "dtype_spec",
    "is_opted_in",
    "moments_error",
    "open_dump_dir",
    "open_dump_file",
    "read_manifests",
    "read_meta",
    "remove_dump",
    "request_dir",
    "row_moments",
    "small_page_tmpfs",
    "small_page_warning",
    "spot_rows",
    "validate_rid",
    "value_error",
    "write_dump",
    "write_error",
    "write_manifest",
]
