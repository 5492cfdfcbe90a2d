"""What produced a store's hidden states, and the rule that keeps one store to one setting."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from hsdump._exceptions import ProvenanceMismatch

if TYPE_CHECKING:
    from hsdump._protocol import ProducerManifest
    from hsdump._types import HiddenStates

__all__ = [
    "SETTING_FIELDS",
    "Provenance",
    "check_compatible",
    "check_server",
    "describe",
    "provenance_of",
]

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


def describe(prov: Provenance | None) -> list[str]:
    """Lines that say what produced a store: model, producer, layer ids and final norm.

    Layer ids are shown in both conventions a trainer meets: hsdump's (transformers'
    ``hidden_states[i]``) and SGLang's API ids, which are these minus one.
    """
    if prov is None:
        return ["provenance: none recorded (the store holds no sample yet)"]
    model = prov.model_path or _UNKNOWN
    if prov.model_revision:
        model += f" (revision {prov.model_revision})"
    producer = " ".join(x for x in (prov.producer_name, prov.producer_version) if x) or _UNKNOWN
    ids = ", ".join(str(i) for i in prov.layer_ids)
    sglang = ", ".join(str(i - 1) for i in prov.layer_ids if i >= 1) or "none"
    sglang += " (transformers' minus one"
    sglang += "; layer 0, the embeddings, has none)" if 0 in prov.layer_ids else ")"
    convention = "" if prov.layer_convention else ", convention not recorded"
    return [
        f"model: {model}",
        f"producer: {producer}",
        f"layer ids: {ids} (transformers hidden_states[i]{convention})",
        f"SGLang API layer ids: {sglang}",
        f"final state: {_FINAL_NORM.get(prov.final_norm or '', _UNKNOWN)}",
        f"hidden size {prov.hidden_size}, dtype {prov.dtype}",
    ]


_UNKNOWN = "unknown (not recorded)"
_FINAL_NORM = {
    "post_norm": "post-norm (after the model's last norm)",
    "pre_norm": "pre-norm (before the model's last norm)",
}


def _difference(a: Provenance, b: Provenance) -> tuple[str, Any, Any] | None:
    """The first setting known on both sides that differs: its name and the two values."""
    for name in SETTING_FIELDS:
        have, got = getattr(a, name), getattr(b, name)
        if have is not None and got is not None and have != got:
            return name, have, got
    return None


def check_compatible(store: Provenance, sample: Provenance, *, where: str, sample_id: str) -> None:
    """Raise `ProvenanceMismatch` if a setting known on both sides differs."""
    if (found := _difference(store, sample)) is not None:
        name, have, got = found
        raise ProvenanceMismatch(
            f"{name} differs: the store at {where} holds samples with {name}={have!r}, this sample "
            f"has {name}={got!r}. One store holds one setting: write this sample to a new store "
            "(another path), or rerun the server with the store's settings",
            sample_id=sample_id,
        )


def check_server(store: Provenance, manifest: ProducerManifest, *, where: str, url: str) -> None:
    """Raise `ProvenanceMismatch` if the server's producer dumps under another setting than the
    store's: checked before a run sends any request, as each sample's write would refuse it."""
    server = Provenance(
        model_path=manifest.model_path or None,
        layer_ids=manifest.layer_ids,
        final_norm=manifest.final_norm,
        hidden_size=manifest.hidden_size,
        dtype=manifest.dtype,
        producer_name=manifest.producer.name,
        producer_version=manifest.producer.version,
    )
    if (found := _difference(store, server)) is not None:
        name, have, got = found
        raise ProvenanceMismatch(
            f"the store at {where} was made under another setting than the server at {url} "
            f"dumps: {name} differs (store {have!r}, server {got!r}). One store holds one "
            "setting: extract into a new store (another --out), or run the server with the "
            "store's settings"
        )
