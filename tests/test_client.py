"""HiddenStateClient against the fake server: each sample gets its own states, or an error."""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import torch

import hsdump
from hsdump import HiddenStateClient, HiddenStates, Sample
from hsdump.testing import (
    Capabilities,
    FakeEngine,
    FakeServer,
    Fault,
    fake_states,
    publish,
    request_dir,
)

pytestmark = pytest.mark.anyio
LAYERS, HIDDEN = (2, 4, 6), 32


def sample(i: int, n: int = 12) -> Sample:
    rng = random.Random(i)
    return Sample(id=f"s{i}", input_ids=[rng.randrange(1000) for _ in range(n)])


def assert_belongs_to(states: HiddenStates, s: Sample) -> None:
    aux, final = fake_states(s.input_ids, LAYERS, HIDDEN)
    assert states.sample_id == s.id
    assert states.input_ids.tolist() == list(s.input_ids)
    assert torch.equal(states.aux_hidden_states.view(torch.uint16), torch.from_numpy(aux))
    assert torch.equal(states.final_hidden_state.view(torch.uint16), torch.from_numpy(final))
    assert states.aux_hidden_states.dtype == torch.bfloat16
    assert states.layer_ids == list(LAYERS)


def request_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(("req_", ".tmp-")))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[FakeServer]:
    with FakeServer(tmp_path, layer_ids=LAYERS, hidden_size=HIDDEN) as srv:
        yield srv


@pytest.fixture
async def client(server: FakeServer) -> AsyncIterator[HiddenStateClient]:
    async with HiddenStateClient(server.url, dump_dir=server.dump_dir, dump_timeout=2) as c:
        yield c


async def test_extract_returns_the_samples_own_states(client: HiddenStateClient) -> None:
    for i in range(3):
        s = sample(i, n=5 + i)
        assert_belongs_to(await client.extract(s), s)


async def test_extract_removes_the_dump_directory(
    client: HiddenStateClient, server: FakeServer
) -> None:
    await client.extract(sample(0))
    assert request_dirs(server.dump_dir) == []


async def test_each_request_has_a_fresh_rid_and_cache_key(
    client: HiddenStateClient, server: FakeServer
) -> None:
    await client.extract(sample(0))
    await client.extract(sample(0))
    first, second = server.received[-2:]
    assert first.rid != second.rid and first.extra_key != second.extra_key
    assert first.sampling_params["max_new_tokens"] == 0


async def test_loss_mask_travels_with_the_sample(client: HiddenStateClient) -> None:
    s = Sample(id="m", input_ids=[5, 6, 7], loss_mask=[0, 1, 1])
    states = await client.extract(s)
    assert states.loss_mask is not None and states.loss_mask.tolist() == [0, 1, 1]


async def test_warmup_and_health_checks_create_no_dumps(server: FakeServer) -> None:
    async with httpx.AsyncClient(base_url=server.url) as http:
        warmup = {"input_ids": [10, 11, 12], "sampling_params": {"max_new_tokens": 8}}
        await http.post("/generate", json=warmup)
        await http.post("/generate", json={"rid": "HEALTH_CHECK_1", "input_ids": [0]})
        await http.get("/health")
    assert request_dirs(server.dump_dir) == []
    async with HiddenStateClient(server.url, dump_dir=server.dump_dir) as client:
        s = sample(1)
        assert_belongs_to(await client.extract(s), s)


async def test_stale_dumps_of_a_dead_client_are_removed_on_open(server: FakeServer) -> None:
    root = server.dump_dir
    publish(root, "hsdump-0123456789ab-0123456789abcdef")  # complete, owner gone
    (root / "req_hsdump-0123456789ab-fedcba9876543210").mkdir()  # never completed
    async with HiddenStateClient(server.url, dump_dir=root) as client:
        assert request_dirs(root) == []
        s = sample(2)
        assert_belongs_to(await client.extract(s), s)


