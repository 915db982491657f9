"""How zephon names a location: a local path, or a URL (``s3://``, ``gs://``, ``az://``,
``file://``), and how a URL is printed.

Role: ``is_url`` tells a URL from a local path (a URL is never taken as a path:
``Path("s3://b/x")`` would silently become the folder ``s3:``); ``mistyped_url`` /
``refuse_mistyped_url`` catch a URL written with one slash (``s3:/b/x``); ``parse_url``
checks one (scheme, bucket, prefix, no credentials in it); ``redact`` and ``scrub`` are
how a URL and any text holding one are printed (query strings, which may hold an Azure
SAS token, and user info never are; the values of the secret variables are removed);
``refuse_url`` is what a command or setting that takes local paths only says to a URL;
``local_path`` turns a ``file://`` URL into its path. ``CREDENTIAL_VARIABLES`` names,
per cloud, where obstore looks for credentials (messages name them).

Invariant: no function here prints or returns a URL's query string or user info, or
the value of a secret variable: what messages show passes ``redact`` or ``scrub``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from torchtitan_zephon.store.format import StoreError

URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
OBJECT_SCHEMES = ("s3", "gs", "az")
SCHEMES = (*OBJECT_SCHEMES, "file")

CREDENTIAL_VARIABLES = {
    "s3": (
        "AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN), "
        "AWS_WEB_IDENTITY_TOKEN_FILE + AWS_ROLE_ARN, AWS_CONTAINER_CREDENTIALS_RELATIVE_URI "
        "or _FULL_URI, then the instance metadata service (AWS_ENDPOINT_URL for an "
        "S3-compatible endpoint; AWS_SKIP_SIGNATURE=true for a public bucket)"
    ),
    "gs": (
        "GOOGLE_SERVICE_ACCOUNT (or GOOGLE_SERVICE_ACCOUNT_PATH / GOOGLE_SERVICE_ACCOUNT_KEY), "
        "GOOGLE_APPLICATION_CREDENTIALS, then the instance metadata service"
    ),
    "az": (
        "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_KEY, "
        "or AZURE_CLIENT_ID + AZURE_CLIENT_SECRET + AZURE_TENANT_ID (or a federated token "
        "file), then the instance metadata service"
    ),
}
SECRET_VARIABLES = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ACCESS_KEY_ID",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_SAS_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_CLIENT_SECRET",
)


def is_url(value: str | os.PathLike) -> bool:
    """True when ``value`` is written as a URL (``scheme://...``), whatever the scheme."""
    return isinstance(value, str) and URL_RE.match(value) is not None


_ONE_SLASH = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):/(?!/)")


def mistyped_url(value: Any) -> str | None:
    """The URL meant by a location written as a URL of a scheme zephon reads with one
    slash (``s3:/bucket/q`` -> ``s3://bucket/q``), else None."""
    m = _ONE_SLASH.match(value) if isinstance(value, str) else None
    if m is None or m.group(1).lower() not in SCHEMES:
        return None
    scheme = m.group(1)
    return f"{scheme}://{'/' if scheme.lower() == 'file' else ''}{value[m.end() :]}"


def refuse_mistyped_url(value: Any, what: str) -> None:
    """A StoreError for a ``mistyped_url``, which would otherwise be taken as the local
    path ``./s3:/bucket/q``; ``what`` names the option or argument."""
    fixed = mistyped_url(value)
    if fixed is None:
        return
    scheme = fixed.split(":", 1)[0]
    raise StoreError(
        f"{what} {redact(value)!r} starts with the URL scheme {scheme}: and one slash; a URL "
        f"has two, and zephon never takes it as a local path. Did you mean {redact(fixed)!r}?"
    )


def redact(value: str) -> str:
    """``value`` as it may be printed: the query string of any URL in it (a SAS token,
    a signature) replaced by ``?<redacted>``, and any user info (``user:password@``)
    by ``<redacted>@``."""
    value = re.sub(r"(\b[A-Za-z][A-Za-z0-9+.\-]*://)[^\s/?@'\"]*@", r"\1<redacted>@", value)
    return re.sub(r"(\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s?'\"]*)\?[^\s'\"]*", r"\1?<redacted>", value)


