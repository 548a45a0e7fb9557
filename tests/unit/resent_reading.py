"""What a codec reads from a body with the memo of resent bodies and without it: the
property the resent tests check for every format that reuses an earlier body's messages."""

from __future__ import annotations

import json

from prefixpin.core.errors import BadRequestError
from prefixpin.proxy.codecs.base import Codec
from prefixpin.proxy.pipeline.body_memo import BodyMemo
from prefixpin.proxy.pipeline.validation import ClientRequest

Refusal = tuple[str, str, str | None]  # the error's class, message and field


def read(codec: Codec, raw: bytes, path: str, max_messages: int,
         memo: BodyMemo | None) -> ClientRequest | Refusal:
    """The request read, or the refusal's class, message and field."""
    try:
        return codec.parse(raw, path, max_messages=max_messages, memo=memo)
    except BadRequestError as exc:
        return type(exc).__name__, exc.message, exc.param


def read_as_whole(codec: Codec, raw: bytes, path: str, max_messages: int,
                  memo: BodyMemo) -> ClientRequest | None:
    """``raw`` read with ``memo``, checked to be what the whole parse reads: the same
    request (its body's key order too) or the same refusal. The request; None: refused."""
    whole, mine = read(codec, raw, path, max_messages, None), read(codec, raw, path,
                                                                   max_messages, memo)
    assert mine == whole
    if not isinstance(mine, ClientRequest):
        return None
    assert isinstance(whole, ClientRequest)
    assert json.dumps(mine.body) == json.dumps(whole.body)
    return mine