async def test_a_second_live_clients_dumps_are_never_removed(server: FakeServer) -> None:
    root = server.dump_dir
    async with HiddenStateClient(server.url, dump_dir=root) as first:
        theirs = first._lease.new_rid()
        publish(root, theirs)
        async with HiddenStateClient(server.url, dump_dir=root):
            assert (root / f"req_{theirs}").exists()


async def test_interleaved_clients_each_get_their_own_states(server: FakeServer) -> None:
    async def run(client: HiddenStateClient, offset: int) -> None:
        for i in range(offset, offset + 6):
            s = sample(i)
            assert_belongs_to(await client.extract(s), s)

    async with (
        HiddenStateClient(server.url, dump_dir=server.dump_dir) as a,
        HiddenStateClient(server.url, dump_dir=server.dump_dir) as b,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(run, a, 0)
        tg.start_soon(run, b, 100)


@pytest.mark.parametrize("order", ["dump_first", "response_first"])
async def test_response_and_dump_may_arrive_in_either_order(
    client: HiddenStateClient, server: FakeServer, order: str
) -> None:
    server.inject(Fault(order, delay=0.1))  # type: ignore[arg-type]
    s = sample(3)
    assert_belongs_to(await client.extract(s), s)


async def test_max_in_flight_matches_out_of_order_completions_by_rid(server: FakeServer) -> None:
    rng = random.Random(0)
    server.engine.fault_for = lambda rid, ids: Fault(
        rng.choice(["dump_first", "response_first"]), delay=rng.uniform(0, 0.05)
    )
    samples = [sample(i, n=3 + i % 7) for i in range(24)]
    results: dict[str, HiddenStates] = {}

    async def one(s: Sample) -> None:
        results[s.id] = await client.extract(s)

    async with HiddenStateClient(server.url, dump_dir=server.dump_dir, max_in_flight=8) as client:
        async with anyio.create_task_group() as tg:
            for s in samples:
                tg.start_soon(one, s)
    for s in samples:
        assert_belongs_to(results[s.id], s)


@pytest.mark.parametrize(
    ("kind", "error"),
    [
        ("wrong_token_count", hsdump.TokenMismatch),
        ("wrong_token_ids", hsdump.TokenMismatch),
        ("nan", hsdump.NonFiniteValues),
        ("zero_row", hsdump.DegenerateValues),
        ("error_marker", hsdump.DumpFailed),
        ("response_rid", hsdump.RidMismatch),
        ("cached_tokens", hsdump.DumpValidationError),
        ("http_500", hsdump.ServerResponseError),
        ("http_400", hsdump.ServerResponseError),
        ("drop_connection", hsdump.ServerUnavailable),
    ],
)
async def test_faults_raise_their_own_error_and_leave_nothing_behind(
    client: HiddenStateClient, server: FakeServer, kind: str, error: type[Exception]
) -> None:
    s = sample(4)
    server.inject(Fault(kind))  # type: ignore[arg-type]
    with pytest.raises(error) as info:
        await client.extract(s)
    assert isinstance(info.value, hsdump.HsdumpError)
    assert info.value.sample_id == s.id and "s4" in str(info.value)
    await anyio.sleep(0.05)
    assert request_dirs(server.dump_dir) == []
    assert_belongs_to(await client.extract(s), s)  # the next attempt is unaffected


async def test_transient_flags_guide_retries(client: HiddenStateClient, server: FakeServer) -> None:
    server.inject(Fault("http_500"), Fault("http_400"))
    with pytest.raises(hsdump.ServerResponseError) as e500:
        await client.extract(sample(5))
    with pytest.raises(hsdump.ServerResponseError) as e400:
        await client.extract(sample(5))
    assert e500.value.transient and not e400.value.transient


async def test_unexpected_layers_are_refused(server: FakeServer) -> None:
    async with HiddenStateClient(
        server.url, dump_dir=server.dump_dir, expected_layer_ids=[1, 2, 3]
    ) as client:
        with pytest.raises(hsdump.LayerMismatch, match=r"\[2, 4, 6\].*\[1, 2, 3\]"):
            await client.extract(sample(6))


async def test_layers_changing_mid_run_are_refused(
    client: HiddenStateClient, server: FakeServer
) -> None:
    await client.extract(sample(7))
    server.inject(Fault("wrong_layers"))
    with pytest.raises(hsdump.LayerMismatch):
        await client.extract(sample(8))


async def test_a_dump_that_never_completes_times_out_cleanly(server: FakeServer) -> None:
    async with HiddenStateClient(server.url, dump_dir=server.dump_dir, dump_timeout=0.2) as client:
        server.inject(Fault("no_dump"))
        with pytest.raises(hsdump.DumpTimeout, match=r"within 0\.2 s") as info:
            await client.extract(sample(9))
        assert info.value.transient
    assert request_dirs(server.dump_dir) == []


async def test_a_late_dump_after_a_timeout_is_removed(server: FakeServer) -> None:
    s = sample(10)
    async with HiddenStateClient(server.url, dump_dir=server.dump_dir, dump_timeout=0.1) as client:
        server.inject(Fault("no_dump"))
        with pytest.raises(hsdump.DumpTimeout):
            await client.extract(s)
        late = server.engine.dump(server.received[-1].rid, list(s.input_ids))
        assert late.exists()  # published after the client gave up on it
    assert request_dirs(server.dump_dir) == []


@contextlib.contextmanager
def stalled(server: FakeServer, then: Fault | None = None) -> Iterator[threading.Event]:
    """The server takes the next opted-in request in (the event is set), and goes on with it
    (applying ``then``) only when the block ends."""
    arrived, release = threading.Event(), threading.Event()

    def hold(rid: str, ids: list[int]) -> Fault | None:
        server.engine.fault_for = None  # only this request
        arrived.set()
        release.wait(30)
        return then

    server.engine.fault_for = hold
    try:
        yield arrived
    finally:
        release.set()


async def test_an_http_timeout_is_a_server_timeout_not_a_dump_timeout(server: FakeServer) -> None:
    async with HiddenStateClient(
        server.url, dump_dir=server.dump_dir, request_timeout=0.2
    ) as client:
        with (
            stalled(server, then=Fault("no_dump")),
            pytest.raises(hsdump.ServerTimeout, match=r"within 0\.2 s") as info,
        ):
            await client.extract(sample(18))
    assert info.value.transient and info.value.sample_id == "s18"


async def test_cancelling_extract_mid_flight_leaves_nothing_behind(server: FakeServer) -> None:
    cancelled = sample(11)
    async with HiddenStateClient(server.url, dump_dir=server.dump_dir) as client:
        with stalled(server, then=Fault("no_dump")) as arrived:
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.extract, cancelled)
                await anyio.to_thread.run_sync(arrived.wait, 10)  # at the server, unanswered
                tg.cancel_scope.cancel()
        late = server.engine.dump(server.received[-1].rid, list(cancelled.input_ids))
        assert late.exists()  # published after the cancellation
        s = sample(12)
        assert_belongs_to(await client.extract(s), s)  # also sweeps the late dump
    assert request_dirs(server.dump_dir) == []


