"""What a JSON document would cost to parse, read from its bytes before it is parsed.

json.loads builds every value of a document at once, holding the GIL throughout, so a body of
16 MiB shaped `[],[],...` costs seconds and hundreds of megabytes before any check on the result
can run (a thread does not help: the event loop waits for the GIL). `check_shape` bounds the
values and the nesting first, with a handful of whole-buffer byte operations (C loops, each a few
milliseconds per megabyte, the GIL released between them): it never makes a Python object per
value, and its copies are each at most the body's size.

The reading is exact for UTF-8 JSON, where a `"` or `\\` byte is never part of another
character: outside strings there are no backslashes, inside them `\\\\` and `\\"` are the only
escapes that involve those bytes, so once both are removed (`\\\\` first, as a parser pairs them)
every remaining quote opens or closes a string. A document that is not JSON may be misread, but
only past the point where the parser stops on it.
"""
from __future__ import annotations

import json

# Every byte but the brackets, deleted; then braces read as brackets: the nesting is their order.
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_AS_BRACKETS = bytes.maketrans(b"{}", b"[]")


class JsonShapeError(ValueError):
    """A document refused before parsing: the message says which bound it passes."""


def check_shape(body: bytes, max_depth: int, max_values: int) -> None:
    """Refuse `body` (JsonShapeError) when it is not UTF-8, or when parsing it would build more
    than `max_values` values (strings, numbers, containers; an upper bound) or nest containers
    deeper than `max_depth`. It may still be invalid JSON: the parser says so, cheaply."""
    if json.detect_encoding(body) not in ("utf-8", "utf-8-sig"):
        raise JsonShapeError("JSON must be UTF-8")
    plain = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    quotes = plain.count(b'"')
    if quotes // 2 > max_values:  # before the split below makes one piece per quote
        raise JsonShapeError(f"JSON with over {max_values} values")
    outside = b"".join(plain.split(b'"')[0::2])  # the document with every string's text removed
    del plain
    # Every value but a string is a container or a scalar, and scalars are separated by commas.
    values = quotes // 2 + outside.count(b"[") + outside.count(b"{") + outside.count(b",") + 1
    if values > max_values:
        raise JsonShapeError(f"JSON with over {max_values} values ({values})")
    brackets = outside.translate(_AS_BRACKETS, _NOT_BRACKETS)
    del outside
    # Each pass removes the innermost level: replace() matches pairs of the string it was given,
    # never the pairs its own removals join.
    for _ in range(max_depth):
        if not brackets:
            return
        brackets = brackets.replace(b"[]", b"")
    if brackets and brackets.count(b"[") == brackets.count(b"]"):
        raise JsonShapeError(f"JSON nested deeper than {max_depth} levels")
    # else not JSON (a bracket not closed): the parser says so, after at most max_values values
