"""Display names (tenants, API keys) that read as what they are.

A name is normalised to NFKC (fullwidth, ligature, mathematical and other compatibility forms become their plain
letters) and stripped. It may not contain a character that is invisible or changes how the text around it is shown:
control characters (Cc), format characters (Cf: the bidi embeddings, overrides and isolates U+202A..U+202E and
U+2066..U+2069, the zero-width space, joiners and direction marks U+200B..U+200F, the word joiner, the byte-order mark
U+FEFF), line and paragraph separators (Zl, Zp), and the rest of Unicode's Default_Ignorable_Code_Point set
(variation selectors, the Hangul fillers, the combining grapheme joiner, ...): a 400 naming the field and the
character. Lone surrogates are refused as well (neither PostgreSQL nor UTF-8 can hold them) but stay out of the
published pattern, which JSON Schema tools built on Rust's regex engine cannot compile. Beyond the Basic
Multilingual Plane the same kinds of characters (the tag characters U+E0000..U+E0FFF, the variation selectors
supplement, musical and shorthand format controls) are removed by the normalisation rather than refused: see
PATTERN_RANGES.

``NAME_PATTERN`` / ``NONBLANK_NAME_PATTERN`` state the character rule in the OpenAPI schema, so a name the schema
allows is never refused for its characters (tests/tenants/test_names.py checks every code point).

Tenant names must also not be *confusable* with an existing one: ``skeleton`` is Unicode TR39's skeleton (NFD, each
character replaced by its prototype, NFD again) over a small table of the look-alikes that matter for names written
in Latin, Cyrillic and Greek ("dеmo" with a Cyrillic е, "Ρaypal" with a Greek Ρ, "0"/"O", "1"/"l"/"I", "rn"/"m").
Two names with the same skeleton look alike. The table is ours rather than a PyPI package's: the maintained one
(`confusable_homoglyphs`) answers "is this string mixed-script / dangerous", not TR39 skeletons, and the full
confusables.txt (6,000+ entries across every script) would be data to vendor and keep current for a handful of
Latin/Cyrillic/Greek pairs. NFKC beforehand folds the compatibility forms (fullwidth, mathematical alphanumerics)
that the full table would also fold.
"""

from __future__ import annotations

import unicodedata

MAX_LENGTH = 100

# Code points refused besides the categories below: Unicode's Default_Ignorable_Code_Point (DerivedCoreProperties;
# stable since Unicode 5.2). The format characters among them are Cf anyway.
DEFAULT_IGNORABLE = (
    (0x00AD, 0x00AD),
    (0x034F, 0x034F),
    (0x061C, 0x061C),
    (0x115F, 0x1160),
    (0x17B4, 0x17B5),
    (0x180B, 0x180F),
    (0x200B, 0x200F),
    (0x202A, 0x202E),
    (0x2060, 0x206F),
    (0x3164, 0x3164),
    (0xFE00, 0xFE0F),
    (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0),
    (0xFFF0, 0xFFF8),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0000, 0xE0FFF),
)
REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})
# The format characters (Cf) of Python 3.11's Unicode 14 database, for the published pattern (computing them at
# import would cost every process 70 ms); tests/tenants/test_names.py fails if the database has others.
FORMAT_CHARACTERS = (
    (0x00AD, 0x00AD),
    (0x0600, 0x0605),
    (0x061C, 0x061C),
    (0x06DD, 0x06DD),
    (0x070F, 0x070F),
    (0x0890, 0x0891),
    (0x08E2, 0x08E2),
    (0x180E, 0x180E),
    (0x200B, 0x200F),
    (0x202A, 0x202E),
    (0x2060, 0x2064),
    (0x2066, 0x206F),
    (0xFEFF, 0xFEFF),
    (0xFFF9, 0xFFFB),
    (0x110BD, 0x110BD),
    (0x110CD, 0x110CD),
    (0x13430, 0x13438),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0001, 0xE0001),
    (0xE0020, 0xE007F),
)
_CONTROL_AND_SEPARATORS = ((0x00, 0x1F), (0x7F, 0x9F), (0x2028, 0x2029))


def _merged(ranges) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for low, high in sorted(ranges):
        if merged and low <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], high)
        else:
            merged.append([low, high])
    return [(low, high) for low, high in merged]


REFUSED_RANGES = _merged(_CONTROL_AND_SEPARATORS + FORMAT_CHARACTERS + DEFAULT_IGNORABLE)
# Beyond the BMP the same characters (tag characters, the variation selectors supplement, musical and shorthand
# format controls, ...) are removed by `normalized` instead of refused: a JSON Schema pattern can only name them as
# \u{...} or \U........, which Python's re or ECMAScript's regex (and schemathesis) cannot all read, so the schema
# could not say they are refused. Removed, they can neither hide in a name nor make two names differ invisibly.
PATTERN_RANGES = [(low, high) for low, high in REFUSED_RANGES if high <= 0xFFFF]
assert all(high <= 0xFFFF or low > 0xFFFF for low, high in REFUSED_RANGES)


def _class_item(code_point: int) -> str:
    return f"\\u{code_point:04x}"  # the same in Python's, ECMAScript's and Rust's regex syntax