def forge(root: Path, rid: str, ids: list[int]) -> Path:
    """A neighbour's dump of request ``rid`` for ``ids``, as valid as the server's would be."""
    engine = FakeEngine(
        root, layer_ids=LAYERS, hidden_size=HIDDEN, latency=0, server_info={}, fault_for=None
    )
    return engine.dump(rid, ids)


@pytest.mark.parametrize("target", ["outside_the_root", "another_request"])
async def test_a_dump_planted_as_a_link_is_refused_and_its_target_kept(
    client: HiddenStateClient,
    server: FakeServer,
    tmp_path_factory: pytest.TempPathFactory,
    target: str,
) -> None:
    """A neighbour wins the race to ``req_<rid>`` with a link to a dump elsewhere."""
    root, planted = server.dump_dir, []

    def plant(rid: str, ids: list[int]) -> Fault:
        if target == "outside_the_root":
            theirs = forge(tmp_path_factory.mktemp("outside"), rid, ids)
        else:
            theirs = forge(root, "hsdump-another", ids)
        (root / f"req_{rid}").symlink_to(theirs)
        planted.append(theirs)
        return Fault("no_dump")

    server.engine.fault_for = plant
    with pytest.raises(hsdump.DumpValidationError, match="is a symbolic link") as info:
        await client.extract(sample(18))
    assert info.value.sample_id == "s18"
    assert {p.name for p in planted[0].iterdir()} == {"meta.json", "aux.bin", "final.bin", "done"}
    assert request_dirs(root) == (["req_hsdump-another"] if target == "another_request" else [])


