"""What each drafter trainer reads, and the conventions that separate it from the store.

- Layer ids: hsdump records transformers' ``hidden_states[i]`` (the input of decoder layer ``i``).
  vLLM, so speculators, counts the same way; SGLang's API ids, so SpecForge's, are one less.
- The last slice: SpecForge wants the final state after the model's last norm (it applies only
  ``lm_head``); speculators wants the last layer's output before it (it applies the verifier's
  norm itself). The norm cannot be undone, nor applied without the model, so a store holding the
  other one is refused.

The layouts follow the trainers' sources (SpecForge 0.2.0 at a6b6b02, speculators at c05b95b);
each class names the files it follows.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, BinaryIO, cast

from hsdump._exceptions import ExportError
from hsdump._protocol import FinalNorm
from hsdump._store.durable import PARTIAL_SUFFIX, write_file_atomic

if TYPE_CHECKING:
    import torch

    from hsdump._store.provenance import Provenance
    from hsdump._store.store import HiddenStateStore
    from hsdump._types import HiddenStates

__all__ = ["TARGETS", "FinalNorm", "Target", "resolve_final_norm"]

_SPECFORGE_GROUP = 2000  # files per rows_* folder, as prepare_hidden_states.py groups them
_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def resolve_final_norm(prov: Provenance, given: FinalNorm | None, where: str) -> FinalNorm:
    """The store's ``final_norm``, or the caller's word for a store that does not record it."""
    recorded = prov.final_norm
    if recorded is None and given is None:
        raise ExportError(
            f"the store at {where} does not record whether its final state is post-norm (after "
            "the model's last norm, transformers' hidden_states[-1]) or pre-norm (its samples "
            "were written without server metadata), and the trainers differ on it: pass "
            "final_norm='post_norm' or 'pre_norm' (--final-norm) to say which it holds"
        )
    if recorded is not None and given is not None and recorded != given:
        raise ExportError(
            f"final_norm={given!r} was given, but the store at {where} records {recorded!r}: "
            "drop the option, the store's record is used"
        )
    norm = recorded or given
    if norm == "post_norm":
        return "post_norm"
    if norm == "pre_norm":
        return "pre_norm"
    raise ExportError(f"the store at {where} records final_norm={norm!r}, an unknown value")


class Target:
    """One trainer's layout: what it accepts, where each sample's file goes, how it is written."""

    def check(self, prov: Provenance, norm: FinalNorm, where: str) -> list[int]:
        """Refuse states the trainer cannot use; return the aux layer ids in its convention."""
        raise NotImplementedError

    def prepare(self, prov: Provenance, where: str) -> None:
        """Refuse an export that cannot be written (a missing dependency, a dtype)."""

    def path(self, out: Path, idx: int) -> Path:
        """The file of the sample at export index ``idx``."""
        raise NotImplementedError

    def write(self, hs: HiddenStates, dest: Path) -> None:
        """Write one sample's file so that it appears whole or not at all."""
        raise NotImplementedError

    def finish(self, path: Any, store: HiddenStateStore, out: Path, ids: list[str]) -> None:
        """Write what the trainer reads besides the sample files."""


class SpecForge(Target):
    """SpecForge's offline EAGLE-3 data, as ``scripts/prepare_hidden_states.py`` writes it;
    ``specforge/data/preprocessing.py`` (``list_local_files``, ``OfflineEagle3Dataset``) and
    ``specforge/runtime/data_plane/offline_reader.py`` read it. SpecForge derives its vocabulary
    mapping from these files itself."""

    def check(self, prov: Provenance, norm: FinalNorm, where: str) -> list[int]:
        if norm != "post_norm":
            raise ExportError(
                "SpecForge applies only lm_head to 'hidden_state', so it needs the final state "
                f"after the model's last norm (post-norm); the store at {where} holds it before "
                "the norm (pre-norm), and hsdump cannot apply the model's norm: give this store to "
                "speculators (--format speculators, or SpeculatorsCollate), or extract again with "
                "the post-norm final state (the producers' default: HSDUMP_FINAL_NORM=post_norm "
                "on SGLang)"
            )
        if len(prov.layer_ids) != 3:
            raise ExportError(
                "SpecForge's EAGLE-3 reads three aux layers concatenated ('aux_hidden_state' "
                f"[1, T, 3H]); the store at {where} holds {len(prov.layer_ids)} "
                f"(layer_ids {prov.layer_ids}): extract with three aux layers"
            )
        if min(prov.layer_ids) < 1:
            raise ExportError(
                f"layer id 0 (the embeddings) in the store at {where} has no SGLang API id "
                "(SGLang's ids are transformers' minus one): extract aux layers >= 1"
            )
        return [i - 1 for i in prov.layer_ids]

    def path(self, out: Path, idx: int) -> Path:
        group = idx // _SPECFORGE_GROUP * _SPECFORGE_GROUP
        return out / f"rows_{group}-{group + _SPECFORGE_GROUP}" / f"data_{idx}.ckpt"

    def write(self, hs: HiddenStates, dest: Path) -> None:
        import torch

        record = {
            "input_ids": hs.input_ids.to(torch.int64),
            "loss_mask": _mask(hs).to(torch.int64),
            # Own storage for each: torch.save writes the whole storage of a view.
            "hidden_state": _own(hs.final_hidden_state).unsqueeze(0),
            "aux_hidden_state": _own(hs.aux_hidden_states).reshape(1, hs.num_tokens, -1),
        }
        with _atomic_file(dest) as f:
            torch.save(record, cast("IO[bytes]", f))  # it only calls write() and flush()


