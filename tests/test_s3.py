"""The store on S3, against moto's S3 API server on loopback: a real HTTP server, real processes.

One server per module; each test gets a fresh bucket and the AWS variables pointing at it
(children started by a test inherit them).
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from store_crash_writer import (
    SHARD_TOKENS,
    as_sample,
    killed_past_its_commit,
    make_sample,
    open_test_store,
    shards_past_commit,
)
from typer.testing import CliRunner

from hsdump import (
    ConfigError,
    PartLockedError,
    PartLockLostError,
    RunOptions,
    Sample,
    StoreCorruptedError,
    StoreError,
    StoreIOError,
    StoreNotFoundError,
    open_store,
    run_parallel_extraction,
    run_ray_extraction,
    verify_store,
)
from hsdump.testing import FakeServer, cli_app

boto3 = pytest.importorskip("boto3")
pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

WRITER = Path(__file__).with_name("store_crash_writer.py")
KEY_ID, SECRET = "AKIAHSDUMPTESTKEY01", "hsdump-test-secret-0123456789abcdef"
runner = CliRunner()


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A boto3 client of the server; the AWS variables of this process point at it."""
    for name, value in {
        "AWS_ENDPOINT_URL": s3_endpoint,
        "AWS_ACCESS_KEY_ID": KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "HSDUMP_LEASE_TTL_S"):
        monkeypatch.delenv(name, raising=False)
    return boto3.client("s3")


@pytest.fixture
def bucket(s3: Any) -> str:
    name = f"hsdump-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    return name


@pytest.fixture
def url(bucket: str) -> str:
    return f"s3://{bucket}/runs/s.zarr"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _assert_same(got: Any, want: Any) -> None:
    assert torch.equal(_bits(got.aux_hidden_states), _bits(want.aux_hidden_states))
    assert torch.equal(_bits(got.final_hidden_state), _bits(want.final_hidden_state))
    assert torch.equal(got.input_ids, want.input_ids.long())
    assert (got.loss_mask is None) == (want.loss_mask is None)
    if want.loss_mask is not None:
        assert torch.equal(got.loss_mask, want.loss_mask)


def _keys(s3: Any, bucket: str, prefix: str = "") -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


# -- round trip ----------------------------------------------------------------------------------


def test_samples_read_back_bit_identical_to_the_same_samples_in_a_local_store(
    url: str, tmp_path: Path
) -> None:
    ids = range(7)  # 1 to 583 tokens: samples inside one shard and across three
    for where in (url, str(tmp_path / "local.zarr")):
        with open_test_store(where, writer_id="w0") as store:
            for i in ids:
                store.write(make_sample(i))
    with open_store(url, "r") as remote, open_store(tmp_path / "local.zarr", "r") as local:
        assert remote.committed_ids() == local.committed_ids() == {f"s{i}" for i in ids}
        for i in ids:
            got = remote.get(f"s{i}", verify=True)
            _assert_same(got, local[f"s{i}"])
            _assert_same(got, make_sample(i))
            assert remote.locate(f"s{i}") == local.locate(f"s{i}")
        assert remote.num_tokens == local.num_tokens
        assert remote.where == url and got.attrs["store"] == url


def test_a_zarr_fsspec_store_object_on_s3_is_locked_and_described_like_its_url(url: str) -> None:
    from zarr.storage import FsspecStore

    fs_store = FsspecStore.from_url(url, storage_options={"use_listings_cache": False})
    with open_test_store(fs_store, writer_id="w0") as store:  # type: ignore[arg-type]
        store.write(make_sample(1))
        assert store.where == url
        with pytest.raises(PartLockedError, match="lease"):
            open_test_store(url, writer_id="w0")
    assert open_store(url, "r").committed_ids() == {"s1"}


# -- crashes and several writers -----------------------------------------------------------------