async def test_a_dump_holding_a_link_is_refused_and_the_linked_file_kept(
    client: HiddenStateClient, server: FakeServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    secret = tmp_path_factory.mktemp("outside") / "aux.bin"

    def plant(rid: str, ids: list[int]) -> Fault:
        path = forge(server.dump_dir, rid, ids)
        (path / "aux.bin").rename(secret)
        (path / "aux.bin").symlink_to(secret)
        return Fault("no_dump")

    server.engine.fault_for = plant
    with pytest.raises(hsdump.DumpValidationError, match=r"aux\.bin is a symbolic link"):
        await client.extract(sample(19))
    assert secret.exists()
    assert request_dirs(server.dump_dir) == []


async def test_server_down_at_open_is_server_unavailable(tmp_path: Path) -> None:
    with FakeServer(tmp_path) as srv:
        url = srv.url
    with FakeServer(tmp_path, port=0):  # a live manifest, but nothing listens at `url`
        with pytest.raises(hsdump.ServerUnavailable, match="Is it running"):
            async with HiddenStateClient(url, dump_dir=tmp_path):
                pass


async def test_server_going_down_mid_run_is_transient(server: FakeServer) -> None:
    async with HiddenStateClient(server.url, dump_dir=server.dump_dir) as client:
        await client.extract(sample(13))
        server.stop()
        with pytest.raises(hsdump.ServerUnavailable) as info:
            await client.extract(sample(14))
        assert info.value.transient


async def test_a_dump_root_announcing_other_layers_than_the_server_is_refused(
    tmp_path: Path,
) -> None:
    info = {"return_aux_hidden_state_layer_ids": [2, 4, 5]}
    with (
        FakeServer(tmp_path / "a", layer_ids=(1, 3, 6)),
        FakeServer(tmp_path / "b", layer_ids=(2, 4, 5), server_info=info) as b,
    ):
        with pytest.raises(hsdump.ServerConfigError) as error:
            async with HiddenStateClient(b.url, dump_dir=tmp_path / "a"):
                pass
        assert b.received == []
    message = str(error.value)
    assert all(part in message for part in (b.url, "[2, 4, 5]", str(tmp_path / "a"), "[1, 3, 6]"))


async def test_a_server_dumping_into_another_root_fails_its_probe_at_open(tmp_path: Path) -> None:
    with FakeServer(tmp_path / "a") as a, FakeServer(tmp_path / "b") as b:
        with pytest.raises(hsdump.ServerNotDumping) as error:
            async with HiddenStateClient(b.url, dump_dir=a.dump_dir, dump_timeout=0.3):
                pass
        (probe,) = b.received
        assert a.received == [] and request_dirs(a.dump_dir) == []
    message = str(error.value)
    assert all(part in message for part in (b.url, str(a.dump_dir), probe.rid, "hsdump-fake"))


async def test_no_manifest_means_the_server_is_not_dumping(tmp_path: Path) -> None:
    with FakeServer(tmp_path, announce=False) as srv:
        with pytest.raises(hsdump.ServerNotDumping, match="no server is dumping"):
            async with HiddenStateClient(srv.url, dump_dir=tmp_path):
                pass


@pytest.mark.parametrize(
    ("info", "flag"),
    [
        ({"disable_radix_cache": False}, "--disable-radix-cache"),
        ({"chunked_prefill_size": 8192}, "--chunked-prefill-size -1"),
    ],
)
async def test_settings_that_truncate_captures_are_refused(
    tmp_path: Path, info: dict, flag: str
) -> None:
    with FakeServer(tmp_path, server_info=info) as srv:
        with pytest.raises(hsdump.ServerConfigError, match=flag):
            async with HiddenStateClient(srv.url, dump_dir=tmp_path):
                pass


async def test_chunked_prefill_is_fine_when_the_producer_assembles_chunks(tmp_path: Path) -> None:
    caps = Capabilities(chunked_prefill_assembly=True, prefix_cache_guard=True)
    info = {"chunked_prefill_size": 8192, "disable_radix_cache": False}
    with FakeServer(tmp_path, server_info=info, capabilities=caps, layer_ids=LAYERS) as srv:
        async with HiddenStateClient(srv.url, dump_dir=tmp_path) as client:
            s = sample(15)
            assert_belongs_to(await client.extract(s), s)


@pytest.mark.parametrize(
    ("info", "ids", "reason"),
    [
        (
            {"max_req_input_len": 4},
            [1, 2, 3, 4, 5],
            "5 tokens, longer than the server's context of 4",
        ),
        ({"context_length": 4}, [1, 2, 3, 4, 5], "longer than the server's context of 4"),
        ({"internal_states": [{"max_req_input_len": 4}]}, [1] * 5, "context of 4"),
        ({"vocab_size": 50}, [1, 2, 50], "token id 50 at position 2 is outside"),
    ],
)
async def test_samples_the_server_would_refuse_are_input_errors_before_a_request(
    tmp_path: Path, info: dict[str, Any], ids: list[int], reason: str
) -> None:
    """The client applies the limits /server_info gives (as ``hsdump extract`` applies them to
    the dataset's lines, tests/test_inputs.py)."""
    with FakeServer(tmp_path, server_info=info) as srv:
        async with HiddenStateClient(srv.url, dump_dir=tmp_path, probe=False) as client:
            with pytest.raises(hsdump.InputError, match=reason) as raised:
                await client.extract(Sample(id="long", input_ids=ids))
        assert srv.received == [] and raised.value.sample_id == "long"


def open_resources(root: Path, port: int) -> tuple[list[str], int, int]:
    """Client ids held in ``root``, this process's inotify descriptors, and TCP connections to
    ``port`` (each established connection appears once from either end)."""
    leases = sorted(p.name for p in (root / "_clients").glob("*.lock"))
    links = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the descriptor listdir itself used is gone
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
    tcp = Path("/proc/net/tcp").read_text().splitlines()[1:]
    connected = [f for f in map(str.split, tcp) if f[3] == "01"]  # 01: ESTABLISHED
    ends = sum(int(addr.split(":")[1], 16) == port for f in connected for addr in f[1:3])
    return leases, links.count("anon_inode:inotify"), ends


async def test_a_bad_dump_budget_is_a_config_error_and_open_leaks_nothing(
    server: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = open_resources(server.dump_dir, server.port)
    monkeypatch.setenv("HSDUMP_DUMP_BUDGET_BYTES", "2GB")
    with pytest.raises(hsdump.ConfigError, match=r"HSDUMP_DUMP_BUDGET_BYTES.*'2GB'"):
        async with HiddenStateClient(server.url, dump_dir=server.dump_dir):
            pass
    assert open_resources(server.dump_dir, server.port) == before


async def test_an_unwritable_dump_root_is_a_config_error_naming_it(server: FakeServer) -> None:
    (server.dump_dir / "_clients").write_text("")  # where client ids go cannot be a directory
    with pytest.raises(hsdump.ConfigError, match=r"cannot take a client id in .*_clients"):
        async with HiddenStateClient(server.url, dump_dir=server.dump_dir):
            pass


async def test_a_closed_client_refuses_reuse(server: FakeServer) -> None:
    client = HiddenStateClient(server.url, dump_dir=server.dump_dir)
    async with client:
        pass
    with pytest.raises(hsdump.ConfigError, match="closed"):
        await client.extract(sample(17))
    with pytest.raises(hsdump.ConfigError):
        await client.open()


def dump_bytes(root: Path) -> int:
    """Bytes in request directories right now (they come and go while this runs)."""
    total = 0
    for name in os.listdir(root):
        if name.startswith(("req_", ".tmp-")):
            with contextlib.suppress(OSError):
                total += sum(os.stat(root / name / f).st_size for f in os.listdir(root / name))
    return total


@contextlib.contextmanager
def dump_root_peak(root: Path) -> Iterator[list[int]]:
    """The most bytes seen in ``root``'s request directories while the block runs, in ``[0]``."""
    peak, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], dump_bytes(root))

    sampler = threading.Thread(target=watch)
    sampler.start()
    try:
        yield peak
    finally:
        stop.set()
        sampler.join()


