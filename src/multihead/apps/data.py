"""Text that ships with Python itself: English sentences from ``pydoc_data.topics``
(the help text of the language reference). No download, same on every machine
with the same Python."""

from __future__ import annotations

import re


def sentences(n: int | None = None, *, min_chars: int = 40, max_chars: int = 200) -> list[str]:
    """Up to ``n`` distinct English sentences, in a fixed order (about 970 on Python 3.11)."""
    import pydoc_data.topics as topics

    text = re.sub(r"\s+", " ", " ".join(topics.topics[k] for k in sorted(topics.topics)))
    seen, out = set(), []
    for s in re.split(r"(?<=[.!?])\s+", text):
        if (min_chars <= len(s) <= max_chars and s[0].isupper() and not re.search(r"[>{}=\[\]_\\|*]", s)
                and s not in seen):
            seen.add(s)
            out.append(s)
    return out if n is None else out[:n]