def _spawn(url: str, n: int, writer_id: str = "w0", stride: int = 1, offset: int = 0) -> Any:
    args = [sys.executable, str(WRITER), url, str(n), writer_id, str(stride), str(offset)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill_after(proc: Any, lines: int) -> None:
    for _ in range(lines):
        if not proc.stdout.readline():
            break
    proc.send_signal(signal.SIGKILL)
    proc.communicate()


def _finish(proc: Any) -> int:
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err[-3000:]
    return int(out.strip().splitlines()[-1].split()[1])


def _committed_intact(url: str) -> set[str]:
    with open_store(url, "r") as store:
        ids = store.committed_ids()
        for sid in ids:
            _assert_same(store.get(sid, verify=True), make_sample(int(sid[1:])))
        assert not store.duplicates
    return ids


def _shards_past(s3: Any, bucket: str, url: str) -> list[int]:
    """Hidden-state shards of part-w0 that hold no committed row."""
    with open_store(url, "r") as store:
        rows = store._readers["part-w0"].index.rows
        end = int((rows[:, 0] + rows[:, 1]).max()) if len(rows) else 0
    keys = _keys(s3, bucket, "runs/s.zarr/part-w0/hidden/c.")
    shards = [int(k.rpartition("/c.")[2].split(".")[0]) for k in keys]
    return [s for s in shards if s * SHARD_TOKENS >= end]


@pytest.mark.slow
def test_sigkill_of_a_writer_then_rerun_loses_nothing_committed_and_writes_only_the_rest(
    url: str, s3: Any, bucket: str
) -> None:
    n, before = 16, set[str]()
    for lines in (3, 8):
        _kill_after(_spawn(url, n), lines)
        with open_store(url, "r") as store:
            committed = store.committed_ids()
        assert before <= committed  # nothing committed is lost
        before = committed
    assert before, "the kills landed before any commit: nothing was tested"
    # The killed writer's lease names a dead process on this machine: reopening takes it over
    # at once, and drops the shards written after the last commit.
    open_test_store(url, writer_id="w0").close()
    assert not _shards_past(s3, bucket, url)
    written = _finish(_spawn(url, n))
    assert written == n - len(before)
    # Samples committed before the kills were skipped by the rerun: reading every sample bit
    # for bit (checksums too) shows that none was visible half-written.
    assert _committed_intact(url) == {f"s{i}" for i in range(n)}
    assert not _keys(s3, bucket, "runs/s.zarr.hsdump-locks/")  # released on close


def test_a_run_with_nothing_to_extract_removes_a_killed_writers_shards_and_lease(
    url: str, s3: Any, bucket: str
) -> None:
    """A killed Ray actor's part is never opened again: the run tidies it."""
    pytest.importorskip("ray")
    part = "part-ray-s0-a0"
    killed_past_its_commit(url, "ray-s0-a0")

    def stranded() -> list[str]:
        keys = _keys(s3, bucket, f"runs/s.zarr/{part}/hidden/c.")
        return shards_past_commit(url, part, [k.rpartition("/")[2] for k in keys])

    assert stranded(), "the writer left no shard past its last commit: nothing was tested"
    locks = "runs/s.zarr.hsdump-locks/"
    assert _keys(s3, bucket, locks) == [f"{locks}{part}.lease"]
    with open_test_store(url, writer_id="ray-s0-a1") as successor:
        for i in range(3, 8):
            successor.write(make_sample(i))
    samples = [as_sample(i) for i in range(8)]
    summary = run_ray_extraction(samples, servers=[("http://127.0.0.1:9", None, None)], store=url)
    assert summary.ok and summary.skipped == 8
    assert stranded() == [] and _keys(s3, bucket, locks) == []
    assert verify_store(url).clean


def test_extract_warns_while_another_writer_holds_a_part_of_the_s3_store(
    url: str, tmp_path: Path
) -> None:
    (tmp_path / "d.jsonl").write_text('{"id": "a", "input_ids": [1, 2, 3]}\n')
    with FakeServer(tmp_path / "dumps", hidden_size=16) as server:
        args = ["extract", str(tmp_path / "d.jsonl"), "--out", url, "--server-url", server.url]
        args += ["--dump-dir", str(server.dump_dir), "--writer-id", "mine"]
        with open_test_store(url, writer_id="other"):
            result = runner.invoke(cli_app, args)
    said = " ".join(result.output.split())
    holder = f"part-other (pid {__import__('os').getpid()} on {socket.gethostname()})"
    assert result.exit_code == 0 and f"live writers hold {holder}" in said, said


def test_reopening_a_part_aborts_the_unfinished_uploads_a_killed_writer_left(
    url: str, s3: Any, bucket: str
) -> None:
    with open_test_store(url, writer_id="w0") as store:
        store.write(make_sample(1))
    key = "runs/s.zarr/part-w0/hidden/c.9.0.0"
    upload = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    s3.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * 1024)
    other = s3.create_multipart_upload(Bucket=bucket, Key="elsewhere/blob")["UploadId"]
    open_test_store(url, writer_id="w0").close()
    left = s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert [u["UploadId"] for u in left] == [other]


