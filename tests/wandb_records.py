"""The records of a Weights & Biases run file (``run-<id>.wandb``, as ``WANDB_MODE=offline`` writes it
and ``wandb sync`` uploads it), read back for the tests: W&B ships no reader of its own."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024  # the file is a LevelDB-style log of 32 KiB blocks
HEADER = 7  # ":W&B", a 2-byte magic number, a version byte
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4  # a record in one chunk, or its first / middle / last chunk


def records(path: str | Path):
    """Each protobuf ``Record`` of the file, in order. A chunk is a 4-byte checksum, a 2-byte length
    and a 1-byte type, then its bytes; a record spans blocks in several chunks, and a block's tail too
    short for a chunk header is padding."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, pending = HEADER, b""
    while pos + 7 <= len(data):
        room = BLOCK - pos % BLOCK
        if room < 7:
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0:  # padding
            continue
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def _items(items) -> dict:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def read_run(path: str | Path) -> dict:
    """One run file as {"id", "history": [row, ...], "summary": {...}, "config": {...}, "exit_code",
    "preempting"}: the rows as logged (W&B's ``_step`` among their keys), the last summary update of
    each key, the config's top-level entries."""
    run = {"id": None, "history": [], "summary": {}, "config": {}, "exit_code": None, "preempting": False}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["id"] = record.run.run_id
        elif kind == "history":
            run["history"].append(_items(record.history.item))
        elif kind == "summary":
            run["summary"].update(_items(record.summary.update))
        elif kind == "config":
            run["config"].update(_items(record.config.update))
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
        elif kind == "preempting":
            run["preempting"] = True
    return run
