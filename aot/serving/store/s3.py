"""A task store in S3-compatible object storage: `s3://BUCKET/PREFIX` (AWS S3, MinIO, SeaweedFS, Ceph, R2...).

The client is obstore (Rust's object_store), chosen over boto3 by measurement: faster small reads, a far shorter
import and half the installed size (docs/benchmarks.md, "The task store on S3"). Configuration follows the AWS
conventions:

- credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (/ AWS_SESSION_TOKEN), else the profile AWS_PROFILE
  (default `default`) of the shared credentials file (AWS_SHARED_CREDENTIALS_FILE, default ~/.aws/credentials);
  else the instance's or pod's role, as object_store finds it;
- endpoint: AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (a non-AWS store; http:// is allowed for it);
- region: AWS_REGION or AWS_DEFAULT_REGION, else the profile's `region` in ~/.aws/config, else us-east-1.

Creating an object only if it is absent (the change log's rule) is S3's conditional write (`If-None-Match: *`,
answered 412 when the key exists): AWS S3 and SeaweedFS honour it; a store that ignores it makes racing publishers
unsafe, which docs/deploy-fleet.md states.
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Collection, Iterator, Mapping
from datetime import timedelta
from pathlib import Path

from aot.serving.store.backend import MAX_OBJECT_BYTES, BackendError

SCHEME = "s3://"


def is_s3_url(location: str) -> bool:
    return str(location).startswith(SCHEME)


def parse_s3_url(url: str) -> tuple[str, str]:
    """`s3://BUCKET[/PREFIX]` -> (bucket, prefix without slashes at its ends)."""
    if not is_s3_url(url):
        raise BackendError(f"{url!r}: expected s3://BUCKET/PREFIX")
    bucket, _, prefix = url[len(SCHEME):].partition("/")
    if not bucket or not all(c.isalnum() or c in "-." for c in bucket) or not 3 <= len(bucket) <= 63:
        raise BackendError(f"{url!r}: {bucket!r} is not a bucket name (3-63 letters, digits, '-' or '.')")
    return bucket, prefix.strip("/")


def _profile_value(path: Path, profile: str, key: str, section_prefix: str = "") -> str | None:
    parser = configparser.ConfigParser()
    try:
        parser.read(path)
    except configparser.Error:
        return None
    for section in (f"{section_prefix}{profile}", profile):
        if parser.has_option(section, key):
            return parser.get(section, key)
    return None


def s3_settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """obstore's S3 settings from the AWS environment variables and files (module docstring)."""
    env = os.environ if environ is None else environ
    home = Path(env.get("HOME", "~")).expanduser()
    profile = env.get("AWS_PROFILE", "default")
    settings: dict[str, str] = {}
    key, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    token = env.get("AWS_SESSION_TOKEN")
    if not (key and secret):
        credentials = Path(env.get("AWS_SHARED_CREDENTIALS_FILE", home / ".aws" / "credentials"))
        key = _profile_value(credentials, profile, "aws_access_key_id")
        secret = _profile_value(credentials, profile, "aws_secret_access_key")
        token = _profile_value(credentials, profile, "aws_session_token")
    if key and secret:
        settings.update(access_key_id=key, secret_access_key=secret)
        if token:
            settings["token"] = token
    config = Path(env.get("AWS_CONFIG_FILE", home / ".aws" / "config"))
    settings["region"] = (env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
                          or _profile_value(config, profile, "region", "profile ") or "us-east-1")
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        settings["endpoint"] = endpoint
    return settings


