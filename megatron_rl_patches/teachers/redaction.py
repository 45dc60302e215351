"""What errors, logs and `doctor` may show of a URL or a teacher entry (`redacted`), and whether
one carries a user or password (`has_userinfo`), both read on the raw text before anything splits
or parses it: a password may hold '/', '#', ';' or '@', which cut a parsed authority short or are
split off as a path, fragment or option first. Standard library only."""
from __future__ import annotations

import re

SCHEME_END = "://"
HIDDEN = "***"
# an entry ends at the next ',' (entries of a setting) or white space (the text around it)
ENTRY_END = re.compile(r"[,\s]")


def userinfo_spans(text: str) -> list[tuple[int, int]]:
    """For every '://' in `text`: (just after it, the last '@' before its entry's end), where
    there is such an '@'."""
    spans = []
    start = text.find(SCHEME_END)
    while start >= 0:
        start += len(SCHEME_END)
        stop = ENTRY_END.search(text, start)
        end = len(text) if stop is None else stop.start()
        at = text.rfind("@", start, end)
        if at >= 0:
            spans.append((start, at))
        start = text.find(SCHEME_END, end)
    return spans


def redacted(text: str) -> str:
    """`text` with every URL's user and password (from '://' to the last '@' before its entry's
    end) replaced by '***'."""
    pieces, done = [], 0
    for start, at in userinfo_spans(text):
        pieces += [text[done:start], HIDDEN]
        done = at
    return "".join(pieces) + text[done:]


def has_userinfo(text: str) -> bool:
    """Whether a URL in `text` carries a user or password (an '@' after '://' within its entry)."""
    return bool(userinfo_spans(text))
