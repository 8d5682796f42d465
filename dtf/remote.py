"""Remote storage (s3://, gs://, hdfs://, ... any scheme fsspec resolves): the file system of a URL
with the settings dtf adds, and its failures as one line naming the URL and the fix.

What dtf adds: for S3, bounded waits. botocore waits 60 s to connect and 60 s for each read and
retries, and s3fs retries each call 5 times over, so an endpoint that accepts and never answers
would hold a run for half an hour; dtf asks botocore for 5 s to connect, 10 s a read (between
bytes, not for a whole download) and one attempt (s3fs's retries stay), unless the storage
options say otherwise (config_kwargs, botocore's Config).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from dtf.errors import UserError

S3_CONNECT_TIMEOUT_S = 5
S3_READ_TIMEOUT_S = 10
S3_ATTEMPTS = 1

# The package fsspec needs for a scheme, for the refusal (fsspec's own registry names the same).
_PACKAGES = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "abfs": "adlfs",
    "az": "adlfs",
    "hf": "huggingface_hub",
}


def is_remote(url: str) -> bool:
    return urlparse(url).scheme not in ("", "file", "local")


def file_system_module(url: str) -> str | None:
    """The module of the fsspec file system of a remote URL (s3fs for s3://), from fsspec's own
    registry; None for a local path or a scheme fsspec does not know."""
    from fsspec.registry import known_implementations

    known = known_implementations.get(urlparse(url).scheme) if is_remote(url) else None
    return None if known is None else str(known["class"]).rsplit(".", 1)[0]


def options(url: str, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """storage_options with dtf's bounded waits added where the URL is on S3 and they are unset."""
    found = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in (storage_options or {}).items()}
    if urlparse(url).scheme in ("s3", "s3a"):
        config = found.setdefault("config_kwargs", {})
        config.setdefault("connect_timeout", S3_CONNECT_TIMEOUT_S)
        config.setdefault("read_timeout", S3_READ_TIMEOUT_S)
        config.setdefault("retries", {"max_attempts": S3_ATTEMPTS, "mode": "standard"})
    return found


def filesystem(url: str, storage_options: Mapping[str, Any] | None, key: str) -> tuple[Any, str]:
    """(fsspec file system, path in it) of a remote URL; a scheme with no package installed is refused."""
    import fsspec

    scheme = urlparse(url).scheme
    try:
        return fsspec.core.url_to_fs(url, **options(url, storage_options))
    except ImportError as e:
        package = _PACKAGES.get(scheme)
        fix = f"pip install {package}" if package else f"install the fsspec package for {scheme}://"
        raise UserError(f"{key}={url}: no file system for {scheme}:// is installed ({first_line(e)}): {fix}") from None
    except ValueError as e:
        if "protocol not known" in str(e).lower():
            raise UserError(
                f"{key}={url}: fsspec knows no scheme {scheme}:// ({first_line(e)}): check the URL"
            ) from None
        raise UserError(
            f"{key}={url}: its storage options do not fit {scheme}:// ({first_line(e)}): {_check(key)}"
        ) from None
    except TypeError as e:  # a keyword the file system does not take
        raise UserError(
            f"{key}={url}: its storage options do not fit {scheme}:// ({first_line(e)}): {_check(key)}"
        ) from None


def _check(key: str) -> str:
    return f"check the storage options given with it ({key.split('.')[0]}.storage_options)"


def explain(error: BaseException, url: str, key: str, doing: str) -> str:
    """One line for a failure of remote storage: the URL, what failed, why, and the fix."""
    return diagnose(error, url, key, doing) or f"{key}={url}: {doing} failed ({first_line(error)})"


def diagnose(error: BaseException, url: str, key: str, doing: str) -> str | None:
    """explain's line where the failure is one a user can mend (an endpoint that does not answer,
    refused credentials, a bucket or path that is not there); None for anything else."""
    what = first_line(error)
    text = f"{type(error).__name__} {error}".lower()
    if isinstance(error, UserError):
        return str(error)
    s3 = urlparse(url).scheme in ("s3", "s3a")
    if any(s in text for s in ("timeout", "timed out", "could not connect", "connectionerror", "connecterror")):
        where = "AWS_ENDPOINT_URL, or the storage options' client_kwargs.endpoint_url" if s3 else "the storage options"
        return (
            f"{key}={url}: the storage endpoint did not answer while {doing} ({what}): check the endpoint "
            f"({where}) and that it is up"
        )
    if isinstance(error, PermissionError) or any(
        s in text for s in ("accessdenied", "access denied", "invalidaccesskeyid", "signaturedoesnotmatch", "forbidden")
    ):
        which = (
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or the storage options' key and secret"
            if s3
            else ("the storage options")
        )
        return f"{key}={url}: access was refused while {doing} ({what}): check the credentials ({which})"
    if isinstance(error, FileNotFoundError) or "nosuchbucket" in text or "does not exist" in text:
        return f"{key}={url} does not exist ({what}): check the bucket and the path"
    return None


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
