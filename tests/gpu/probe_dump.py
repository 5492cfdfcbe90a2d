"""GPU check of the server side alone: opted-in /generate requests, dumps read with the protocol
module, every layer compared with transformers; plus the prefix-cache guard when radix is on.

Runs on the GPU machine against a server started by tests/gpu/run.sh; needs no hsdump client.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import torch

from hsdump._client.loading import read_dump
from hsdump._protocol import request_dir


def generate(url: str, ids: list[int], rid: str, extra_key: str | None) -> dict:
    body = {
        "rid": rid,
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
    }
    if extra_key:
        body["extra_key"] = extra_key
    r = httpx.post(f"{url}/generate", json=body, timeout=120)
    r.raise_for_status()
    return r.json()


def wait_dump(root: Path, rid: str, timeout: float = 60) -> Path:
    path = request_dir(root, rid)
    deadline = time.time() + timeout
    while not ((path / "done").exists() or (path / "error").exists()):
        if time.time() > deadline:
            raise TimeoutError(f"no dump for {rid} in {root}")
        time.sleep(0.01)
    return path


def bf16(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).view(torch.bfloat16).float()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--name", required=True)
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--dump-dir", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--radix", action="store_true", help="the server's radix cache is on")
    args = p.parse_args()
    root, rng = Path(args.dump_dir), random.Random(3)
    lengths = [1, 5, 255, 256, 257, 600, 1100, 40, 90, 130, 170, 210]
    prompts = [[rng.randrange(1024) for _ in range(n)] for n in lengths]
    rids = [f"hsdump-probe-{i}-{uuid.uuid4().hex[:6]}" for i in range(len(prompts))]
    with ThreadPoolExecutor(8) as pool:  # concurrent: several requests per prefill batch
        jobs = [(ids, rid, uuid.uuid4().hex) for ids, rid in zip(prompts, rids, strict=True)]
        responses = list(pool.map(lambda job: generate(args.url, *job), jobs))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
    result: dict = {"name": args.name, "per_layer": {}, "failures": []}
    for ids, rid, resp in zip(prompts, rids, responses, strict=True):
        dump = read_dump(wait_dump(root, rid))
        meta = dump.meta
        if meta.input_ids != ids or resp["meta_info"]["id"] != rid:
            result["failures"].append(f"{rid}: token ids or rid differ")
        with torch.no_grad():
            ref = model(torch.tensor([ids]).cuda(), output_hidden_states=True).hidden_states
        pairs = {f"hs[{lid}]": (dump.aux[:, k], ref[lid]) for k, lid in enumerate(meta.layer_ids)}
        pairs["final"] = (dump.final, ref[-1])
        for name, (got, want) in pairs.items():
            d = (bf16(got) - want[0].float().cpu()).abs().max().item()
            e = result["per_layer"].setdefault(name, {"max_abs_diff": 0.0, "max_abs_ref": 0.0})
            e["max_abs_diff"] = max(e["max_abs_diff"], d)
            e["max_abs_ref"] = max(e["max_abs_ref"], want.abs().max().item())
        result["layer_ids"] = meta.layer_ids
        result.setdefault("pieces", []).append(meta.extra.get("pieces"))
    for name, e in result["per_layer"].items():
        if e["max_abs_diff"] > 0.05 * max(1.0, e["max_abs_ref"]):
            result["failures"].append(f"{name}: max abs diff {e['max_abs_diff']:.4g}")
    if args.radix:  # same prompt twice without extra_key: the second hits the cache -> error marker
        ids = [rng.randrange(1024) for _ in range(300)]
        first, second = (
            f"hsdump-radix-1-{uuid.uuid4().hex[:6]}",
            f"hsdump-radix-2-{uuid.uuid4().hex[:6]}",
        )
        generate(args.url, ids, first, None)
        resp = generate(args.url, ids, second, None)
        marker = wait_dump(root, second)
        result["radix"] = {
            "cached_tokens": resp["meta_info"].get("cached_tokens"),
            "first_done": (request_dir(root, first) / "done").exists(),
            "second_error": (marker / "error").read_text()[:300]
            if (marker / "error").exists()
            else None,
        }
        if result["radix"]["cached_tokens"] and not result["radix"]["second_error"]:
            result["failures"].append(
                "a request with cached prefix tokens was not published as an error"
            )
    Path(args.out, f"probe_{args.name}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
