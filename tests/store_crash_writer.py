"""A writer process for crash tests, and the deterministic samples it writes.

Run as ``python store_crash_writer.py PATH N WRITER_ID STRIDE OFFSET`` (PATH a directory or an
``s3://`` URL, whose endpoint and credentials come from the AWS variables): it writes samples
``OFFSET, OFFSET + STRIDE, ...`` below N with ``if_exists="skip"``, prints ``wrote <i>`` after each,
closes the store and prints ``END <number actually written>``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import torch

from hsdump import HiddenStates, Sample, StoreOptions, open_store

HIDDEN = 32
LAYERS = [2, 5, 7]
SHARD_TOKENS = 128
CHUNK_TOKENS = 16


def sample_length(i: int) -> int:
    """Lengths from 1 to 300 tokens: some samples fit in a shard, some span three."""
    return 1 + (i * 97) % 300


def make_sample(i: int, *, hidden: int = HIDDEN, layers: list[int] | None = None) -> HiddenStates:
    """Sample ``s<i>``: seeded random bf16 states, ids and (for odd i) a loss mask."""
    layers = LAYERS if layers is None else layers
    t = sample_length(i)
    g = torch.Generator().manual_seed(i)
    aux = torch.randn(t, len(layers), hidden, generator=g).to(torch.bfloat16)
    final = torch.randn(t, hidden, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 150_000, (t,), generator=g)
    mask = torch.randint(0, 2, (t,), generator=g, dtype=torch.uint8) if i % 2 else None
    return HiddenStates(f"s{i}", ids, aux, final, list(layers), mask)


def open_test_store(path: str, mode: str = "a", writer_id: str | None = None, **kw):  # type: ignore[no-untyped-def]
    """The store geometry every crash test uses: small shards, so kills land in every state.

    ``path`` may be an ``s3://`` URL; ``kw`` goes to ``open_store`` (``storage_options``).
    """
    return open_store(
        path, mode, writer_id=writer_id, shard_tokens=SHARD_TOKENS, chunk_tokens=CHUNK_TOKENS, **kw
    )  # type: ignore[arg-type]


_STRANDED = """
import sys
from hsdump import StoreOptions
from store_crash_writer import make_sample, open_test_store
options = StoreOptions(commit_interval_s=3600)
store = open_test_store(sys.argv[1], writer_id=sys.argv[2], options=options)
for i in range(3):
    store.write(make_sample(i))
store.flush()  # s0..s2 committed
for i in range(3, 8):  # full shards written, not committed for an hour
    store.write(make_sample(i))
print("written", flush=True)
sys.stdin.read()  # killed here, with the part open
"""


def killed_past_its_commit(path: str, writer_id: str) -> None:
    """A writer process that commits s0..s2, writes shards of s3..s7 without committing them,
    and is killed (SIGKILL) with its part open: its lock (or S3 lease) and those shards stay."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _STRANDED, path, writer_id],
        cwd=Path(__file__).parent,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "written"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        pipe.close()  # type: ignore[union-attr]


def as_sample(i: int) -> Sample:
    """The dataset line of sample ``s<i>``: its token ids and loss mask."""
    hs = make_sample(i)
    mask = None if hs.loss_mask is None else hs.loss_mask.tolist()
    return Sample(hs.sample_id, hs.input_ids.tolist(), mask)


def shards_past_commit(path: str, part: str, keys: list[str]) -> list[str]:
    """Of ``keys`` (the names of ``part``'s hidden-state shard files, ``c.<i>.0.0``), those that
    hold no committed row."""
    with open_test_store(path, "r") as store:
        ends = [sum(store.locate(sid)[1:]) for sid in store if store.locate(sid)[0] == part]
    end = -(-max(ends, default=0) // CHUNK_TOKENS) * CHUNK_TOKENS
    first_free = -(-end // SHARD_TOKENS)
    return [k for k in keys if int(k.rpartition("c.")[2].split(".")[0]) >= first_free]


def main(path: str, n: int, writer_id: str, stride: int, offset: int) -> None:
    written = 0
    # Commit whenever a shard is on disk (not once a second), so kills land between many commits.
    options = StoreOptions(commit_interval_s=0)
    with open_test_store(path, writer_id=writer_id, options=options) as store:
        for i in range(offset, n, stride):
            written += store.write(make_sample(i), if_exists="skip")
            print(f"wrote {i}", flush=True)
    print(f"END {written}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
