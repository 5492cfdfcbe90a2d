"""Always-on checks that a response and a dump belong to the sample and hold usable values.

Every check raises its own `DumpValidationError` subclass naming the sample, the
request, what was expected and what was found. Reading a dump's tensor files,
with their value checks, is `hsdump._client.dumpfiles`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsdump._client.limits import local_model_config
from hsdump._exceptions import (
    DtypeMismatch,
    LayerMismatch,
    RidMismatch,
    ServerConfigError,
    ServerResponseError,
    ShapeMismatch,
    TokenMismatch,
)
from hsdump._protocol import (
    DumpMeta,
    ProducerManifest,
)

__all__ = ["Expected", "check_response", "validate_meta"]

# Far above any model's hidden size (the largest are ~2**15), far below sizes that overflow.
_MAX_HIDDEN_SIZE = 1 << 20


@dataclass
class Expected:
    """What every dump of a run must agree on.

    A client seeds every field from the producer manifest (`from_manifest`). Fields left
    unset are learnt from the first dump that passes every check (`remember`), so a dump
    that is refused never sets what the next ones are held to. ``row_moments`` (every dump holds
    ``moments.bin``) only ever comes from the manifest.
    """

    layer_ids: list[int] | None = None
    hidden_size: int | None = None
    dtype: str | None = None
    final_norm: str | None = None
    source: str = "the run's first dump"
    row_moments: bool = False

    @classmethod
    def from_manifest(
        cls,
        manifest: ProducerManifest,
        *,
        layer_ids: Sequence[int] | None = None,
        server_info: Mapping[str, Any] | None = None,
    ) -> Expected:
        """What the producer announced, checked for sane sizes and against the model's config.

        Args:
            manifest: The producer manifest read from the dump root.
            layer_ids: The aux layers the caller asked for, instead of the announced ones.
            server_info: The server's ``/server_info``: its ``hidden_size`` and
                ``num_hidden_layers``, or those of ``config.json`` in its local ``model_path``.

        Raises:
            ServerConfigError: The manifest cannot describe this model's hidden states.
        """
        problem = (
            _hidden_size_problem(manifest.hidden_size)
            or _layers_problem(manifest.layer_ids)
            or _model_problem(manifest, server_info or {})
        )
        if problem:
            raise ServerConfigError(
                f"the producer {manifest.producer.name} (pid {manifest.pid} on {manifest.host}) "
                f"announces {problem}, so its dumps cannot be trusted. Restart the server; if "
                "this persists, its capture settings or plugin are broken."
            )
        return cls(
            layer_ids=list(layer_ids if layer_ids is not None else manifest.layer_ids),
            hidden_size=manifest.hidden_size,
            dtype=manifest.dtype,
            final_norm=manifest.final_norm,
            source=f"the producer manifest of {manifest.producer.name}",
            row_moments=manifest.capabilities.row_moments,
        )

    def check(self, meta: DumpMeta, sample_id: str) -> None:
        """Raise unless ``meta`` agrees with what is expected and has sane sizes."""
        if self.layer_ids is not None and meta.layer_ids != self.layer_ids:
            raise LayerMismatch(
                f"the dump holds layers {meta.layer_ids}, expected {self.layer_ids}. The server's "
                "capture layers changed or differ from what you asked for.",
                sample_id=sample_id,
                rid=meta.rid,
            )
        for name, cls in (
            ("hidden_size", ShapeMismatch),
            ("dtype", DtypeMismatch),
            ("final_norm", LayerMismatch),
        ):
            want, got = getattr(self, name), getattr(meta, name)
            if want is not None and want != got:
                raise cls(
                    f"{name} is {got!r}, expected {want!r} (from {self.source})",
                    sample_id=sample_id,
                    rid=meta.rid,
                )
        for problem, error in (
            (_hidden_size_problem(meta.hidden_size), ShapeMismatch),
            (_layers_problem(meta.layer_ids), LayerMismatch),
        ):
            if problem:  # only reached while nothing is expected yet
                raise error(f"the dump claims {problem}", sample_id=sample_id, rid=meta.rid)

    @property
    def complete(self) -> bool:
        """Whether every field is set, so no dump's metadata would be learnt (`remember`)."""
        return None not in (self.layer_ids, self.hidden_size, self.dtype, self.final_norm)

    def remember(self, meta: DumpMeta) -> None:
        """Take what is still unset from ``meta``, a dump that passed every check."""
        self.layer_ids = self.layer_ids or list(meta.layer_ids)
        self.hidden_size = self.hidden_size or meta.hidden_size
        self.dtype = self.dtype or meta.dtype
        self.final_norm = self.final_norm or meta.final_norm