async def test_dump_budget_bounds_bytes_in_flight(server: FakeServer) -> None:
    server.engine.latency = 0.01
    row = (len(LAYERS) + 1) * HIDDEN * 2
    moments = (len(LAYERS) + 1) * 8
    one_sample = 4096 + 12 * (row + 16 + moments)  # tensors, moments, meta.json and markers
    budget = 3 * one_sample
    samples = [sample(i) for i in range(24)]
    with dump_root_peak(server.dump_dir) as peak:
        async with (
            HiddenStateClient(
                server.url, dump_dir=server.dump_dir, max_in_flight=8, dump_budget_bytes=budget
            ) as client,
            anyio.create_task_group() as tg,
        ):
            for s in samples:
                tg.start_soon(client.extract, s)
    assert one_sample < client.budget.peak <= budget  # more than one in flight, never over
    assert 0 < peak[0] <= budget
    assert client.budget.in_use == 0
    assert client.stats.requests == 24 and client.stats.tokens == 24 * 12


async def test_the_budget_counts_every_file_of_a_dump_of_long_prompts(server: FakeServer) -> None:
    # At 512 tokens the row moments (8 bytes a layer a token) outgrow meta.json's allowance.
    assert server.capabilities.row_moments
    with dump_root_peak(server.dump_dir) as peak:
        async with HiddenStateClient(
            server.url, dump_dir=server.dump_dir, max_in_flight=1
        ) as client:
            for i in range(8):
                await client.extract(sample(i, n=512))
    assert 0 < peak[0] <= client.budget.peak  # one dump in flight, every byte of it accounted


