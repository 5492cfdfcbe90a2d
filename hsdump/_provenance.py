"""What produced a store's hidden states, and the rule that keeps one store to one setting."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from hsdump._exceptions import ProvenanceMismatch

if TYPE_CHECKING:
    from hsdump._types import HiddenStates

__all__ = ["SETTING_FIELDS", "Provenance", "check_compatible", "provenance_of"]

# Fields that define "the same setting": samples differing in any of these must not share a store.
# Creation time, hsdump version and codec are informational (they never change the values).
SETTING_FIELDS = (
    "model_path",
    "model_revision",
    "layer_ids",
    "layer_convention",
    "final_norm",
    "hidden_size",
    "dtype",
    "producer_name",
    "producer_version",
)


class Provenance(BaseModel):
    """The settings a store's hidden states were produced under.

    ``None`` means unknown (a sample built by hand carries only what its tensors show: layer ids,
    hidden size and dtype); unknown fields are not compared.

    Attributes:
        model_path: Model path or name the server loaded.
        model_revision: Model revision, when the producer reported one.
        layer_ids: Aux layer ids (transformers ``hidden_states`` index).
        layer_convention: How ``layer_ids`` are counted.
        final_norm: Whether the final state is ``post_norm`` or ``pre_norm``.
        hidden_size: H.
        dtype: Logical dtype of the hidden states (``bfloat16`` normally).
        producer_name: The server plugin that dumped the states.
        producer_version: Its version.
        hsdump_version: hsdump version that created the store part.
        created_at: When the store part got its first sample (UTC, ISO 8601).
        codec: The hidden-state codec.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str | None = None
    model_revision: str | None = None
    layer_ids: list[int]
    layer_convention: str | None = None
    final_norm: str | None = None
    hidden_size: int
    dtype: str
    producer_name: str | None = None
    producer_version: str | None = None
    hsdump_version: str = ""
    created_at: str = Field(default_factory=lambda: dt.datetime.now(dt.UTC).isoformat())
    codec: dict[str, Any] = Field(default_factory=dict)


def provenance_of(hs: HiddenStates, dtype: str, codec: dict[str, Any]) -> Provenance:
    """The provenance a sample implies: from its ``meta`` if it has one, else from its tensors."""
    from hsdump import __version__

    meta = hs.meta
    fields: dict[str, Any] = {
        "layer_ids": list(hs.layer_ids),
        "hidden_size": int(hs.final_hidden_state.shape[-1]),
        "dtype": dtype,
        "hsdump_version": __version__,
        "codec": codec,
    }
    if meta is not None:
        revision = meta.extra.get("model_revision")
        fields.update(
            model_path=meta.model_path or None,
            model_revision=str(revision) if revision else None,
            layer_convention=meta.layer_convention,
            final_norm=meta.final_norm,
            producer_name=meta.producer.name,
            producer_version=meta.producer.version,
        )
    return Provenance(**fields)


def check_compatible(store: Provenance, sample: Provenance, *, where: str, sample_id: str) -> None:
    """Raise :class:`ProvenanceMismatch` if a setting known on both sides differs."""
    for name in SETTING_FIELDS:
        have, got = getattr(store, name), getattr(sample, name)
        if have is None or got is None or have == got:
            continue
        raise ProvenanceMismatch(
            f"{name} differs: the store at {where} holds samples with {name}={have!r}, this sample "
            f"has {name}={got!r}. One store holds one setting: write this sample to a new store "
            "(another path), or rerun the server with the store's settings",
            sample_id=sample_id,
        )
