"""Text in the reports: long instructions clamped (expand on click, no script) and settings
written as words rather than Python reprs."""

from __future__ import annotations

from typing import Any

import jinja2
from markupsafe import Markup, escape

CLAMP_CHARS = 400  # a longer text keeps this many characters ...
CLAMP_LINES = 4  # ... or lines in its preview, shown as at most CLAMP_LINES lines at any width; a click expands it

# Shared by both reports' style sheets.
CLAMP_CSS = """
details.clamp { margin: 0; font-size: inherit; }
details.clamp > summary { cursor: pointer; list-style: none; color: inherit; }
details.clamp > summary::-webkit-details-marker { display: none; }
details.clamp .more { color: #0969da; font-size: 12px; white-space: nowrap; }
details.clamp[open] .preview, details.clamp[open] .more.open-it, details.clamp:not([open]) .more.close-it { display: none; }
details.clamp .full { display: block; max-height: 24em; overflow: auto; white-space: pre-wrap; overflow-wrap: anywhere;
  background: #f6f8fa; border-radius: 6px; padding: 6px 8px; margin-top: 4px; }
details.clamp .preview { white-space: pre-wrap; overflow-wrap: anywhere; display: -webkit-box; -webkit-box-orient: vertical;
  -webkit-line-clamp: 4; line-clamp: 4; overflow: hidden; }
"""


def preview(text: str, chars: int = CLAMP_CHARS, lines: int = CLAMP_LINES) -> str | None:
    """The start of a text too long to show whole (at most `chars` characters and `lines` lines),
    or None when it fits."""
    head = "\n".join(text[:chars].split("\n")[:lines])
    return head.rstrip() if len(head) < len(text) else None


def clamp(text: str | None) -> Markup:
    """HTML for a text: as is when short; else its preview that expands to the whole text (in a
    scroll box) on click."""
    text = text or ""
    head = preview(text)
    if head is None:
        return escape(text)
    return Markup(
        '<details class="clamp"><summary><span class="preview">{}…</span> '
        '<span class="more open-it">show all {:,} characters</span>'
        '<span class="more close-it">show less</span></summary>'
        '<span class="full">{}</span></details>'
    ).format(head, len(text), text)


def setting_value(value: Any) -> str:
    """A setting as a reader writes it: on/off, `a 1 · b 2` for a mapping, `a, b` for a list."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, dict):
        return " · ".join(f"{k} {setting_value(v)}" for k, v in value.items()) or "none"
    if isinstance(value, (list, tuple)):
        return ", ".join(setting_value(v) for v in value) or "none"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def setting_name(key: str) -> str:
    return key.replace("_", " ")


def environment() -> jinja2.Environment:
    """The reports' Jinja environment: autoescaped, strict, with the `clamp` filter."""
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    env.filters["clamp"] = clamp
    env.globals["clamp_css"] = Markup(CLAMP_CSS)
    return env
