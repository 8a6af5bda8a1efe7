"""Framed messages between a pipeline trainer and its stage peers, over plain TCP.

A message is one request or reply: an operation, a small JSON header, and named tensors.
Floating point tensors travel through a codec (``fp32`` by default; ``int8``/``int4``/``topk``
compress activations and their gradients), integer tensors (token ids, targets) as raw int64
or int32 (received as int64).
Layout, little-endian::

    u32 frame length | u32 header length | JSON header | tensor payloads

where the header lists each tensor's name, shape, dtype, codec spec and payload length. The byte
count a sender reports is ``len(frame)``: exactly what went on the wire, header included. A
sender on an emulated link (:class:`~farlink.comm.base.LinkModel`) is held for the frame's
latency + bytes / bandwidth before it writes, as in-process emulation does elsewhere.
"""

from __future__ import annotations

import functools
import json
import socket
import struct
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from farlink.codecs import Codec, CodecError, make_codec
from farlink.comm.base import LinkModel
from farlink.comm.sockets import recv_exact
from farlink.emulate.shaper import ShapedLink

_MAX_FRAME = 1 << 31
_INT_DTYPES = {"int64": (torch.int64, np.int64), "int32": (torch.int32, np.int32)}


@dataclass
class Message:
    op: str
    meta: dict = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    nbytes: int = 0  # frame length as received (0 for one built locally)


@functools.lru_cache(maxsize=64)
def codec_for(spec: str) -> Codec:
    return make_codec(spec)


def encode(message: Message, codecs: dict[str, str] | None = None) -> bytes:
    """The frame of ``message``; ``codecs`` maps tensor names to codec specs (default fp32)."""
    entries, blobs = [], []
    for name, tensor in message.tensors.items():
        if tensor.is_floating_point():
            spec = codec_for((codecs or {}).get(name, "fp32")).name
            blob = codec_for(spec).encode(tensor.detach())
            dtype = "float32"
        elif tensor.dtype in (torch.int64, torch.int32):
            spec, dtype = "raw", str(tensor.dtype).removeprefix("torch.")
            blob = tensor.detach().cpu().contiguous().numpy().tobytes()
        else:
            raise ValueError(f"tensor {name!r}: send float, int64 or int32 tensors, "
                             f"got {tensor.dtype}")
        entries.append({"name": name, "shape": list(tensor.shape), "dtype": dtype,
                        "codec": spec, "nbytes": len(blob)})
        blobs.append(blob)
    header = json.dumps({"op": message.op, "meta": message.meta, "tensors": entries},
                        separators=(",", ":")).encode()
    body = struct.pack("<I", len(header)) + header + b"".join(blobs)
    return struct.pack("<I", len(body)) + body


def decode(body: bytes) -> Message:
    """A message from a frame's body (after its length prefix); corrupt frames raise."""
    try:
        (hlen,) = struct.unpack_from("<I", body, 0)
        header = json.loads(body[4:4 + hlen])
        offset = 4 + hlen
        tensors: dict[str, torch.Tensor] = {}
        for e in header["tensors"]:
            blob = body[offset:offset + e["nbytes"]]
            if len(blob) != e["nbytes"]:
                raise CodecError(f"truncated payload for {e['name']!r}")
            offset += e["nbytes"]
            shape = tuple(e["shape"])
            if e["dtype"] in _INT_DTYPES:
                array = np.frombuffer(blob, dtype=_INT_DTYPES[e["dtype"]][1]).copy()
                tensors[e["name"]] = torch.from_numpy(array).reshape(shape).long()
            else:
                tensors[e["name"]] = codec_for(e["codec"]).decode(blob, torch.Size(shape),
                                                                  torch.float32)
        if offset != len(body):
            raise CodecError(f"{len(body) - offset} trailing bytes after payloads")
        return Message(header["op"], header["meta"], tensors, nbytes=4 + len(body))
    except (KeyError, TypeError, ValueError, struct.error) as exc:
        raise CodecError(f"corrupt pipeline frame: {str(exc)[:120]}") from exc


def send(sock: socket.socket, message: Message, codecs: dict[str, str] | None = None,
         link: LinkModel | ShapedLink | None = None) -> int:
    """Write one message; returns the bytes sent (after holding for the emulated link: a
    :class:`LinkModel` holds every message on its own, a :class:`ShapedLink` queues messages
    that share it on one wire, as concurrent micro-batches on one real link do)."""
    frame = encode(message, codecs)
    if isinstance(link, ShapedLink):
        link.send(len(frame))
    elif link is not None:
        time.sleep(link.seconds(len(frame), 1))
    sock.sendall(frame)
    return len(frame)


def recv(sock: socket.socket) -> Message:
    """Read one message; ConnectionError when the peer is gone."""
    (length,) = struct.unpack("<I", recv_exact(sock, 4))
    if length > _MAX_FRAME:
        raise CodecError(f"frame of {length} bytes announced (limit {_MAX_FRAME})")
    return decode(recv_exact(sock, length))
