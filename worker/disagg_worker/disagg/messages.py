"""Control-plane messages between decode and prefill ranks, and their one codec (JSON).

Decode -> prefill: `DecodeHello` once per (decode rank, prefill rank) connection, carrying
the decode KV buffer addresses, head geometry and transfer session; then per room `RoomRequest`
(destination pages, aux slot, and which of the prefill rank's KV heads go where) and possibly
`RoomAbort`. Prefill -> decode: `RoomUpdate` (Transferring, Success or Failed; `quiesced` says no
write of that room is still in flight). The aux record travels inside the Success update, so it
can never be seen before the pages it describes.
"""

from __future__ import annotations

import base64
import json
import typing
from dataclasses import dataclass, fields


class CodecError(ValueError):
    """A frame that is not a well-formed message of a known type."""


@dataclass(frozen=True)
class DecodeHello:
    decode_id: str
    reply_endpoint: str
    session_id: str
    buffer_ptrs: list[int]
    buffer_nbytes: list[int]
    page_nbytes: int
    start_layer: int
    aux_item_nbytes: int
    staging_ptr: int = 0  # decode's registered staging area (mooncake.staging), 0: none
    staging_nbytes: int = 0
    # Decode's pages hold `num_kv_heads` heads of `head_nbytes` bytes per token; 0: not stated,
    # only whole pages may be written.
    num_kv_heads: int = 0
    head_nbytes: int = 0
    kv_kind: str = "mha"  # decode's pool layout (`mem.kv_pool.KVKind`): its buffers per layer
    draft_kv: str = ""  # decode's draft KV after the model's layers (`KVLayout.draft_kv`)


@dataclass(frozen=True)
class RoomRequest:
    decode_id: str
    reply_endpoint: str
    room: int
    dest_pages: list[int]
    aux_slot: int
    staging_offset: int = -1  # write this room's pages staged at this offset of decode's staging area; -1: in place
    # The KV heads wanted (`mapping.HeadSlice`): `num_heads` heads from head `src_head` of the
    # prefill rank's pages to head `dst_head` of decode's. -1: whole pages; 0: nothing to write.
    src_head: int = 0
    dst_head: int = 0
    num_heads: int = -1
    # Decode ranks that send this prefill rank a request for the room; it starts once all have.
    decode_ranks: int = 1
    # The room's first pages that decode already holds (its prefix cache): prefill sends only the pages after
    # them, `dest_pages[i]` receiving prefill's page `skip_pages + i`.
    skip_pages: int = 0


@dataclass(frozen=True)
class RoomAbort:
    decode_id: str
    room: int
    reason: str


@dataclass(frozen=True)
class RoomUpdate:
    room: int
    tp_rank: int
    pp_rank: int
    status: int  # a KVPoll value
    reason: str
    quiesced: bool
    aux: bytes  # the request's aux record, with Success only (written into the decode aux slot)


Message = DecodeHello | RoomRequest | RoomAbort | RoomUpdate
_TYPES: dict[str, type] = {t.__name__: t for t in (DecodeHello, RoomRequest, RoomAbort, RoomUpdate)}
# Field name -> type of every message, resolved once: these frames are on every request's path.
_HINTS: dict[type, dict[str, object]] = {t: typing.get_type_hints(t) for t in _TYPES.values()}


def encode(msg: Message) -> bytes:
    body = {"type": type(msg).__name__}
    for f in fields(msg):  # shallow: the fields are scalars, bytes and lists of ints
        v = getattr(msg, f.name)
        body[f.name] = base64.b64encode(v).decode() if isinstance(v, bytes) else v
    return json.dumps(body, separators=(",", ":")).encode()


def decode(frame: bytes) -> Message:
    """Parse one frame; raises CodecError for anything but a valid message."""
    try:
        obj = json.loads(frame)
    except (ValueError, UnicodeDecodeError) as e:
        raise CodecError(f"not JSON: {e}") from None
    if not isinstance(obj, dict) or obj.get("type") not in _TYPES:
        raise CodecError("missing or unknown message type")
    cls = _TYPES[obj.pop("type")]
    hints = _HINTS[cls]
    if obj.keys() != hints.keys():
        raise CodecError(f"{cls.__name__}: fields {sorted(obj)} != {sorted(hints)}")
    for name, value in obj.items():
        if hints[name] is bytes and isinstance(value, str):
            try:
                obj[name] = value = base64.b64decode(value, validate=True)
            except ValueError:
                raise CodecError(f"{cls.__name__}.{name}: not base64") from None
        if not _matches(value, hints[name]):
            raise CodecError(f"{cls.__name__}.{name}: wrong type {type(value).__name__}")
    return cls(**obj)


def _matches(value: object, hint: object) -> bool:
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint is bytes:
        return isinstance(value, bytes)
    if hint == list[int]:  # the only list type in the messages; `type(v) is int` refuses bools
        return isinstance(value, list) and all(type(v) is int for v in value)
    return False
