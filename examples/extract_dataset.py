"""Extract a JSONL dataset into a hidden-state store with hsdump's Python API.

Runs as is: it starts the built-in reference server (a small Llama on the CPU) and extracts the
dataset bundled with hsdump. Point ``HiddenStateClient`` at a real SGLang server (and its dump
directory) to extract from a real model instead.

    python examples/extract_dataset.py [STORE] [DATASET.jsonl]
"""

import asyncio
import json
import sys
import tempfile
from importlib import resources

from hsdump import HiddenStateClient, ReferenceServer, Sample, open_store


def read_samples(path):
    with open(path) as f:
        return [Sample(r["id"], r["input_ids"], r.get("loss_mask")) for r in map(json.loads, f)]


async def extract(samples, url, dump_dir, store_path):
    async with HiddenStateClient(url, dump_dir=dump_dir) as client:
        with open_store(store_path, "a") as store:
            for sample in samples:
                if sample.id not in store:  # resume: skip what an earlier run stored
                    await store.write(await client.extract(sample))
    # Closing the store committed its last, partly filled shard: now every sample is visible.
    with open_store(store_path, "r") as store:
        return len(store), store.num_tokens


def main():
    store_path = sys.argv[1] if len(sys.argv) > 1 else "sample.zarr"
    dataset = sys.argv[2] if len(sys.argv) > 2 else resources.files("hsdump") / "data/sample.jsonl"
    samples = read_samples(dataset)
    with tempfile.TemporaryDirectory() as dump_dir, ReferenceServer(dump_dir=dump_dir) as server:
        count, tokens = asyncio.run(extract(samples, server.url, dump_dir, store_path))
    print(f"{store_path}: {count} samples, {tokens} tokens")


if __name__ == "__main__":
    main()
