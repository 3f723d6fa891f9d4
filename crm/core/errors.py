"""ConfigError: a setting that cannot work; ShardError: a training shard that cannot be read. The
entry points report them as one line and exit 2; anything else is a crash and keeps its traceback."""


class ConfigError(ValueError):
    pass


class ShardError(ValueError):
    pass


EXCERPT_CHARS = 200


def excerpt(value, limit: int = EXCERPT_CHARS) -> str:
    """`value`'s repr cut to about `limit` characters: what an error may quote of user input, so
    that a megabyte value costs a line, not a megabyte, in the answer and the log (reprlib bounds
    the work too: nested or long containers are abbreviated, not walked)."""
    import reprlib

    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxother, short.maxlong = 3, limit, limit, 40
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = 8
    try:
        text = short.repr(value)
    except ValueError:  # an int past Python's digit limit
        text = f"<{type(value).__name__}>"
    if len(text) > limit:
        text = text[:limit] + "..."
    if isinstance(value, (str, list, tuple, dict)) and len(value) > 8:
        text += f" ({len(value)} {'characters' if isinstance(value, str) else 'items'})"
    return text
