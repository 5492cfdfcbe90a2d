"""Reading and validating a JSONL dataset of samples.

Each line is a JSON object ``{"id": ..., "input_ids": [...], "loss_mask": [...]}``; with a local
tokenizer, ``"text"`` or chat ``"messages"`` may stand in for ``input_ids``. A ``messages`` line
gets an assistant-only loss mask from the chat template (`hsdump._run.chat`); a ``text`` line is
plain text and is stored without a mask, which reads back as all ones. A bad line never stops
the others: it becomes a `BadLine` naming the line number and the reason, and the caller
decides what to do with it (the CLI reports it and records it in the failures file).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsdump._client.limits import InputLimits, local_model_config
from hsdump._exceptions import ConfigError, HsdumpError, InputError
from hsdump._run.chat import tokenize_chat
from hsdump._types import Sample

__all__ = [
    "BadLine",
    "Dataset",
    "InputLimits",
    "Shard",
    "input_limits",
    "load_tokenizer",
    "local_model_config",
    "read_dataset",
]

logger = logging.getLogger(__name__)

# What ``errors="surrogateescape"`` turns each byte that is not UTF-8 into.
_UNDECODABLE = re.compile("[\udc80-\udcff]")


@dataclass(frozen=True)
class BadLine:
    """A dataset line that cannot be extracted.

    Attributes:
        line: The 1-based line number.
        error: The error, whose message names the file, the line and the reason.
        sample_id: The line's sample id, when it could be read.
    """

    line: int
    error: InputError
    sample_id: str | None = None


@dataclass
class Dataset:
    """The valid samples of a dataset file and its bad lines.

    Attributes:
        samples: Valid samples, in file order.
        bad_lines: Lines that were rejected.
        line_numbers: The line number of each valid sample's id.
    """

    samples: list[Sample] = field(default_factory=list)
    bad_lines: list[BadLine] = field(default_factory=list)
    line_numbers: dict[str, int] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Tokens over all valid samples."""
        return sum(len(s.input_ids) for s in self.samples)


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """Load a tokenizer from a local directory (never from the network).

    Raises:
        ConfigError: The directory holds no loadable tokenizer.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(os.fspath(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot load a tokenizer from {os.fspath(path)!r}: {exc}. "
            "Pass a local directory holding tokenizer files (tokenizer.json, tokenizer_config.json)"
        ) from exc


def read_dataset(
    path: str | os.PathLike[str],
    *,
    limits: InputLimits | None = None,
    tokenizer: Any = None,
) -> Dataset:
    """Read and validate a JSONL dataset.

    Args:
        path: The JSONL file.
        limits: The server's vocabulary size and context length, checked for every sample.
        tokenizer: A loaded tokenizer for ``text`` and ``messages`` lines.

    Raises:
        InputError: The file cannot be read at all (bad lines are reported in the result instead).
    """
    path = Path(path)
    dataset = Dataset()
    parser = _LineParser(path, limits or InputLimits(), tokenizer)
    for number, text in _lines(path):
        try:
            sample = parser.parse(number, text)
        except InputError as exc:
            dataset.bad_lines.append(BadLine(number, exc, exc.sample_id))
            continue
        if sample.id in dataset.line_numbers:
            first = dataset.line_numbers[sample.id]
            error = parser.error(number, f"duplicate id {sample.id!r} (first on line {first})")
            dataset.bad_lines.append(BadLine(number, error, sample.id))
            continue
        dataset.line_numbers[sample.id] = number
        dataset.samples.append(sample)
    return dataset


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    try:
        # Undecodable bytes become lone surrogates, so one bad byte rejects its line, not the file.
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            for number, text in enumerate(f, start=1):
                if text.strip():
                    yield number, text
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read the dataset {path}: {exc}") from exc


class _LineParser:
    def __init__(self, path: Path, limits: InputLimits, tokenizer: Any):
        self.path = path
        self.limits = limits
        self.tokenizer = tokenizer

    def error(self, number: int, reason: str, sample_id: str | None = None) -> InputError:
        return InputError(f"{self.path}:{number}: {reason}", sample_id=sample_id)

    def parse(self, number: int, text: str) -> Sample:
        undecodable = _UNDECODABLE.search(text)
        if undecodable:
            byte = ord(undecodable.group()) - 0xDC00
            raise self.error(
                number,
                f"not valid UTF-8 (byte 0x{byte:02x} at column {undecodable.start() + 1}): "
                "save the dataset as UTF-8",
            )
        try:
            # Without its newline, a line cut short fails at its end, not at column 1 of the next.
            record = json.loads(text.rstrip("\r\n"))
        except json.JSONDecodeError as exc:
            raise self.error(number, f"not valid JSON ({exc.msg} at column {exc.pos + 1})") from exc
        except RecursionError:
            raise self.error(
                number, "JSON nested too deeply to read (over a thousand levels of [ or {)"
            ) from None
        if not isinstance(record, dict):
            raise self.error(number, f"expected a JSON object, found {type(record).__name__}")
        sample_id = self._id(number, record)
        try:
            sample = Sample(sample_id, *self._tokens(record))
            self.limits.check(sample.input_ids)
        except (InputError, ValueError, TypeError) as exc:
            reason = exc.message if isinstance(exc, HsdumpError) else str(exc)
            raise self.error(number, reason, sample_id) from exc
        return sample

    def _id(self, number: int, record: dict[str, Any]) -> str:
        value = record.get("id")
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        if not isinstance(value, str) or not value:
            raise self.error(number, 'no "id": every line needs a unique non-empty string "id"')
        return value

    def _tokens(self, record: dict[str, Any]) -> tuple[list[int], Any]:
        """The line's token ids and loss mask (None: every token is trained on)."""
        if "input_ids" in record:
            ids = record["input_ids"]
            if not isinstance(ids, list) or not ids:
                raise InputError('"input_ids" must be a non-empty list of token ids')
            return ids, record.get("loss_mask")  # Sample checks the values
        if "text" not in record and "messages" not in record:
            raise InputError('no "input_ids" (nor "text" or "messages" with a tokenizer)')
        if self.tokenizer is None:
            raise InputError('has "text"/"messages" but no tokenizer: pass --tokenizer DIR')
        if "text" in record:
            ids = self.tokenizer(record["text"], add_special_tokens=True)["input_ids"]
            return list(ids), record.get("loss_mask")
        if "loss_mask" in record:
            raise InputError(
                'has "messages" and "loss_mask": a chat\'s mask comes from its template (1 on the '
                'assistant\'s tokens); drop "loss_mask", or give "input_ids" with it'
            )
        return tokenize_chat(self.tokenizer, record["messages"])


