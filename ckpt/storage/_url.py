"""Telling a URL from a path, and the backends that serve each scheme.

Kept free of imports beyond the standard library and ``ckpt.errors``: the local
backend uses :func:`refuse_url` on every path it is handed, so that no code path can
turn ``s3://bucket/run`` into a local folder named ``s3:``.
"""

from __future__ import annotations

import re

from ..errors import UnsupportedSchemeError

__all__ = ["url_scheme", "refuse_url", "BACKENDS", "EXTRAS"]

# RFC 3986 scheme, then "://". One letter is a Windows drive ("C://x" is a path there),
# so a scheme has two characters or more.
_URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+)://")

#: scheme -> "module:factory" of the backend serving it (imported only when used)
BACKENDS: dict[str, str] = {
    "s3": "ckpt.storage.s3:S3Storage.from_url",
}

#: scheme -> the pip extra that installs its backend's dependencies
EXTRAS: dict[str, str] = {
    "s3": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "az": "azure",
    "abfs": "azure",
}


def url_scheme(path: str) -> str | None:
    """The lower-cased scheme of ``path`` if it is a URL (``scheme://...``), else None.
    ``file://`` is a local path, not a URL, for this purpose."""
    m = _URL_RE.match(path)
    if m is None:
        return None
    scheme = m.group(1).lower()
    return None if scheme == "file" else scheme


def refuse_url(path: str) -> None:
    """Raise ``UnsupportedSchemeError`` if ``path`` is a URL: the local backend never
    serves one (it would create a folder named after the scheme)."""
    scheme = url_scheme(path)
    if scheme is not None:
        raise unsupported(scheme, path, "the local filesystem backend does not serve URLs")


def unsupported(scheme: str, path: str, why: str) -> UnsupportedSchemeError:
    extra = EXTRAS.get(scheme)
    if scheme in BACKENDS:
        hint = f"install the backend: pip install 'ckpt-replay[{extra}]'"
    elif extra is not None:
        hint = f"no backend for {scheme}:// is shipped yet (planned extra: ckpt-replay[{extra}]); pass storage= to use your own"
    else:
        hint = f"supported schemes: {', '.join(sorted(BACKENDS))}, or a local path; pass storage= to use your own backend"
    return UnsupportedSchemeError(f"{scheme}:// URLs: {why}; {hint}", path=path, scheme=scheme, extra=extra)
