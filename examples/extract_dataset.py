"""Extract a JSONL dataset into a hidden-state store with hsdump's Python API.

Runs as is: it starts the built-in reference server (a small Llama on the CPU) and extracts the
dataset bundled with hsdump into example.zarr. Point ``HiddenStateClient`` at a real SGLang server
(and its dump directory) to extract from a real model instead.

    python examples/extract_dataset.py [STORE] [DATASET.jsonl] [--concurrency N]
"""

import argparse
import asyncio
import json
import sys
import tempfile
import time
from importlib import resources

from hsdump import (
    HiddenStateClient,
    ReferenceServer,
    RunOptions,
    Sample,
    open_store,
    run_extraction,
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Extract a JSONL dataset into a hidden-state store (resumed when it exists).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("store", nargs="?", default="example.zarr", help="the store to write")
    parser.add_argument(
        "dataset",
        nargs="?",
        default=str(resources.files("hsdump") / "data" / "sample.jsonl"),
        help="JSONL lines of {id, input_ids, loss_mask}",
    )
    parser.add_argument("--concurrency", type=int, default=2, help="requests at the server at once")
    return parser.parse_args(argv)


def read_samples(path):
    with open(path) as f:
        return [Sample(r["id"], r["input_ids"], r.get("loss_mask")) for r in map(json.loads, f)]


class Progress:
    """Prints a line at most once a second, and the last one."""

    def __init__(self):
        self.shown = 0.0

    def __call__(self, summary):
        last = summary.samples_done + len(summary.failures) >= summary.samples_total
        if last or time.monotonic() - self.shown >= 1.0:
            self.shown = time.monotonic()
            print(
                f"{summary.samples_done}/{summary.samples_total} samples "
                f"({summary.skipped} already stored), {summary.tokens_per_s:,.0f} tokens/s",
                file=sys.stderr,
            )


async def extract(samples, url, dump_dir, store_path, concurrency):
    async with HiddenStateClient(url, dump_dir=dump_dir, max_in_flight=concurrency) as client:
        with open_store(store_path, "a") as store:
            # Skips what an earlier run stored, retries transient failures, commits as it goes.
            options = RunOptions(concurrency=concurrency, progress=Progress())
            summary = await run_extraction(samples, client=client, store=store, options=options)
    # Closing the store committed its last, partly filled shard: now every sample is visible.
    with open_store(store_path, "r") as store:
        return summary, len(store), store.num_tokens


def main(argv=None):
    args = parse_args(argv)
    samples = read_samples(args.dataset)
    with tempfile.TemporaryDirectory() as dump_dir, ReferenceServer(dump_dir=dump_dir) as server:
        summary, count, tokens = asyncio.run(
            extract(samples, server.url, dump_dir, args.store, args.concurrency)
        )
    for failure in summary.failures:
        print(f"failed: {failure.sample_id}: {failure.message}", file=sys.stderr)
    print(f"{args.store}: {count} samples, {tokens} tokens")
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
