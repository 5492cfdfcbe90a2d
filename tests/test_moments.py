"""Row moments: the producer's sum and sum of squares of every vector (``moments.bin``).

A producer that announces ``row_moments`` writes them with each dump; the client checks them
against the values of a few rows and hands them on (`HiddenStates.row_moments`), and the store
takes its per-layer statistics from them instead of widening every value.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from store_crash_writer import make_sample, open_test_store

import hsdump
from hsdump import HiddenStateClient, HiddenStates, InputError, MomentsMismatch, Sample
from hsdump.testing import Capabilities, FakeServer, Fault, fake_states

LAYERS, HIDDEN = (2, 4, 6), 32


def _sample(i: int, n: int = 12) -> Sample:
    return Sample(id=f"s{i}", input_ids=[(i * 37 + j * 11) % 997 for j in range(n)])


MOMENTS_FILE = "moments.bin"  # the protocol's name for them (docs/protocol.md)


def _moments(aux: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """Float32 ``[T, K + 1, 2]``: each vector's sum and sum of squares, summed in float32 as a
    CPU producer sums them."""
    values = torch.cat([aux, final[:, None]], dim=1).float().numpy()
    sums, squares = np.einsum("tlh->tl", values), np.einsum("tlh,tlh->tl", values, values)
    return torch.from_numpy(np.stack((sums, squares), -1))


def _moments_of(hs: HiddenStates) -> torch.Tensor:
    return _moments(hs.aux_hidden_states, hs.final_hidden_state)


def _bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


def _stats(path: Path, samples: list[HiddenStates]) -> dict[str, dict[str, float]]:
    """The store's statistics after writing ``samples``, by layer."""
    with open_test_store(str(path)) as store:
        for hs in samples:
            store.write(hs)
    with hsdump.open_store(str(path), "r") as store:
        return {str(s.layer): {k: v for k, v in s.summary().items() if k != "layer"}
                for s in store.stats()}  # fmt: skip


def _assert_same(got: dict[str, dict[str, float]], want: dict[str, dict[str, float]]) -> None:
    assert got.keys() == want.keys()
    for layer, stats in want.items():
        assert got[layer] == pytest.approx(stats, rel=1e-9), layer


# --- the client ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_extracted_states_carry_the_producers_moments(tmp_path: Path) -> None:
    s = _sample(1)
    with FakeServer(tmp_path, layer_ids=LAYERS, hidden_size=HIDDEN) as server:
        async with HiddenStateClient(server.url, dump_dir=tmp_path) as client:
            hs = await client.extract(s)
    aux, final = (_bf16(bits) for bits in fake_states(s.input_ids, LAYERS, HIDDEN))
    assert hs.row_moments is not None and hs.row_moments.dtype == torch.float32
    assert hs.row_moments.shape == (len(s.input_ids), len(LAYERS) + 1, 2)
    assert torch.equal(hs.row_moments, _moments(aux, final))


@pytest.mark.anyio
async def test_moments_that_do_not_describe_the_dump_are_refused(tmp_path: Path) -> None:
    with FakeServer(tmp_path, layer_ids=LAYERS, hidden_size=HIDDEN) as server:
        async with HiddenStateClient(server.url, dump_dir=tmp_path) as client:
            server.inject(Fault("wrong_moments"))  # after the probe that opening sends
            with pytest.raises(MomentsMismatch) as info:
                await client.extract(_sample(2))
            assert await client.extract(_sample(2))  # the next attempt passes
    message = str(info.value)
    assert "s2" in message and MOMENTS_FILE in message and "aux layer 2" in message
    assert "at token 0" in message and "sum of squares" in message


@pytest.mark.anyio
async def test_a_dump_missing_the_announced_moments_is_refused(tmp_path: Path) -> None:
    with FakeServer(tmp_path, layer_ids=LAYERS, hidden_size=HIDDEN) as server:
        async with HiddenStateClient(server.url, dump_dir=tmp_path) as client:
            server.inject(Fault("no_moments"))  # after the probe that opening sends
            with pytest.raises(hsdump.DumpValidationError, match=f"{MOMENTS_FILE} is missing"):
                await client.extract(_sample(3))


@pytest.mark.anyio
async def test_without_the_capability_no_moments_are_read(tmp_path: Path) -> None:
    caps = Capabilities(chunked_prefill_assembly=False, prefix_cache_guard=False)
    with FakeServer(tmp_path, layer_ids=LAYERS, hidden_size=HIDDEN, capabilities=caps) as server:
        async with HiddenStateClient(server.url, dump_dir=tmp_path) as client:
            hs = await client.extract(_sample(4))
    assert hs.row_moments is None


# --- the store ------------------------------------------------------------------------------


def test_the_store_takes_its_statistics_from_given_moments(tmp_path: Path) -> None:
    computed = [make_sample(i) for i in range(6)]
    given = [make_sample(i) for i in range(6)]
    for hs in given:
        hs.row_moments = _moments_of(hs)
    _assert_same(_stats(tmp_path / "given", given), _stats(tmp_path / "computed", computed))


def test_the_store_uses_the_given_moments_not_its_own(tmp_path: Path) -> None:
    hs = make_sample(1)
    hs.row_moments = _moments_of(hs)
    hs.row_moments[..., 0] += 1.0  # every vector's sum one higher: the mean moves by 1 / H
    plain = _stats(tmp_path / "plain", [make_sample(1)])
    shifted = _stats(tmp_path / "shifted", [hs])
    hidden = hs.final_hidden_state.shape[1]
    for layer, stats in plain.items():
        assert shifted[layer]["mean"] == pytest.approx(stats["mean"] + 1.0 / hidden, rel=1e-6)


def test_a_non_finite_row_is_counted_even_when_its_moments_say_finite(tmp_path: Path) -> None:
    nan = make_sample(2)
    nan.aux_hidden_states[3, 0, 5] = float("nan")
    declared = make_sample(2)
    declared.aux_hidden_states[3, 0, 5] = float("nan")
    declared.row_moments = _moments_of(make_sample(2))  # moments of the finite values
    got, want = _stats(tmp_path / "declared", [declared]), _stats(tmp_path / "nan", [nan])
    assert got["2"]["non_finite"] == want["2"]["non_finite"] == 1
    _assert_same(got, want)


def test_moments_of_the_wrong_shape_are_an_input_error(tmp_path: Path) -> None:
    hs = make_sample(1)
    hs.row_moments = torch.zeros(hs.num_tokens, len(hs.layer_ids), 2)  # the final vector left out
    with open_test_store(str(tmp_path / "s")) as store, pytest.raises(InputError) as info:
        store.write(hs)
    assert "row_moments must be" in str(info.value) and "s1" in str(info.value)