def _hidden_size_problem(hidden_size: int) -> str | None:
    """Why no model has this hidden size, if none has."""
    if not 0 < hidden_size <= _MAX_HIDDEN_SIZE:
        return f"hidden_size {hidden_size}, outside [1, {_MAX_HIDDEN_SIZE}]"
    return None


def _layers_problem(layer_ids: Sequence[int]) -> str | None:
    """Why these cannot be the aux layers of any model, if they cannot."""
    if not layer_ids:
        return "no aux layers"
    if min(layer_ids) < 0 or len(set(layer_ids)) != len(layer_ids):
        return f"aux layers {list(layer_ids)}: ids are distinct hidden_states indices (0 or more)"
    return None


def _model_problem(manifest: ProducerManifest, info: Mapping[str, Any]) -> str | None:
    """How the manifest disagrees with the model's own shape, where the server lets us see it."""
    config = local_model_config(info.get("model_path") or manifest.model_path)
    nested = config.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else config  # as the plugin reads it
    hidden = _positive_int(info.get("hidden_size")) or _positive_int(text.get("hidden_size"))
    layers = _positive_int(info.get("num_hidden_layers")) or _positive_int(
        text.get("num_hidden_layers")
    )
    if hidden is not None and hidden != manifest.hidden_size:
        return f"hidden_size {manifest.hidden_size} for a model whose hidden size is {hidden}"
    if layers is not None and max(manifest.layer_ids) >= layers:
        return (
            f"aux layers {manifest.layer_ids} for a model of {layers} decoder layers "
            f"(ids lie in [0, {layers - 1}])"
        )
    return None


def _positive_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def check_response(body: Any, *, rid: str, num_tokens: int, sample_id: str) -> None:
    """Check SGLang's ``/generate`` response for a prefill-only request."""
    meta = body.get("meta_info") if isinstance(body, dict) else None
    if not isinstance(meta, dict):
        raise ServerResponseError(
            f"the response has no meta_info: {str(body)[:200]}", sample_id=sample_id, rid=rid
        )
    if meta.get("id") != rid:
        raise RidMismatch(
            f"the response is for request {meta.get('id')!r}, expected {rid!r}",
            sample_id=sample_id,
            rid=rid,
        )
    if meta.get("prompt_tokens") != num_tokens:
        raise TokenMismatch(
            f"the server processed {meta.get('prompt_tokens')} prompt tokens, "
            f"expected {num_tokens} "
            "(was the prompt truncated? do not run the server with --allow-auto-truncate)",
            sample_id=sample_id,
            rid=rid,
        )
    if meta.get("cached_tokens", 0):
        raise ShapeMismatch(
            f"{meta['cached_tokens']} prompt tokens came from the prefix cache, so the capture is "
            "short. Start the server with --disable-radix-cache.",
            sample_id=sample_id,
            rid=rid,
        )


def validate_meta(
    meta: DumpMeta,
    path: Path,
    *,
    rid: str,
    input_ids: Sequence[int],
    sample_id: str,
    expected: Expected,
) -> None:
    """Check that the dump at ``path`` is request ``rid``'s capture of ``input_ids``.

    The values are checked as they are read (`read_checked`).
    """
    if meta.rid != rid:
        raise RidMismatch(
            f"{path} holds request {meta.rid!r}, expected {rid!r}",
            sample_id=sample_id,
            rid=rid,
        )
    _check_tokens(meta.input_ids, input_ids, sample_id, rid)
    expected.check(meta, sample_id)


def _check_tokens(got: Sequence[int], sent: Sequence[int], sample_id: str, rid: str) -> None:
    if len(got) != len(sent):
        raise TokenMismatch(
            f"the dump covers {len(got)} tokens, the sample has {len(sent)}",
            sample_id=sample_id,
            rid=rid,
        )
    if list(got) != list(sent):
        pos = next(i for i, (a, b) in enumerate(zip(got, sent, strict=True)) if a != b)
        raise TokenMismatch(
            f"token {pos} of the dump is {got[pos]}, the sample sent {sent[pos]}: these hidden "
            "states belong to other input ids",
            sample_id=sample_id,
            rid=rid,
        )