class Speculators(Target):
    """vllm-project/speculators' data: ``hs_connectors/src/hs_connectors/transfer.py``
    (``FileTransfer``) reads the files, ``src/speculators/train/data.py`` (``ArrowDataset``)
    matches them by index to the dataset rows that ``scripts/prepare_data.py`` saves."""

    def check(self, prov: Provenance, norm: FinalNorm, where: str) -> list[int]:
        if norm != "pre_norm":
            raise ExportError(
                "speculators applies the verifier's norm to the last slice of 'hidden_states' "
                "(verifier_norm), so it needs the last layer's output before the norm (vLLM's "
                f"layer num_hidden_layers, pre-norm); the store at {where} holds the final state "
                "after the norm (post-norm, transformers' hidden_states[-1]), and the norm cannot "
                "be undone: extract again with the pre-norm final state (start SGLang with "
                "HSDUMP_FINAL_NORM=pre_norm, or hsdump serve-reference with --final-norm "
                "pre_norm), or give this store to SpecForge (--format specforge, or "
                "SpecForgeCollate)"
            )
        return list(prov.layer_ids)

    def prepare(self, prov: Provenance, where: str) -> None:
        if prov.dtype not in _SAFETENSORS_DTYPES:
            raise ExportError(f"the store at {where} holds {prov.dtype}, which safetensors lacks")
        try:
            import datasets  # noqa: F401
        except ImportError as exc:
            raise ExportError(
                "the speculators export writes its dataset rows with Hugging Face datasets, "
                "which is not installed: pip install 'hsdump[export]'"
            ) from exc

    def path(self, out: Path, idx: int) -> Path:
        return out / "hidden_states" / f"hs_{idx}.safetensors"

    def write(self, hs: HiddenStates, dest: Path) -> None:
        write_file_atomic(dest, _safetensors_pieces(hs))

    def finish(self, path: Any, store: HiddenStateStore, out: Path, ids: list[str]) -> None:
        from hsdump._training.rows import write_rows

        write_rows(path, store, out, ids)


TARGETS: dict[str, type[Target]] = {"specforge": SpecForge, "speculators": Speculators}


def _safetensors_pieces(hs: HiddenStates) -> list[bytes | memoryview]:
    """A safetensors file of ``token_ids [T]`` (int64) and ``hidden_states [T, K+1, H]``, the
    aux layers then the last, written from the decoded rows without another copy."""
    import torch

    aux, final = hs.aux_hidden_states, hs.final_hidden_state
    t, k, h = aux.shape
    row = (k + 1) * h
    # The store decodes a sample as one [T, K+1, H] array, aux and final being views of it.
    adjacent = (
        aux.stride() == (row, h, 1)
        and final.stride() == (row, 1)
        and final.untyped_storage().data_ptr() == aux.untyped_storage().data_ptr()
        and final.data_ptr() == aux.data_ptr() + k * h * aux.element_size()
    )
    whole = (
        aux.as_strided((t, k + 1, h), (row, h, 1))
        if adjacent
        else torch.cat([aux, final.unsqueeze(1)], dim=1)
    )
    tokens = hs.input_ids.to(torch.int64).contiguous()
    dtype = _SAFETENSORS_DTYPES[str(whole.dtype).removeprefix("torch.")]
    n_tok, n_hid = tokens.nbytes, whole.nbytes
    header = {
        "token_ids": {"dtype": "I64", "shape": [t], "data_offsets": [0, n_tok]},
        "hidden_states": {
            "dtype": dtype,
            "shape": [t, k + 1, h],
            "data_offsets": [n_tok, n_tok + n_hid],
        },
    }
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header to 8 bytes
    return [struct.pack("<Q", len(encoded)), encoded, _bytes_of(tokens), _bytes_of(whole)]


def _bytes_of(t: torch.Tensor) -> memoryview:
    import torch

    flat = t.contiguous().view(-1)
    as_int = flat.view(torch.uint8) if flat.element_size() > 1 else flat
    return as_int.numpy().data


def _mask(hs: HiddenStates) -> torch.Tensor:
    import torch

    if hs.loss_mask is not None:
        return hs.loss_mask
    return torch.ones(hs.num_tokens, dtype=torch.uint8)


def _own(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.clone(memory_format=torch.contiguous_format)


class _RecordingFile:
    """A file that remembers the OSError of a failed write: torch.save reports one as a
    RuntimeError from its zip writer, which would hide a full disk."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self._f.flush()


@contextlib.contextmanager
def _atomic_file(dest: Path) -> Iterator[_RecordingFile]:
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}{PARTIAL_SUFFIX}")
    try:
        with open(tmp, "wb") as raw:
            f = _RecordingFile(raw)
            try:
                yield f
            except RuntimeError:
                if f.error is not None:
                    raise f.error from None
                raise
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
