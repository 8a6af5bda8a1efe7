"""Read a W&B offline run file (``run-ID.wandb``) back, without wandb's service or a network.

The file is wandb's transaction log: a 7-byte header (``:W&B``, magic, version) and then
LevelDB-log records (32 KiB blocks; each chunk a 7-byte header of CRC, length and type, a record
possibly split FIRST/MIDDLE/LAST across blocks), each record one ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    out: list[bytes] = []
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:  # a block's tail too short for a header is padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            out.append(pending + chunk)
            pending = b""
        else:  # zeroed preallocated space: the end of what was written
            break
    return out


@dataclass
class OfflineRun:
    name: str = ""
    group: str = ""
    config: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)  # one dict per logged row


def read_offline_run(path: Path) -> OfflineRun:
    from wandb.proto import wandb_internal_pb2 as pb

    run = OfflineRun()
    for data in records(path):
        rec = pb.Record()
        rec.ParseFromString(data)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run.name, run.group = rec.run.display_name, rec.run.run_group
            run.config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "history":
            run.history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                for i in rec.history.item})
    return run


def offline_runs(directory: Path) -> list[OfflineRun]:
    """Every offline run under ``directory`` (``.../wandb/offline-run-*/run-*.wandb``)."""
    return [read_offline_run(p) for p in sorted(directory.glob("**/offline-run-*/run-*.wandb"))]