@pytest.mark.slow
def test_two_writer_processes_then_one_reader_sees_both_parts(url: str) -> None:
    n = 12
    procs = [_spawn(url, n, writer_id=f"w{k}", stride=2, offset=k) for k in range(2)]
    assert [_finish(p) for p in procs] == [n // 2, n // 2]
    assert _committed_intact(url) == {f"s{i}" for i in range(n)}
    with open_store(url, "r") as store:
        assert sorted(store._readers) == ["part-w0", "part-w1"]


# -- the lease -----------------------------------------------------------------------------------


def test_a_second_writer_of_one_part_is_refused_naming_the_lease_and_its_holder(url: str) -> None:
    lease = f"{url}.hsdump-locks/part-w0.lease"
    with open_test_store(url, writer_id="w0"):
        with pytest.raises(PartLockedError) as refused:
            open_test_store(url, writer_id="w0")
        message = str(refused.value)
        assert lease in message and "own writer_id" in message
        assert f"pid {__import__('os').getpid()}" in message and "expires in" in message
        # Its holder runs here: no rerun waits for the lease to expire.
        assert "runs on this machine: stop it" in message and "once the lease" not in message
        open_test_store(url, writer_id="w1").close()  # another part is free
    open_test_store(url, writer_id="w0").close()  # released on close


def _race(url: str, writer_id: str) -> list[Any]:
    """Two writers of part ``writer_id`` opening at once: the store or the error of each."""
    start, outcomes = threading.Barrier(2), []

    def open_one() -> None:
        start.wait()
        try:
            outcomes.append(open_test_store(url, writer_id=writer_id))
        except PartLockedError as exc:
            outcomes.append(exc)

    rivals = [threading.Thread(target=open_one) for _ in range(2)]
    for rival in rivals:
        rival.start()
    for rival in rivals:
        rival.join()
    return outcomes


def test_of_two_writers_opening_one_free_part_at_once_exactly_one_takes_it(url: str) -> None:
    """Both may find no lease: only one create of it succeeds (If-None-Match: *), and the other
    writer then finds the winner's lease and is refused."""
    for attempt in range(5):
        outcomes = _race(url, f"w{attempt}")
        opened = [o for o in outcomes if not isinstance(o, Exception)]
        for store in opened:
            store.close()
        assert len(opened) == 1, outcomes
        assert [type(o) for o in outcomes if o not in opened] == [PartLockedError]


def _foreign_lease(ttl_s: float) -> bytes:
    holder = {
        "owner": "f" * 32, "writer_id": "w0", "host": "node-elsewhere", "machine": "elsewhere",
        "pid": 1, "pid_start": "1", "ttl_s": ttl_s, "acquired_at": "2026-01-01T00:00:00+00:00",
    }  # fmt: skip
    return json.dumps(holder).encode()


def test_a_live_lease_of_another_machine_is_refused_and_an_expired_one_taken_over(
    url: str, s3: Any, bucket: str
) -> None:
    key = "runs/s.zarr.hsdump-locks/part-w0.lease"
    s3.put_object(Bucket=bucket, Key=key, Body=_foreign_lease(ttl_s=3600))
    with pytest.raises(PartLockedError, match="held by pid 1 on node-elsewhere") as refused:
        open_test_store(url, writer_id="w0")
    assert "a rerun on node-elsewhere takes the part over at once" in str(refused.value)
    s3.put_object(Bucket=bucket, Key=key, Body=_foreign_lease(ttl_s=0))  # expired at once
    with open_test_store(url, writer_id="w0") as store:
        store.write(make_sample(2))
        held = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        assert held["pid"] == __import__("os").getpid()
    assert open_store(url, "r").committed_ids() == {"s2"}


def test_a_writer_whose_lease_was_taken_over_commits_nothing_more(
    url: str, s3: Any, bucket: str
) -> None:
    key = "runs/s.zarr.hsdump-locks/part-w0.lease"
    store = open_test_store(url, writer_id="w0")
    store.write(make_sample(1))
    store.flush()
    s3.put_object(Bucket=bucket, Key=key, Body=_foreign_lease(ttl_s=3600))
    store.write(make_sample(3))
    with pytest.raises(PartLockLostError, match="lost its lease"):
        store.flush()
    store.close()
    assert open_store(url, "r").committed_ids() == {"s1"}
    assert json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())["pid"] == 1