@dataclass(frozen=True)
class Shard:
    """Part ``index`` of ``count`` of a dataset, chosen by a hash of each sample id (never by
    position), so a sample belongs to the same shard whatever the file order, and a rerun with the
    same ``count`` sees the same samples.

    Attributes:
        index: This shard, from 0.
        count: How many shards the dataset is split into.
    """

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        """``"I/N"`` (e.g. ``"0/3"``); raises `ConfigError` for anything else."""
        try:
            index, count = (int(part) for part in text.split("/"))
        except ValueError:
            raise ConfigError(f"--shard takes I/N, e.g. 0/3, got {text!r}") from None
        if count < 1 or not 0 <= index < count:
            raise ConfigError(f"--shard {text}: need 0 <= I < N")
        return cls(index, count)

    def holds(self, sample_id: str | None) -> bool:
        """Whether the sample belongs here (a line without an id is reported by shard 0 only)."""
        if sample_id is None:
            return self.index == 0
        digest = hashlib.blake2b(sample_id.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") % self.count == self.index

    def select(self, dataset: Dataset) -> Dataset:
        """The samples and bad lines of ``dataset`` that belong to this shard."""
        samples = [s for s in dataset.samples if self.holds(s.id)]
        return Dataset(
            samples=samples,
            bad_lines=[b for b in dataset.bad_lines if self.holds(b.sample_id)],
            line_numbers={s.id: dataset.line_numbers[s.id] for s in samples},
        )

    @property
    def writer_id(self) -> str:
        """The store part this shard writes when no writer id is given."""
        return f"shard{self.index}of{self.count}"


def input_limits(url: str) -> InputLimits:
    """The input limits the server at ``url`` reports (none are checked if it cannot say)."""
    import httpx

    try:
        response = httpx.get(f"{url.rstrip('/')}/server_info", timeout=30.0)
        response.raise_for_status()
        info = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        logger.warning("cannot read %s/server_info (%s): dataset lines are checked later", url, exc)
        return InputLimits()
    return InputLimits.from_server_info(info if isinstance(info, dict) else {})
