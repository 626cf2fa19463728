"""Where a URL leads, as the server will read it: its path percent-decoded (servers decode
before they resolve), backslashes taken as slashes, dot segments resolved. A folder's listing
and a parquet file's image paths are held to their folder on this form, never on the text as
written: ``%2e%2e/``, ``..%2f`` or ``\\..\\`` cannot climb out behind a prefix that looks right,
and what is asked for is the URL that was checked."""

from urllib.parse import quote, unquote, urlsplit, urlunsplit

# What a path keeps unquoted when it is written back into a URL
_SAFE = "/:@!$&'()*+,;=-._~"


def _normal_path(path: str) -> str | None:
    """The path a server reads ``path`` as: percent-decoded (as servers decode it before they
    resolve it), backslashes as slashes, dot segments resolved; a trailing slash kept. None when
    it climbs above the root."""
    decoded = unquote(path, errors="surrogateescape").replace("\\", "/")
    if "\0" in decoded:
        return None
    parts = []
    for part in decoded.split("/"):
        if part == "..":
            if not parts:
                return None
            parts.pop()
        elif part not in ("", "."):
            parts.append(part)
    tail = "/" if decoded.endswith(("/", "/.", "/..")) and parts else ""
    return "/" + "/".join(parts) + tail


def below(folder: str, url: str) -> str | None:
    """``url`` as it will be asked for (its path decoded, normalised and quoted again) when it
    lies strictly below the folder URL ``folder`` on the same server; None otherwise. The
    comparison is made on the decoded, normalised paths: ``%2e%2e/``, ``..%2f`` or a backslash
    cannot climb out of the folder behind an undecoded prefix."""
    base, target = urlsplit(folder), urlsplit(url)
    if (base.scheme, base.netloc.lower()) != (target.scheme, target.netloc.lower()):
        return None
    root, path = _normal_path(base.path or "/"), _normal_path(target.path or "/")
    if root is None or path is None:
        return None
    root = root if root.endswith("/") else root + "/"
    if not path.startswith(root) or path == root:
        return None
    quoted = quote(path, safe=_SAFE, errors="surrogateescape")
    return urlunsplit((target.scheme, target.netloc, quoted, target.query, ""))
