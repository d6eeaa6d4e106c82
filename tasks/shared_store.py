"""The shared store: content-addressed folders (base model, data splits, variants) in a place every worker of a
cluster reaches (`cluster.store`: s3://bucket/prefix, or a folder they all mount), so that bytes built on one
machine are measured on another without trusting either machine's disk.

A folder is stored under its key (the SHA-256 over its files' names and hashes) with an index of per-file hashes
written last (on a folder store: written aside and renamed into place): a folder without its index is an
interrupted upload and is never read. Every read checks each file against the index, so a damaged or half-copied
object is refused, naming the file. Workers of one machine share their copies: one downloads, the others wait."""

from __future__ import annotations

import contextlib
import fcntl
import json
import posixpath
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tasks.errors import ArtifactError, LlmoptError, StorageError
from tasks.local_files import combined_sha256, file_hashes, first_difference, staged_folder

INDEX = "llmopt-files.json"  # per-file SHA-256, uploaded after every file it lists


def folder_key(folder: Path) -> str:
    """The key a folder is stored under: its files' names and SHA-256 (same bytes, same key, on any machine)."""
    return combined_sha256(file_hashes(folder))


@contextlib.contextmanager
def _reaching(url: str, what: str) -> Iterator[None]:
    """Any failure to reach the store (network, credentials, a missing bucket) as one StorageError line."""
    try:
        yield
    except LlmoptError:
        raise
    except Exception as exc:  # fsspec backends raise OSError, botocore errors, ValueError, …
        raise StorageError(f"{url}: cannot {what} ({type(exc).__name__}: {exc})") from exc


@contextlib.contextmanager
def _locked(dest: Path) -> Iterator[None]:
    """Exclusive use of `dest` among the processes of this machine (workers fetching the same folder)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with (dest.parent / f".{dest.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@dataclass(frozen=True)
class FolderStore:
    """Folders by content key under an fsspec URL (`s3://bucket/prefix`, `/mnt/shared/llmopt`, `file://…`). S3
    endpoints and credentials come from the usual AWS environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, …)."""

    url: str

    def _fs(self):
        import fsspec

        fs, root = fsspec.core.url_to_fs(self.url)
        return fs, root.rstrip("/")

    def _local(self, fs) -> bool:
        protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
        return "file" in protocols or "local" in protocols

    def has(self, key: str) -> bool:
        fs, root = self._fs()
        with _reaching(self.url, "look into the store"):
            return fs.exists(f"{root}/{key}/{INDEX}")

    def put(self, folder: Path, key: str | None = None) -> str:
        """Upload `folder` under its key unless the store holds it already; the key. `key`, when given, is the
        key the caller computed (the folder's files are hashed again here, once per change)."""
        hashes = file_hashes(folder)
        actual = combined_sha256(hashes)
        if key is not None and key != actual:
            raise ArtifactError(f"{folder}: its files hash to {actual[:12]}, expected {key[:12]}")
        if self.has(actual):
            return actual
        fs, root = self._fs()
        local = self._local(fs)
        with _reaching(self.url, f"upload {folder.name}"):
            for relative in hashes:
                target = f"{root}/{actual}/{relative}"
                if local:  # folders must exist there (on S3 makedirs would probe, even create, buckets)
                    fs.makedirs(posixpath.dirname(target), exist_ok=True)
                fs.put_file(str(folder / relative), target)
            index = f"{root}/{actual}/{INDEX}"
            aside = f"{index}.{uuid.uuid4().hex}" if local else index  # S3 objects appear whole or not at all
            with fs.open(aside, "w") as handle:
                handle.write(json.dumps(hashes, indent=1, sort_keys=True))
            if aside != index:
                fs.mv(aside, index)
        return actual

    def get(self, key: str, dest: Path) -> Path:
        """`dest` holding the folder stored under `key`: kept when its bytes already match, else downloaded into a
        staged folder, every file checked against the index before it replaces `dest`."""
        with _locked(dest):
            if dest.is_dir() and folder_key(dest) == key:
                return dest
            hashes = self._index(key)
            fs, root = self._fs()
            with staged_folder(dest) as staging, _reaching(self.url, f"download folder {key[:12]}"):
                for relative in hashes:
                    target = staging / relative
                    target.parent.mkdir(parents=True, exist_ok=True)
                    fs.get_file(f"{root}/{key}/{relative}", str(target))
                problem = first_difference(file_hashes(staging), hashes)
                if problem is not None:
                    name, now, then = problem
                    raise ArtifactError(
                        f"{self.url}/{key[:12]}: {name} hashes to {now[:12]}, the store recorded {then[:12]}; "
                        "refusing to use it"
                    )
        return dest

    def _index(self, key: str) -> dict[str, str]:
        """The folder's per-file hashes, checked against its key and for names that stay inside the folder."""
        fs, root = self._fs()
        try:
            with _reaching(self.url, f"read folder {key[:12]}"), fs.open(f"{root}/{key}/{INDEX}") as handle:
                hashes = json.loads(handle.read())
        except StorageError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                raise ArtifactError(
                    f"{self.url}: no complete folder {key[:12]} (never uploaded, or its upload was interrupted)"
                ) from None
            raise
        names = list(hashes) if isinstance(hashes, dict) else [".."]
        unsafe = [n for n in names if PurePosixPath(n).is_absolute() or ".." in PurePosixPath(n).parts]
        if unsafe or combined_sha256(hashes) != key:
            raise ArtifactError(
                f"{self.url}/{key[:12]}: its index does not match its key; refusing to use it"
            )
        return hashes