def publish_claiming(root: Path, rid: str, ids: list[int], **claims: Any) -> Path:
    """Publish a dump of ``ids`` whose meta.json claims ``claims``; its files match the claims'
    shapes where that is a sane size, and are small otherwise."""
    meta: dict[str, Any] = {
        "rid": rid, "input_ids": ids, "num_tokens": len(ids), "layer_ids": list(LAYERS),
        "final_norm": "post_norm", "hidden_size": HIDDEN, "dtype": "bfloat16",
        "producer": {"name": "liar", "version": "1"}, **claims,
    }  # fmt: skip
    t, k, h = len(ids), len(meta["layer_ids"]), meta["hidden_size"]
    meta |= {"aux_shape": [t, k, h], "final_shape": [t, h]}
    tmp = root / f".tmp-req_{rid}-liar"
    tmp.mkdir()
    (tmp / "meta.json").write_text(json.dumps(meta))
    one = b"\x00\x3c"  # 1.0 in float16 and a small positive number in bfloat16
    for name, elements in (("aux.bin", t * k * h), ("final.bin", t * h)):
        (tmp / name).write_bytes(one * max(0, min(elements, 1 << 16)))
    (tmp / "done").touch()
    tmp.rename(request_dir(root, rid))
    return request_dir(root, rid)