def scrub(text: str) -> str:
    """``text`` with URLs redacted and the value of every secret variable removed."""
    text = redact(text)
    for name in SECRET_VARIABLES:
        secret = os.environ.get(name, "")
        if len(secret) >= 4:
            text = text.replace(secret, f"<{name}>")
    return text


@dataclass(frozen=True)
class ObjectURL:
    """A checked object-storage URL: ``scheme://bucket/prefix`` (no trailing slash)."""

    scheme: str
    bucket: str
    prefix: str
    text: str  # as given, for obstore (may hold a query string: never printed)

    @property
    def shown(self) -> str:
        """The URL as messages print it (redacted)."""
        return redact(self.text.rstrip("/"))

    def child(self, name: str) -> str:
        """The shown URL of the file ``name`` under the prefix (a name that starts with
        ``/`` is a key from the bucket's root: ``location.ObjectFiles``)."""
        if name.startswith("/"):
            return f"{self.scheme}://{self.bucket}{name}"
        return f"{self.shown.split('?')[0]}/{name}"

    def root_text(self) -> str:
        """The URL of the bucket's root, as given (its query string kept)."""
        base, sep, query = self.text.partition("?")
        return f"{self.scheme}://{self.bucket}" + (sep + query if sep else "")

    def key_url(self, key: str) -> str:
        """The URL of the object ``key`` (from the bucket's root) in this bucket."""
        return f"{self.scheme}://{self.bucket}/{key.lstrip('/')}"


def parse_url(value: str, what: str = "a store", *, pattern: bool = False) -> ObjectURL | str:
    """The object URL ``value`` names, or the local path of a ``file://`` URL; a
    StoreError for an unknown scheme, credentials in the URL, or a URL without bucket
    or (unless ``pattern``: raw inputs, a glob or a whole bucket allowed) prefix."""
    m = URL_RE.match(value)
    if m is None:
        raise StoreError(f"{redact(value)!r} is not a URL.")
    scheme = m.group(1).lower()
    if scheme not in SCHEMES:
        raise StoreError(
            f"{what} {redact(value)!r} has the URL scheme {scheme!r}, which zephon does not "
            f"read: expected one of {', '.join(s + '://' for s in SCHEMES)}, or a local path."
        )
    parts = urlsplit(value)
    if scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise StoreError(
                f"{what} {redact(value)!r}: a file:// URL names a local absolute path, "
                "file:///path/to/store; found none."
            )
        return parts.path
    bucket, prefix = parts.netloc, parts.path.strip("/")
    kind = "container" if scheme == "az" else "bucket"
    if "@" in bucket:
        raise StoreError(
            f"{what} {redact(value)!r} holds credentials (user info before '@'): zephon never "
            f"reads them from a URL. Set them in the cloud's environment "
            f"({CREDENTIAL_VARIABLES[scheme]}) and name it "
            f"{scheme}://{kind.upper()}/PREFIX."
        )
    if not bucket:
        raise StoreError(
            f"{what} {redact(value)!r} names no {kind}: expected {scheme}://{kind.upper()}/PREFIX."
        )
    if pattern:
        return ObjectURL(scheme, bucket, prefix, value)
    if not prefix:
        raise StoreError(
            f"{what} {redact(value)!r} names a whole {kind}, not a store in it: expected "
            f"{scheme}://{bucket}/PREFIX, the prefix the store's files were uploaded under."
        )
    if set("*?[") & set(prefix):
        raise StoreError(
            f"{what} {redact(value)!r} is a pattern; a store is one prefix: name it without "
            "wildcards."
        )
    return ObjectURL(scheme, bucket, prefix, value)


def refuse_url(value: str, what: str, instead: str) -> None:
    """Raise a StoreError when ``value`` is a URL where only a local path is read:
    ``what`` names the option, ``instead`` says what to do."""
    if is_url(value) and not value.lower().startswith("file://"):
        raise StoreError(
            f"{what} {redact(value)!r} is a URL; {what} takes a local path here (a URL is "
            f"never taken as a path). {instead}"
        )


def local_path(value: str, what: str = "the path") -> str:
    """The local path of a ``file://`` URL, ``value`` itself otherwise (a StoreError for a
    URL with one slash: ``refuse_mistyped_url``)."""
    refuse_mistyped_url(value, what)
    if value.lower().startswith("file://"):
        found = parse_url(value)
        assert isinstance(found, str)
        return found
    return value
