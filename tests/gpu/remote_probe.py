"""A store part written in this process against one written by a store process (`RemoteStore`).

Each of P processes maps N Kimi-sized samples from files on a tmpfs (as ingest maps dumps), then
writes them into its own part of a fresh store there; prints aggregate GB/s and cores busy.
``attached`` writes in this process, from mappings made as a store process makes them.
    PYTHONPATH=/tmp/hs:/tmp/site python3 tests/gpu/remote_probe.py /mnt/hsdump-huge 24 1,2 [CORES]
CORES sizes each process's pools (default: the host's cores over the processes); on a 2-core
machine, 16 reproduces the H200's gap between in process and a store process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import numpy as np

T, H = 2048, 7168


def _states(root: Path, tag: str, n: int) -> list:
    import torch

    from hsdump import HiddenStates
    from hsdump._mapped import MappedFile

    rng = np.random.default_rng(len(tag))
    bits = ((rng.standard_normal((T, 4, H), dtype=np.float32) * 0.5).view(np.uint32) >> 16).astype(
        np.uint16
    )
    out = []
    for i in range(n):
        path = root / f"{tag}-{i}"
        path.write_bytes(bits.tobytes())
        with path.open("rb") as fh:
            mapped = MappedFile.of(fh.fileno(), bits.nbytes)
        mapped.madvise(22)
        path.unlink()
        t = torch.from_numpy(np.frombuffer(mapped, np.uint16).reshape(T, 4, H)).view(torch.bfloat16)
        out.append(HiddenStates(sample_id=f"{tag}-{i}", input_ids=torch.arange(T),
                                aux_hidden_states=t[:, :3], final_hidden_state=t[:, 3],
                                layer_ids=[1, 2, 3]))  # fmt: skip
    return out


def _attached(hs):
    import dataclasses

    from hsdump._mapped import attach, share

    aux, final = (
        attach(fd, where)
        for fd, _, where in map(share, (hs.aux_hidden_states, hs.final_hidden_state))
    )
    return dataclasses.replace(hs, aux_hidden_states=aux, final_hidden_state=final)


def _one(
    kind: str, root: Path, index: int, n: int, procs: int, cores: int, barrier, results
) -> None:
    os.environ["HSDUMP_CORES"] = str(cores or max(1, (os.cpu_count() or 1) // procs))
    from hsdump import open_store
    from hsdump._store.remote import RemoteStore

    states = _states(root, f"{kind}{procs}w{index}", n)
    if kind == "attached":  # in this process, on mappings made as a store process makes them
        states = [_attached(hs) for hs in states]
    path = root / f"{kind}-{procs}.zarr"
    if kind == "remote":
        store = RemoteStore(path, writer_id=f"w{index}").open()
        store.write(states.pop())  # the child's first write imports torch: not timed
    else:
        store = open_store(path, "a", writer_id=f"w{index}")
        store.write(states.pop())
    count = len(states)
    barrier.wait()
    t0, r0 = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
    c0 = getattr(store, "cpu_s", 0.0)
    while states:  # each sample's mapping goes once it is placed, as in a run
        store.write(states.pop(0))
    store.close()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime + getattr(store, "cpu_s", 0.0) - c0
    results.put((t0, time.monotonic(), count * T * 4 * H * 2, cpu))


def main() -> None:
    root, n = Path(sys.argv[1]) / "remote-probe", int(sys.argv[2])
    cores = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    kinds = ("local", "attached", "remote")
    for procs in [int(p) for p in (sys.argv[3] if len(sys.argv) > 3 else "1,2").split(",")]:
        for kind in kinds + kinds:
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            ctx = mp.get_context("spawn")
            barrier, results = ctx.Barrier(procs), ctx.Queue()
            ps = [ctx.Process(target=_one, args=(kind, root, i, n, procs, cores, barrier, results))
                  for i in range(procs)]  # fmt: skip
            for p in ps:
                p.start()
            got = [results.get(timeout=300) for _ in ps]
            for p in ps:
                p.join()
            wall = max(g[1] for g in got) - min(g[0] for g in got)
            gb = sum(g[2] for g in got) / 1e9
            cpu = sum(g[3] for g in got)
            print(f"{kind:6s} {procs} process(es): {gb / wall:.2f} GB/s, {cpu / wall:.1f} cores "
                  f"busy, {cpu / gb:.2f} core-s per GB", flush=True)  # fmt: skip
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