# -- verify-store --------------------------------------------------------------------------------


def _damage_a_shard(s3: Any, bucket: str) -> None:
    key = "runs/s.zarr/part-w0/hidden/c.0.0.0"
    data = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[100] ^= 0xFF  # inside the first compressed chunk
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(data))


def test_verify_store_on_s3_passes_then_names_the_samples_of_a_damaged_object(
    url: str, s3: Any, bucket: str
) -> None:
    with open_test_store(url, writer_id="w0") as store:
        for i in range(4):
            store.write(make_sample(i))
    clean = runner.invoke(cli_app, ["verify-store", url])
    assert clean.exit_code == 0, clean.output
    assert "checked 4 samples: 4 intact, 0 corrupted" in clean.output
    _damage_a_shard(s3, bucket)
    damaged = runner.invoke(cli_app, ["verify-store", url])
    assert damaged.exit_code == 1, damaged.output
    assert "corrupted s0 (part-w0)" in damaged.output
    report = verify_store(url)
    assert "s0" in {bad.sample_id for bad in report.corrupted} and not report.clean


def test_a_damaged_part_state_on_s3_is_named(url: str, s3: Any, bucket: str) -> None:
    with open_test_store(url, writer_id="w0") as store:
        store.write(make_sample(1))
    s3.put_object(Bucket=bucket, Key="runs/s.zarr/part-w0/zarr.json", Body=b"{not json")
    with pytest.raises(StoreCorruptedError, match=rf"{url}/part-w0/zarr.json is damaged"):
        verify_store(url)


def test_stats_reads_an_s3_store_from_the_cli(url: str) -> None:
    with open_test_store(url, writer_id="w0") as store:
        store.write(make_sample(3))
    result = runner.invoke(cli_app, ["stats", url])
    assert result.exit_code == 0, result.output
    assert f"1 samples, {make_sample(3).input_ids.numel():,} tokens in {url}" in result.output


# -- credentials ---------------------------------------------------------------------------------


def test_credentials_never_appear_in_descriptions_messages_logs_or_the_lease(
    s3_endpoint: str,
    s3: Any,
    bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)  # the options alone carry them
    options = {"key": "AKIAOPTIONKEY0000001", "secret": "option-secret-value-42"}
    options["endpoint_url"] = s3_endpoint
    url = f"s3://{bucket}/creds.zarr"
    seen: list[str] = []
    with caplog.at_level(logging.DEBUG):
        with open_test_store(url, writer_id="w0", storage_options=options) as store:
            store.write(make_sample(1))
            store.flush()
            seen += [store.where, repr(store), repr(store._root), str(store._root.store)]
            seen.append(json.dumps(store["s1"].attrs))
            with pytest.raises(PartLockedError) as held:
                open_test_store(url, writer_id="w0", storage_options=options)
            seen.append(str(held.value))
        for bad in (f"s3://{bucket}-missing/x.zarr", url.replace("s3://", "s3://K:S@")):
            with pytest.raises((StoreError, ConfigError)) as refused:
                open_store(bad, "r", storage_options=options)
            seen.append(str(refused.value))
    # hsdump's own logs at every level, and everything `hsdump -v` shows (INFO and up); botocore's
    # DEBUG records carry the request's Authorization header, key id included, by design.
    logged = [r for r in caplog.records if r.name.startswith("hsdump") or r.levelno >= logging.INFO]
    seen += [r.getMessage() for r in logged]
    for key in _keys(s3, bucket):
        seen.append(s3.get_object(Bucket=bucket, Key=key)["Body"].read().decode("latin-1"))
    text = "\n".join(seen)
    assert "held by pid" in text and "does not exist" in text  # the messages were made
    for secret in (*options.values(), "K:S@"):
        if secret != s3_endpoint:
            assert secret not in text