def lie_in_the_next_dump(server: FakeServer, **claims: Any) -> None:
    honest = server.engine.dump

    def dump(rid: str, ids: list[int], *_: object) -> Path:
        server.engine.dump = honest  # type: ignore[method-assign]
        return publish_claiming(server.dump_dir, rid, ids, **claims)

    server.engine.dump = dump  # type: ignore[method-assign]


@pytest.mark.parametrize(
    ("claims", "error"),
    [
        ({"hidden_size": 2**40}, hsdump.ShapeMismatch),
        ({"hidden_size": -1}, hsdump.ShapeMismatch),
        ({"hidden_size": 0}, hsdump.ShapeMismatch),
        ({"dtype": "float16"}, hsdump.DtypeMismatch),
        ({"layer_ids": []}, hsdump.LayerMismatch),
        ({"layer_ids": [1, 3, 5]}, hsdump.LayerMismatch),
        ({"final_norm": "pre_norm"}, hsdump.LayerMismatch),
    ],
)
async def test_a_first_dump_unlike_the_manifest_is_refused_and_sets_nothing(
    client: HiddenStateClient, server: FakeServer, claims: dict[str, Any], error: type[Exception]
) -> None:
    lie_in_the_next_dump(server, **claims)
    with pytest.raises(error) as info:
        await client.extract(sample(20))
    assert info.value.sample_id == "s20" and repr(next(iter(claims.values()))) in str(info.value)
    for i in range(21, 24):  # the honest dumps after it are all accepted
        s = sample(i)
        assert_belongs_to(await client.extract(s), s)
    assert request_dirs(server.dump_dir) == []


@pytest.mark.parametrize(
    ("settings", "found"),
    [
        ({"hidden_size": 0}, "hidden_size 0, outside [1,"),
        ({"hidden_size": 2**40}, f"hidden_size {2**40}, outside [1,"),
        ({"layer_ids": ()}, "no aux layers"),
        ({"layer_ids": (2, 2)}, "aux layers [2, 2]"),
        ({"layer_ids": (-1, 2)}, "aux layers [-1, 2]"),
        ({"server_info": {"hidden_size": 64}}, "model whose hidden size is 64"),
        ({"server_info": {"num_hidden_layers": 6}}, "a model of 6 decoder layers"),
    ],
)
async def test_a_manifest_that_cannot_be_the_models_is_refused_at_open(
    tmp_path: Path, settings: dict[str, Any], found: str
) -> None:
    settings = {"layer_ids": LAYERS, "hidden_size": HIDDEN, **settings}
    with FakeServer(tmp_path, **settings) as srv:
        with pytest.raises(hsdump.ServerConfigError, match="hsdump-fake") as info:
            async with HiddenStateClient(srv.url, dump_dir=tmp_path):
                pass
    assert found in str(info.value)