class S3Backend:
    """The store's objects under `s3://BUCKET/PREFIX/` (aot.serving.store.backend's interface). obstore is imported
    where it is used: an optional dependency (the [s3] extra) that a folder store never loads."""

    def __init__(self, url: str, environ: Mapping[str, str] | None = None, timeout: float = 10.0):
        from obstore.store import S3Store

        self.url = url.rstrip("/")
        self.bucket, self.prefix = parse_s3_url(url)
        settings = s3_settings(environ)
        self.endpoint = settings.get("endpoint", "AWS S3")
        self.store = S3Store(self.bucket, prefix=self.prefix or None, config=settings,
                             client_options={"allow_http": settings.get("endpoint", "").startswith("http://"),
                                             "timeout": f"{timeout}s", "connect_timeout": f"{min(timeout, 5.0)}s"},
                             retry_config={"max_retries": 2, "retry_timeout": timedelta(seconds=timeout),
                                           "backoff": {"init_backoff": timedelta(seconds=0.1),
                                                       "max_backoff": timedelta(seconds=1), "base": 2}},
                             virtual_hosted_style_request=False)
        self.bytes_read = 0

    def __repr__(self) -> str:
        return self.url

    def _failed(self, exc: BaseException, action: str, key: str):
        return BackendError(f"{self.url}: cannot {action} {key} at {self.endpoint}: {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:300] if str(exc) else ''}")

    def read(self, key: str) -> bytes | None:
        data, _ = self._get(key)
        return data

    def _get(self, key: str, etag: str | None = None) -> tuple[bytes | None, str | None]:
        import obstore
        from obstore.exceptions import NotFoundError, NotModifiedError

        try:
            result = obstore.get(self.store, key, options={"if_none_match": etag} if etag else None)
            if result.meta["size"] > MAX_OBJECT_BYTES:
                raise BackendError(f"{self.url}/{key}: {result.meta['size']} bytes, over the {MAX_OBJECT_BYTES} a "
                                   "store object may have")
            data = bytes(result.bytes())
        except (NotFoundError, FileNotFoundError):
            return None, None
        except NotModifiedError:
            return None, etag
        except BackendError:
            raise
        except Exception as exc:  # noqa: BLE001 - any client error is the store's, named as such
            raise self._failed(exc, "read", key) from None
        self.bytes_read += len(data)
        return data, result.meta.get("e_tag")

    def read_if_changed(self, key: str, tag) -> tuple[bytes | None, object]:
        """(bytes, ETag) when the object changed since the ETag `tag` (a conditional GET: 304 costs no body)."""
        data, etag = self._get(key, tag)
        if data is None:
            return None, etag if etag is not None else tag
        return data, etag

    def create(self, key: str, data: bytes) -> bool:
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        try:
            obstore.put(self.store, key, data, mode="create")
        except (AlreadyExistsError, PreconditionError):
            return False
        except Exception as exc:  # noqa: BLE001
            raise self._failed(exc, "create", key) from None
        return True

    def write(self, key: str, data: bytes) -> None:
        import obstore

        try:
            obstore.put(self.store, key, data)
        except Exception as exc:  # noqa: BLE001
            raise self._failed(exc, "write", key) from None

    def delete(self, key: str) -> None:
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            obstore.delete(self.store, key)
        except (NotFoundError, FileNotFoundError):
            pass
        except Exception as exc:  # noqa: BLE001
            raise self._failed(exc, "delete", key) from None

    def list(self, prefix: str) -> Iterator[str]:
        """Keys of the objects directly under `prefix/`."""
        import obstore

        folder = prefix.rstrip("/") + "/"
        try:
            listed = obstore.list_with_delimiter(self.store, folder)
        except Exception as exc:  # noqa: BLE001
            raise self._failed(exc, "list", folder) from None
        # a store with directories (SeaweedFS's filer) lists an emptied folder as an object named like the folder
        return iter(sorted(o["path"] for o in listed["objects"] if o["path"].startswith(folder)))

    def folders(self, skip: Collection[str] = ()) -> dict[str, float]:
        """The top-level "folders" (common prefixes) of the store but those in `skip` -> the newest modification
        time of their objects (unix seconds; a listing of each folder). Folders with no object (an emptied one that a
        store with directories still lists) are left out."""
        import obstore

        try:
            listed = obstore.list_with_delimiter(self.store, None)
            out = {}
            for prefix in listed["common_prefixes"]:
                name = prefix.rstrip("/")
                if name in skip:
                    continue
                objects = [o for o in obstore.list_with_delimiter(self.store, name + "/")["objects"]
                           if o["path"].startswith(name + "/")]
                if objects:
                    out[name] = max(o["last_modified"].timestamp() for o in objects)
        except Exception as exc:  # noqa: BLE001
            raise self._failed(exc, "list", "/") from None
        return out

    def delete_folder(self, name: str) -> None:
        for key in list(self.list(name)):
            self.delete(key)

    def upload(self, path: Path, key: str) -> None:
        """A local file to `key` (multipart for large files)."""
        import obstore

        try:
            with open(path, "rb") as f:
                obstore.put(self.store, key, f)
        except Exception as exc:  # noqa: BLE001
            raise self._failed(exc, "write", key) from None

    def download(self, key: str, path: Path) -> int:
        """`key` into the local file `path` (streamed; bytes written). FileNotFoundError when it is missing."""
        import obstore
        from obstore.exceptions import NotFoundError

        written = 0
        try:
            result = obstore.get(self.store, key)
            with open(path, "wb") as f:
                for chunk in result.stream(min_chunk_size=1 << 20):
                    f.write(chunk)
                    written += len(chunk)
        except (NotFoundError, FileNotFoundError):
            raise FileNotFoundError(f"{self.url}/{key}") from None
        except Exception as exc:  # noqa: BLE001
            raise self._failed(exc, "read", key) from None
        self.bytes_read += written
        return written
