"""The writer of the power-loss tests, and the deterministic samples it writes.

Run as ``python power_loss_writer.py STORE [MARKER_DIR]``: writes samples ``s0`` to ``s39`` into the
store at STORE in order, skipping those already committed (so a rerun after a crash resumes), and
flushes every `FLUSH_EVERY` samples. With MARKER_DIR (a directory on a crashfs, see
`tests/crashfs.py`), each flush that returns is followed by the marker
``durable:<ids committed so far, comma-separated>``: a flush that returns is the store's promise
that what it committed is durable. Prints ``END <samples written>``.
"""

from __future__ import annotations

import sys

import torch
from crashfs import emit_marker

import hsdump
from hsdump import HiddenStates

N_SAMPLES = 40
FLUSH_EVERY = 4
HIDDEN = 64
LAYERS = [2, 5, 7]
WRITER_ID = "w0"
SHARD_TOKENS = 64  # a shard per one or two samples, so a run writes ~40 shards
CHUNK_TOKENS = 16
DURABLE = "durable:"


def sample_ids() -> list[str]:
    """Every id the writer writes, in order."""
    return [f"s{i}" for i in range(N_SAMPLES)]


def make_sample(sample_id: str) -> HiddenStates:
    """A seeded sample of 20 to 60 tokens: bf16 states, token ids and (for odd ids) a loss mask."""
    i = int(sample_id.removeprefix("s"))
    g = torch.Generator().manual_seed(1000 + i)
    t = int(torch.randint(20, 61, (1,), generator=g))
    aux = torch.randn(t, len(LAYERS), HIDDEN, generator=g).to(torch.bfloat16)
    final = torch.randn(t, HIDDEN, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 150_000, (t,), generator=g)
    mask = torch.randint(0, 2, (t,), generator=g, dtype=torch.uint8) if i % 2 else None
    return HiddenStates(sample_id, ids, aux, final, list(LAYERS), mask)


def open_writer_store(path: str) -> hsdump.HiddenStateStore:
    """The store as the writer opens it: small shards, a commit for every shard written."""
    return hsdump.open_store(
        path,
        "a",
        writer_id=WRITER_ID,
        shard_tokens=SHARD_TOKENS,
        chunk_tokens=CHUNK_TOKENS,
        options=hsdump.StoreOptions(commit_interval_s=0),
    )


def write_all(path: str, marker_dir: str | None = None) -> int:
    """Write every sample not committed yet; returns how many were written."""
    written = 0
    with open_writer_store(path) as store:
        for n, sid in enumerate(sample_ids(), 1):
            if sid not in store:
                store.write(make_sample(sid))
                written += 1
            if n % FLUSH_EVERY == 0:
                store.flush()
                _report_durable(store, sample_ids()[:n], marker_dir)
    return written


def _report_durable(
    store: hsdump.HiddenStateStore, flushed: list[str], marker_dir: str | None
) -> None:
    committed = store.committed_ids()
    missing = [sid for sid in flushed if sid not in committed]
    if missing:
        raise AssertionError(f"flush returned but {missing} are not committed")
    if marker_dir is not None:
        emit_marker(marker_dir, DURABLE + ",".join(sorted(committed, key=sample_ids().index)))


if __name__ == "__main__":
    count = write_all(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
    print(f"END {count}", flush=True)
