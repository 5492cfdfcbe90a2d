"""Replay a crashfs operation log into the tree a power loss after any prefix of it may leave.

A crash keeps what was made durable and nothing more (the LazyFS view of a disk):

- a file's content is durable only at an ``fsync`` or ``fdatasync`` of that file, and what is
  durable is its whole content at that moment; later writes, truncations and ``sync_file_range``
  (which never reaches the file system) make nothing durable;
- a directory entry (a creation, a rename's new and old names, a link, an unlink) is durable only
  at an ``fsync`` of its directory, which makes all of that directory's entries durable as they
  are at that moment;
- so a file whose entry is durable but whose content was never synced is empty, a file renamed
  without an fsync of its new directory is where it was, and a new directory whose parent was
  not synced is gone with everything under it;
- the tree at mount time is durable.

A disk may also keep more than that. ``names="made"`` builds the other extreme, the one ext4's
delayed allocation is known for: every name as it was made (a journal committed ahead of the data),
each file's content still only what was last synced, so a file renamed into place unsynced is
empty.

`Replay.apply` runs one operation on a model of the volatile tree and of what is durable;
`Replay.materialise` writes a tree as real files. `read_log` parses crashfs's log.
"""

from __future__ import annotations

import base64
import json
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Names = Literal["synced", "made"]
Data = Literal["synced", "made"]


@dataclass(frozen=True)
class Op:
    """One logged operation: its position in the log, its name, and its fields."""

    index: int
    op: str
    fields: dict[str, Any]

    def describe(self) -> str:
        """The operation as a short line for messages."""
        shown = {k: v for k, v in self.fields.items() if k != "data"}
        if "data" in self.fields:
            shown["bytes"] = len(base64.b64decode(self.fields["data"]))
        return f"#{self.index} {self.op} {shown}"


def read_log(path: Path) -> list[Op]:
    """The operations of a crashfs log, in order, without the closing ``unmounted`` record.

    Raises:
        ValueError: The log does not end with ``unmounted`` (the file system did not exit
            cleanly, so the log may lack its tail).
    """
    records = [json.loads(line) for line in path.read_text().splitlines()]
    if not records or records[-1]["op"] != "unmounted":
        raise ValueError(f"{path} does not end with an 'unmounted' record: the log is incomplete")
    return [Op(i, rec.pop("op"), rec) for i, rec in enumerate(records[:-1])]


@dataclass
class _Node:
    kind: str  # "file" or "dir"
    data: bytearray = field(default_factory=bytearray)
    entries: dict[str, int] = field(default_factory=dict)
    durable_data: bytes | None = None  # None: never synced, empty after a crash
    durable_entries: dict[str, int] = field(default_factory=dict)


class Replay:
    """The volatile tree and the durable tree after the operations applied so far."""

    def __init__(self) -> None:
        self._nodes: dict[int, _Node] = {}
        self.markers: list[Op] = []

    def apply(self, op: Op) -> None:
        """Run one operation on the model.

        Raises:
            ValueError: An operation the model does not know.
        """
        if op.op == "marker":
            self.markers.append(op)
            return
        handler = getattr(self, f"_op_{op.op}", None)
        if handler is None:
            raise ValueError(f"the replay does not model {op.describe()}")
        handler(**op.fields)

    # -- operations ------------------------------------------------------------------------------

    def _op_base(self, path: str, node: int, kind: str, data: str = "") -> None:
        content = base64.b64decode(data)
        self._nodes[node] = _Node(kind, bytearray(content), durable_data=content)
        if path != "/":
            parent, name = self._parent(path)
            parent.entries[name] = parent.durable_entries[name] = node

    def _op_create(self, path: str, node: int) -> None:
        self._add(path, node, _Node("file"))

    def _op_mkdir(self, path: str, node: int) -> None:
        self._add(path, node, _Node("dir"))

    def _op_write(self, node: int, offset: int, data: str) -> None:
        content, chunk = self._nodes[node].data, base64.b64decode(data)
        if len(content) < offset:
            content.extend(bytes(offset - len(content)))
        content[offset : offset + len(chunk)] = chunk

    def _op_truncate(self, node: int, length: int) -> None:
        content = self._nodes[node].data
        del content[length:]
        content.extend(bytes(length - len(content)))

    def _op_fsync(self, node: int, datasync: bool) -> None:
        target = self._nodes[node]
        target.durable_data = bytes(target.data)

    def _op_fsyncdir(self, node: int, path: str) -> None:
        target = self._nodes[node]
        target.durable_entries = dict(target.entries)

    def _op_unlink(self, path: str) -> None:
        parent, name = self._parent(path)
        del parent.entries[name]

    _op_rmdir = _op_unlink

    def _op_rename(self, old: str, new: str) -> None:
        source, old_name = self._parent(old)
        target, new_name = self._parent(new)
        target.entries[new_name] = source.entries.pop(old_name)

    def _op_link(self, existing: str, new: str) -> None:
        source, name = self._parent(existing)
        target, new_name = self._parent(new)
        target.entries[new_name] = source.entries[name]

    def _add(self, path: str, node: int, created: _Node) -> None:
        parent, name = self._parent(path)
        self._nodes[node] = created
        parent.entries[name] = node

    def _parent(self, path: str) -> tuple[_Node, str]:
        head, name = posixpath.split(path)
        node = self._nodes[0]
        for part in filter(None, head.split("/")):
            node = self._nodes[node.entries[part]]
        return node, name

    # -- the trees -------------------------------------------------------------------------------

    def materialise(self, dest: Path, *, names: Names = "synced", data: Data = "synced") -> None:
        """Write a tree into ``dest``: by default the one a crash now leaves.

        Args:
            dest: The directory to write it in (made if missing).
            names: ``"synced"``: the directory entries of each directory's last fsync;
                ``"made"``: the entries as they are now.
            data: ``"synced"``: each file's content at its last fsync (empty if none);
                ``"made"``: its content now.
        """
        dest.mkdir(parents=True, exist_ok=True)
        for rel, node in self._walk(0, "", names == "synced", frozenset()):
            out = dest / rel
            if node.kind == "dir":
                out.mkdir(exist_ok=True)
            else:
                content = (node.durable_data or b"") if data == "synced" else bytes(node.data)
                out.write_bytes(content)

    def _walk(
        self, node_id: int, rel: str, synced: bool, above: frozenset[int]
    ) -> Iterator[tuple[str, _Node]]:
        node = self._nodes[node_id]
        entries = node.durable_entries if synced else node.entries
        for name, child in sorted(entries.items()):
            if child in above or child == node_id:  # a directory moved below itself over syncs
                continue
            path = posixpath.join(rel, name)
            yield path, self._nodes[child]
            if self._nodes[child].kind == "dir":
                yield from self._walk(child, path, synced, above | {node_id})