async def test_the_manifest_is_checked_against_the_local_model_config(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    config = {"hidden_size": 7, "text_config": {"hidden_size": HIDDEN * 2, "num_hidden_layers": 8}}
    (model / "config.json").write_text(json.dumps(config))
    dumps = tmp_path / "dumps"
    with FakeServer(dumps, server_info={"model_path": str(model)}) as srv:
        with pytest.raises(hsdump.ServerConfigError, match=f"hidden size is {HIDDEN * 2}"):
            async with HiddenStateClient(srv.url, dump_dir=dumps):
                pass


async def test_one_in_flight_sends_the_next_request_once_the_server_answered(
    client: HiddenStateClient, server: FakeServer
) -> None:
    """The lock covers the request at the server, not the dump written after its response."""
    second_arrived, rids = threading.Event(), []

    def fault_for(rid: str, ids: list[int]) -> Fault | None:
        rids.append(rid)
        if len(rids) > 1:
            second_arrived.set()
            return None
        return Fault("response_first", delay=0)

    write_dump = server.engine.dump

    def dump(rid: str, ids: list[int], fault: Fault | None = None) -> Path:
        if rid == rids[0] and not second_arrived.wait(10):
            raise AssertionError("the second request waited for the first dump")
        return write_dump(rid, ids, fault or Fault())

    server.engine.fault_for, server.engine.dump = fault_for, dump
    first, second = sample(0), sample(1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(client.extract, first)
        await anyio.wait_all_tasks_blocked()
        assert_belongs_to(await client.extract(second), second)
    assert len(rids) == 2 and request_dirs(server.dump_dir) == []


@pytest.mark.parametrize("dtype", ["float16", "float32"])
async def test_fp16_and_fp32_dumps_reach_the_store_bit_exact(tmp_path: Path, dtype: str) -> None:
    """Dumped bits, the client's tensors, the stored tensors and the store's statistics agree."""
    from hsdump import open_store

    float_dtype, int_dtype = {
        "float16": (torch.float16, torch.int16),
        "float32": (torch.float32, torch.int32),
    }[dtype]
    s = sample(7)
    with FakeServer(tmp_path / "dumps", layer_ids=LAYERS, hidden_size=HIDDEN, dtype=dtype) as srv:
        async with HiddenStateClient(srv.url, dump_dir=srv.dump_dir, dump_timeout=2) as c:
            states = await c.extract(s)
    aux, final = fake_states(s.input_ids, LAYERS, HIDDEN, dtype)
    assert states.aux_hidden_states.dtype == states.final_hidden_state.dtype == float_dtype
    for got, dumped in ((states.aux_hidden_states, aux), (states.final_hidden_state, final)):
        assert got.view(int_dtype).numpy().tobytes() == dumped.tobytes()
    with open_store(tmp_path / "s.zarr", mode="a") as store:
        await store.awrite(states)
    with open_store(tmp_path / "s.zarr", mode="r") as store:
        back, stats = store[s.id], store.stats()
    assert torch.equal(back.aux_hidden_states, states.aux_hidden_states)
    assert torch.equal(back.final_hidden_state, states.final_hidden_state)
    values = states.aux_hidden_states[:, 0].double()
    assert stats[0].count == values.numel() and stats[0].non_finite == 0
    assert stats[0].max_abs == pytest.approx(float(values.abs().max()))
    assert stats[0].mean == pytest.approx(float(values.mean()), rel=1e-5)


def test_a_server_on_a_taken_port_raises_server_start_error_naming_it(tmp_path: Path) -> None:
    import socket

    from hsdump import ServerError, ServerStartError

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        server = FakeServer(tmp_path, port=port)
        with pytest.raises(ServerStartError, match=f"127.0.0.1:{port}: Address already in use"):
            server.start()
        server.stop()
    assert issubclass(ServerStartError, ServerError) and issubclass(ServerStartError, RuntimeError)


async def test_stats_since_a_snapshot_count_only_the_later_requests(
    client: HiddenStateClient, server: FakeServer
) -> None:
    await client.extract(sample(0))
    before = client.stats.copy()
    server.inject(Fault("nan"))
    with pytest.raises(hsdump.NonFiniteValues):
        await client.extract(sample(1))
    await client.extract(sample(2, n=7))
    later = client.stats.since(before)
    assert (later.requests, later.tokens, later.failures) == (1, 7, {"NonFiniteValues": 1})
    assert before.requests == 1 and before.failures == {}  # the snapshot did not move
    assert later.stages()["server"] == pytest.approx(client.stats.server_s - before.server_s)


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_extract_works_under_trio_with_the_inotify_watcher(server: FakeServer) -> None:
    async with HiddenStateClient(
        server.url, dump_dir=server.dump_dir, watcher="inotify", dump_timeout=2
    ) as client:
        for i in range(3):
            s = sample(40 + i)
            assert_belongs_to(await client.extract(s), s)