_REFUSED_CLASS = "".join(
    _class_item(low) if low == high else f"{_class_item(low)}-{_class_item(high)}" for low, high in PATTERN_RANGES
)
NAME_PATTERN = rf"^[^{_REFUSED_CLASS}]*$"
NONBLANK_NAME_PATTERN = rf"^[^{_REFUSED_CLASS}]*[^\s{_REFUSED_CLASS}][^{_REFUSED_CLASS}]*$"
CHARACTERS_MESSAGE = "No control, format, bidi-override or zero-width characters."


def is_refused(character: str) -> bool:
    """Whether a display name may not hold `character` (beyond the BMP: whether `normalized` removes it)."""
    code_point = ord(character)
    if unicodedata.category(character) in REFUSED_CATEGORIES:
        return True
    return any(low <= code_point <= high for low, high in DEFAULT_IGNORABLE)


def refused_character(name: str) -> str | None:
    """The first character of `name` a display name may not hold, described ("U+202E RIGHT-TO-LEFT OVERRIDE"),
    or None."""
    for character in name:
        if is_refused(character):
            return f"U+{ord(character):04X} {unicodedata.name(character, 'unnamed')}"
    return None


def _nfkc(name: str) -> str:
    name = unicodedata.normalize("NFKC", name)
    if any(ord(character) > 0xFFFF for character in name):
        name = "".join(c for c in name if not (ord(c) > 0xFFFF and is_refused(c)))
    return name


def normalized(name: str) -> str:
    """NFKC, without the invisible characters beyond the BMP, stripped of surrounding whitespace: the form a name is
    compared and stored in."""
    return _nfkc(name).strip()


class InvalidName(ValueError):
    """Why a name cannot be a display name (the message is for the client)."""


def cleaned(name: str, *, max_length: int = MAX_LENGTH, allow_blank: bool = False) -> str:
    """`name` normalized, or InvalidName. Characters are checked before stripping ("demo\n" is refused, as the
    schema's pattern refuses it, not trimmed), blankness and length after."""
    if not isinstance(name, str):
        raise InvalidName("A string.")
    unstripped = _nfkc(name)
    character = refused_character(unstripped)
    if character is not None:
        raise InvalidName(f"{CHARACTERS_MESSAGE} Found {character}.")
    name = unstripped.strip()
    if not name and not allow_blank:
        raise InvalidName("Not blank.")
    if len(name) > max_length:
        raise InvalidName(f"At most {max_length} characters (after NFKC normalisation).")
    return name


# ---- confusables (Unicode TR39 skeletons) ---------------------------------------------------------------------------
# character -> its prototype, as in TR39's confusables.txt (prototypes are the Latin letters and digits the
# look-alikes are taken for). Accented look-alikes need no entry: NFD splits them into a base letter and its marks.
_PROTOTYPES = {
    # Latin among itself
    "0": "O",
    "1": "l",
    "I": "l",
    "|": "l",
    "\u01c0": "l",
    "\u0131": "i",
    "\u0251": "a",
    "\u0261": "g",
    "m": "rn",
    # Cyrillic
    "\u0430": "a",
    "\u0435": "e",
    "\u043e": "o",
    "\u0440": "p",
    "\u0441": "c",
    "\u0443": "y",
    "\u0445": "x",
    "\u0455": "s",
    "\u0456": "i",
    "\u0458": "j",
    "\u04bb": "h",
    "\u0501": "d",
    "\u051b": "q",
    "\u051d": "w",
    "\u04cf": "l",
    "\u0410": "A",
    "\u0412": "B",
    "\u0415": "E",
    "\u041a": "K",
    "\u041c": "M",
    "\u041d": "H",
    "\u041e": "O",
    "\u0420": "P",
    "\u0421": "C",
    "\u0422": "T",
    "\u0423": "Y",
    "\u0425": "X",
    "\u0405": "S",
    "\u0406": "l",
    "\u0408": "J",
    "\u051a": "Q",
    "\u051c": "W",
    "\u04c0": "l",
    "\u0417": "3",
    # Greek
    "\u03b1": "a",
    "\u03b3": "y",
    "\u03b9": "i",
    "\u03bd": "v",
    "\u03bf": "o",
    "\u03c1": "p",
    "\u03c5": "u",
    "\u03f2": "c",
    "\u03f3": "j",
    "\u0391": "A",
    "\u0392": "B",
    "\u0395": "E",
    "\u0396": "Z",
    "\u0397": "H",
    "\u0399": "l",
    "\u039a": "K",
    "\u039c": "M",
    "\u039d": "N",
    "\u039f": "O",
    "\u03a1": "P",
    "\u03a4": "T",
    "\u03a5": "Y",
    "\u03a7": "X",
    "\u03f9": "C",
    "\u037f": "J",
}
_SKELETON_TABLE = str.maketrans(_PROTOTYPES)


def skeleton(name: str) -> str:
    """TR39's skeleton of a normalized name: equal skeletons, confusable names."""
    decomposed = unicodedata.normalize("NFD", name)
    return unicodedata.normalize("NFD", decomposed.translate(_SKELETON_TABLE))
