"""A served teacher's replicas as one entry writes them (`replica_urls`): URLs joined by '|'
(`http://a:8000|http://b:8000`), or a list of URLs. Standard library only: the entry grammars
read it before importing the client. A user or password is refused on the whole text first
(`redaction.has_userinfo`: a password may hold '|'), before anything splits it."""
from __future__ import annotations

from megatron_rl_patches.teachers.redaction import has_userinfo, redacted

SEPARATOR = "|"


def replica_urls(url: object) -> list[str]:
    """The replicas' URLs of `url`: a str (one URL, or several joined by '|') or a non-empty list
    / tuple of str; each piece stripped. An empty piece or a URL named twice is refused (a
    ValueError naming the text, redacted); each URL itself is checked by the client. A user or
    password anywhere is refused first, never shown."""
    whole = url if isinstance(url, str) else SEPARATOR.join(u for u in url if isinstance(u, str)) \
        if isinstance(url, (list, tuple)) else ""
    if has_userinfo(whole):
        raise ValueError(f"the teacher's url {redacted(whole)!r} carries a user or password: put the API key in an "
                         f"environment variable (ClientSettings.api_key_env), never in the url")
    return replica_pieces(url)


def replica_pieces(url: object) -> list[str]:
    """`replica_urls` less the user-or-password scan: for text whose user or password was refused
    where it came in (an entry, `teachers.kinds`; the client's own constructor), so its messages
    quote it as it is."""
    if isinstance(url, str):
        pieces = [piece.strip() for piece in url.split(SEPARATOR)]
        said = url
    elif isinstance(url, (list, tuple)) and url and all(isinstance(u, str) for u in url):
        pieces = [u.strip() for u in url]
        said = SEPARATOR.join(url)
        if any(SEPARATOR in piece for piece in pieces):
            raise ValueError(f"the teacher's urls {said!r}: give each replica's URL as one item of the list (no "
                             f"'{SEPARATOR}' inside an item)")
    else:
        raise TypeError(f"the teacher's url must be a str like 'http://host:port' (replicas joined by "
                        f"'{SEPARATOR}') or a non-empty list of such str, got {type(url).__name__}")
    if any(not piece for piece in pieces):
        raise ValueError(f"the teacher's urls {said!r} hold an empty URL: join the replicas' URLs by one "
                         f"'{SEPARATOR}', none before the first or after the last")
    seen = set()
    for piece in pieces:
        key = piece.rstrip("/")
        if key in seen:
            raise ValueError(f"the teacher's urls {said!r} name {piece!r} twice: name each replica once")
        seen.add(key)
    return pieces
