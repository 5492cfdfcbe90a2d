"""GPU check: extract a dataset through a running SGLang server with the plugin, compare every
stored layer with a transformers forward on the same weights, and record the result as JSON.

Runs on the GPU machine (see tests/gpu/run.sh). While ``hsdump extract`` runs, a foreign client
sends ordinary generate requests (no opt-in rid) that must never be dumped.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch


def make_dataset(path: Path, vocab: int, seed: int) -> list[dict]:
    """Prompts around and across the chunk size, plus random ones."""
    rng = random.Random(seed)
    lengths = [1, 2, 7, 31, 64, 100, 255, 256, 257, 300, 513, 700, 1000, 1500, 2000, 3000]
    lengths += [rng.randrange(20, 800) for _ in range(16)]
    samples = [
        {"id": f"s{i:03d}", "input_ids": [rng.randrange(vocab) for _ in range(n)]}
        for i, n in enumerate(lengths)
    ]
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    return samples


class ForeignTraffic(threading.Thread):
    """Ordinary requests (decoding 8 tokens) from another client, for the whole extraction."""

    def __init__(self, url: str, vocab: int):
        super().__init__(daemon=True)
        self.url, self.vocab, self.stop, self.sent, self.errors = (
            url,
            vocab,
            threading.Event(),
            0,
            0,
        )

    def run(self) -> None:
        rng = random.Random(1)
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                body = {
                    "input_ids": [rng.randrange(self.vocab) for _ in range(rng.randrange(50, 400))],
                    "sampling_params": {"max_new_tokens": 8, "temperature": 0},
                }
                if self.sent % 2:
                    body["rid"] = f"foreign-{self.sent}"
                try:
                    client.post(f"{self.url}/generate", json=body).raise_for_status()
                    self.sent += 1
                except httpx.HTTPError:
                    self.errors += 1


def extract(args: argparse.Namespace, dataset: Path, store: Path) -> dict:
    cmd = [
        "hsdump", "extract", str(dataset), "--out", str(store), "--server-url", args.url,
        "--dump-dir", args.dump_dir, "--concurrency", str(args.concurrency),
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    seconds = time.perf_counter() - t0
    Path(args.out, f"extract_{args.name}.log").write_text(proc.stdout + proc.stderr)
    print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
    return {"cmd": " ".join(cmd), "rc": proc.returncode, "seconds": round(seconds, 2)}


def compare(args: argparse.Namespace, samples: list[dict], store_path: Path) -> dict:
    """Max abs diff per stored layer against transformers, over all samples."""
    from transformers import AutoModelForCausalLM

    import hsdump

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
    store = hsdump.open_store(store_path, mode="r")
    per_layer: dict[str, dict[str, float]] = {}
    layer_ids = None
    for sample in samples:
        hs = store[sample["id"]]
        assert hs.input_ids.tolist() == sample["input_ids"], f"{sample['id']}: token ids differ"
        layer_ids = list(hs.layer_ids)
        t, k = len(sample["input_ids"]), len(layer_ids)
        assert tuple(hs.aux_hidden_states.shape)[:2] == (t, k), hs.aux_hidden_states.shape
        with torch.no_grad():
            ref = model(torch.tensor([sample["input_ids"]]).cuda(), output_hidden_states=True)
        refs = [r[0].float().cpu() for r in ref.hidden_states]
        got = {
            f"aux[{j}]=hs[{lid}]": (hs.aux_hidden_states[:, j], refs[lid])
            for j, lid in enumerate(layer_ids)
        }
        got["final=hs[-1]"] = (hs.final_hidden_state, refs[-1])
        # A wrong layer must be far off: shows the comparison can fail.
        got["aux[0] vs hs[id+1] (must differ)"] = (
            hs.aux_hidden_states[:, 0],
            refs[layer_ids[0] + 1],
        )
        for name, (a, b) in got.items():
            entry = per_layer.setdefault(name, {"max_abs_diff": 0.0, "max_abs_ref": 0.0})
            entry["max_abs_diff"] = max(entry["max_abs_diff"], (a.float() - b).abs().max().item())
            entry["max_abs_ref"] = max(entry["max_abs_ref"], b.abs().max().item())
    return {"layer_ids": layer_ids, "per_layer": per_layer}


def verdict(result: dict, expected_layers: list[int] | None) -> list[str]:
    failures = []
    if result["extract"]["rc"] != 0:
        failures.append(f"hsdump extract exited {result['extract']['rc']}")
    for name, e in result.get("per_layer", {}).items():
        ok = e["max_abs_diff"] <= 0.05 * max(1.0, e["max_abs_ref"])
        if "must differ" in name:
            ok = not ok
        if not ok:
            failures.append(
                f"{name}: max abs diff {e['max_abs_diff']:.4g} (ref scale {e['max_abs_ref']:.3g})"
            )
    if expected_layers is not None and result.get("layer_ids") != expected_layers:
        failures.append(f"layer ids {result.get('layer_ids')} != expected {expected_layers}")
    if result["foreign_dumps"]:
        failures.append(f"foreign requests were dumped: {result['foreign_dumps'][:5]}")
    if result["foreign"]["sent"] == 0:
        failures.append("the foreign client sent nothing")
    return failures


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--name", required=True)
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--dump-dir", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--expect-layers", default="")
    args = p.parse_args()
    work = Path(f"/tmp/work_{args.name}")
    work.mkdir(parents=True, exist_ok=True)
    samples = make_dataset(work / "data.jsonl", vocab=1024, seed=7)
    with httpx.Client(timeout=120) as c:  # a warmup request of our own, not opted in
        c.post(
            f"{args.url}/generate",
            json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}},
        )
    foreign = ForeignTraffic(args.url, vocab=1024)
    foreign.start()
    result: dict = {
        "name": args.name,
        "samples": len(samples),
        "tokens": sum(len(s["input_ids"]) for s in samples),
    }
    result["extract"] = extract(args, work / "data.jsonl", work / "store")
    foreign.stop.set()
    foreign.join(60)
    result["foreign"] = {"sent": foreign.sent, "errors": foreign.errors}
    result["foreign_dumps"] = [
        d.name for d in Path(args.dump_dir).glob("req_*") if "hsdump-" not in d.name
    ]
    result["left_in_dump_dir"] = sorted(
        d.name for d in Path(args.dump_dir).iterdir() if d.name != "_producers"
    )
    if result["extract"]["rc"] == 0:
        result.update(compare(args, samples, work / "store"))
    expected = [int(x) for x in args.expect_layers.split(",")] if args.expect_layers else None
    result["failures"] = verdict(result, expected)
    Path(args.out, f"tiny_{args.name}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
