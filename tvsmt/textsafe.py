"""Making text from plans, reports and file names safe to print.

Ids, tensor names, file names and messages come from the user's files. Printed raw, a newline
in an id forges a line of output, ANSI escapes recolour or clear the terminal, a lone surrogate
(valid in JSON) makes printing itself fail, and rich markup such as `[/]` or `layers[i]` is
interpreted by rich instead of shown. `plain` makes any string one printable line; `markup`
also escapes it for rich.
"""

from __future__ import annotations

import unicodedata

from rich.markup import escape as _escape_markup

# Control characters, format characters (bidi overrides, zero-width marks), line and
# paragraph separators, lone surrogates: shown as escapes, never emitted.
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(c: str) -> str:
    if c in _NAMED:
        return _NAMED[c]
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def plain(value: object) -> str:
    """`value` as one printable line: control, format and separator characters escaped."""
    text = value if isinstance(value, str) else str(value)
    if text.isascii() and text.isprintable():
        return text  # the common case, without a per-character walk
    return "".join(_escaped(c) if c in _NAMED or unicodedata.category(c) in _UNSAFE_CATEGORIES
                   else c for c in text)


def markup(value: object) -> str:
    """`value` as one printable line, escaped for rich markup (shown literally by rich)."""
    return _escape_markup(plain(value))