# -- bad URLs, missing buckets, unreachable endpoints --------------------------------------------


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("s3://", "not an S3 bucket name"),
        ("s3://Not_A_Bucket/x.zarr", "not an S3 bucket name"),
        ("s3://bkt-ok/a//b.zarr", "empty"),
        ("s3://user:pw@bkt-ok/x.zarr", "user info"),
        ("s3://bkt-ok/x.zarr?versionId=1", "query"),
        ("gs://bkt-ok/x.zarr", "unsupported store URL gs://bkt-ok/x.zarr"),
    ],
)
def test_a_bad_url_is_a_config_error_saying_what_is_wrong(bad: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as refused:
        open_store(bad, "a")
    assert "pw" not in str(refused.value)


def test_a_whole_bucket_can_be_read_but_not_written(bucket: str) -> None:
    with pytest.raises(StoreError, match=rf"s3://{bucket} is a whole bucket.*prefix"):
        open_store(f"s3://{bucket}", "a")


@pytest.mark.parametrize("mode", ["r", "a"])
def test_a_missing_bucket_is_a_store_error_saying_so(s3: Any, mode: str) -> None:
    with pytest.raises(
        StoreNotFoundError, match=r"the bucket of s3://hsdump-no-such-bucket/x.zarr does"
    ):
        open_store("s3://hsdump-no-such-bucket/x.zarr", mode)  # type: ignore[arg-type]


def test_a_missing_store_in_a_bucket_is_a_store_error_for_readers(url: str) -> None:
    with pytest.raises(StoreNotFoundError, match=f"no store at {url}"):
        open_store(url, "r")


def test_the_cli_reports_a_missing_bucket_without_a_traceback(s3: Any) -> None:
    result = runner.invoke(cli_app, ["verify-store", "s3://hsdump-no-such-bucket/x.zarr"])
    assert result.exit_code == 2, result.output
    assert "does not exist" in result.output and "Traceback" not in result.output


def test_an_unreachable_endpoint_is_a_store_error_naming_it(
    s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's retries, read from the environment
    with pytest.raises(
        StoreIOError, match=rf"cannot reach the S3 endpoint http://127.0.0.1:{port}"
    ):
        open_store("s3://hsdump-any/x.zarr", "a")


def test_extract_reports_an_unreachable_endpoint_before_asking_the_server(
    s3: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ports = []
    for _ in range(2):  # an S3 endpoint and a server where nothing listens
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{ports[0]}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    (tmp_path / "d.jsonl").write_text('{"id": "a", "input_ids": [1, 2]}\n')
    args = ["extract", str(tmp_path / "d.jsonl"), "--out", "s3://hsdump-any/x.zarr"]
    args += ["--server-url", f"http://127.0.0.1:{ports[1]}", "--dump-dir", str(tmp_path)]
    result = runner.invoke(cli_app, args)
    said = " ".join(result.output.split())
    assert (
        result.exit_code == 2
        and f"cannot reach the S3 endpoint http://127.0.0.1:{ports[0]}" in said
    )
    assert f"127.0.0.1:{ports[1]}" not in said  # the server was not asked first


def test_storage_options_botocore_does_not_take_are_a_config_error(s3: Any) -> None:
    with pytest.raises(ConfigError, match=r"storage_options for s3://hsdump-any/x\.zarr"):
        open_store("s3://hsdump-any/x.zarr", "r", storage_options={"no_such_option": 1})


def test_workers_extract_into_an_s3_store_and_a_rerun_skips_what_is_stored(url, tmp_path) -> None:
    samples = [Sample(id=f"s{i}", input_ids=list(range(1, 6 + i))) for i in range(8)]
    with FakeServer(tmp_path / "dumps", hidden_size=16) as server:
        where = {"url": server.url, "dump_dir": server.dump_dir, "store": url}
        options = RunOptions(concurrency=2)
        first = run_parallel_extraction(samples[:5], workers=2, options=options, **where)
        again = run_parallel_extraction(samples, workers=2, options=options, **where)
    assert (first.samples_done, again.skipped, again.samples_done) == (5, 5, 3)
    with open_store(url, "r") as opened:
        assert sorted(opened) == sorted(s.id for s in samples) and not opened.duplicates
