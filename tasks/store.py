"""The shared store: content-addressed folders (base model, data splits, variants) in a place every worker of a
cluster reaches (`cluster.store`: s3://bucket/prefix, or a folder they all mount), so that bytes built on one
machine are measured on another without trusting either machine's disk.

A folder is stored under its key (the SHA-256 over its files' names and hashes) with an index of per-file hashes
written last: a folder without its index is an interrupted upload and is never read. Every read checks each file
against the index, so a damaged or half-copied object is refused, naming the file."""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass
from pathlib import Path

from tasks.errors import ModelSourceError, StorageError
from tasks.storage import combined_sha256, file_hashes, first_difference, staged_folder

INDEX = "llmopt-files.json"  # per-file SHA-256, uploaded after every file it lists


def folder_key(folder: Path) -> str:
    """The key a folder is stored under: its files' names and SHA-256 (same bytes, same key, on any machine)."""
    return combined_sha256(file_hashes(folder))


@dataclass(frozen=True)
class FolderStore:
    """Folders by content key under an fsspec URL (`s3://bucket/prefix`, `/mnt/shared/llmopt`, `file://…`). S3
    endpoints and credentials come from the usual AWS environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, …)."""

    url: str

    def _fs(self):
        import fsspec

        fs, root = fsspec.core.url_to_fs(self.url)
        return fs, root.rstrip("/")

    def has(self, key: str) -> bool:
        fs, root = self._fs()
        return fs.exists(f"{root}/{key}/{INDEX}")

    def put(self, folder: Path, key: str | None = None) -> str:
        """Upload `folder` under its key unless the store holds it already; the key. `key`, when given, is the
        key the caller computed (the folder's files are hashed again here, once per change)."""
        hashes = file_hashes(folder)
        actual = combined_sha256(hashes)
        if key is not None and key != actual:
            raise ModelSourceError(f"{folder}: its files hash to {actual[:12]}, expected {key[:12]}")
        fs, root = self._fs()
        if fs.exists(f"{root}/{actual}/{INDEX}"):
            return actual
        try:
            for relative in hashes:
                target = f"{root}/{actual}/{relative}"
                fs.makedirs(
                    posixpath.dirname(target), exist_ok=True
                )  # a folder store needs them; S3 ignores it
                fs.put_file(str(folder / relative), target)
            with fs.open(f"{root}/{actual}/{INDEX}", "w") as index:
                index.write(json.dumps(hashes, indent=1, sort_keys=True))
        except OSError as exc:
            raise StorageError(f"{self.url}: cannot upload {folder.name} ({exc})") from exc
        return actual

    def get(self, key: str, dest: Path) -> Path:
        """`dest` holding the folder stored under `key`: kept when its bytes already match, else downloaded into a
        staged folder, every file checked against the index before it replaces `dest`."""
        if dest.is_dir() and folder_key(dest) == key:
            return dest
        fs, root = self._fs()
        try:
            with fs.open(f"{root}/{key}/{INDEX}") as index:
                hashes = json.loads(index.read())
        except FileNotFoundError:
            raise ModelSourceError(
                f"{self.url}: no complete folder {key[:12]} (never uploaded, or its upload was interrupted)"
            ) from None
        except OSError as exc:
            raise StorageError(f"{self.url}: cannot read folder {key[:12]} ({exc})") from exc
        with staged_folder(dest) as staging:
            for relative in hashes:
                target = staging / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(f"{root}/{key}/{relative}", str(target))
            problem = first_difference(file_hashes(staging), hashes)
            if problem is not None or combined_sha256(hashes) != key:
                name, now, then = problem or ("(index)", combined_sha256(hashes), key)
                raise ModelSourceError(
                    f"{self.url}/{key[:12]}: {name} hashes to {now[:12]}, the store recorded {then[:12]}; "
                    "refusing to use it"
                )
        return dest
