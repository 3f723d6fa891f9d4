"""Text as the PNGs draw it: a character the font has no glyph for is drawn by Matplotlib as an
empty box ("tofu"), and a pair of `$` turns the text between them into mathtext (a `$` too many
stops the save with a parse error). Model names, criteria and topics come from the user, with
emoji and any script in them; leaderboard.md and leaderboard.json keep them exactly, the pictures
draw `drawable(text)` (docs/DESIGN.md section 3)."""
from __future__ import annotations

import unicodedata

# What a missing character becomes where it has no short name to show (a letter of a script the
# font lacks): '?' is in every font, unlike U+FFFD in some.
STAND_IN = "?"
# Missing characters that only shape the one before them (a zero width joiner, a variation
# selector, a skin tone, a combining mark): the one before is already replaced.
_SHAPING = ("Mn", "Me", "Cf")


def drawable(text: str) -> str:
    """`text` with every character the figure's fonts lack replaced: a symbol (an emoji) by its
    Unicode name between colons (`:rocket:`), a flag by its two letters, a character that only
    shapes its neighbour (a zero width joiner, a variation selector, a skin tone) by nothing, any
    other by '?'; a `$` is
    escaped so that it is drawn as itself. The fonts are the ones Matplotlib picks for its default
    family, regular and bold (DejaVu Sans unless a matplotlibrc says otherwise): a character is
    kept when both have it."""
    fonts = _figure_fonts()
    out = []
    for char in text:
        if char == "$":
            out.append(r"\$")
        elif char == "\n" or all(font.get_char_index(ord(char)) for font in fonts):
            out.append(char)
        else:
            out.append(_stand_in(char))
    return "".join(out)


def _stand_in(char: str) -> str:
    name = unicodedata.name(char, "")
    if unicodedata.category(char) in _SHAPING or name.startswith("EMOJI MODIFIER"):
        return ""
    if name.startswith("REGIONAL INDICATOR SYMBOL LETTER "):  # a flag's two halves: its letters
        return name[-1]
    if unicodedata.category(char) == "So" and name:
        return f":{name.lower()}:"
    return STAND_IN


def _figure_fonts() -> list:
    from matplotlib import font_manager

    # findfont and get_font keep their own caches: a figure's hundred labels open each file once.
    return [font_manager.get_font(font_manager.findfont(font_manager.FontProperties(weight=weight)))
            for weight in ("normal", "bold")]
