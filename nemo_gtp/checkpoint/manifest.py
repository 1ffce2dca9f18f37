"""A committed checkpoint's manifest: every file's size and CRC-32, checked before a load.

[Note: the manifest]
The commit (:mod:`nemo_gtp.checkpoint.io`) writes ``manifest.json`` into the staged directory
just before its renames, after every rank's files are closed: megatron's ``torch_dist`` writes
``__<rank>_<i>.distcp`` on each rank (in worker processes that the save's finalize step has
joined, the results gathered to rank 0), and rank 0 writes ``common.pt``, DCP's ``.metadata``
and ``metadata.json`` (last, before a barrier). The files are hashed where they were written:
rank ``r`` reads its own ``__r_*`` files (still in its page cache), rank 0 the others; rank 0
gathers the records and writes the manifest, so it covers every rank's files. A load checks
the sizes always (a ``stat`` per file) and, with ``checksums``, the CRC-32 of every file, each
rank reading its share; a mismatch raises :class:`CheckpointCorruptError` on every rank, naming
the file, what the manifest says and what is there, and the previous committed checkpoint.

CRC-32 (``zlib.crc32``) is the checksum: it catches every burst error up to 32 bits (a flipped
bit, a torn sector) and is fast enough that reading the file sets the pace. A ~1B-parameter run
on 8 GPUs writes ~2.15 GB per rank (bf16 weights, fp32 main weights, two Adam moments; two
files a rank): on an H100 host's Xeon that share takes 0.75 s to hash from the page cache right
after the write (2.9 GB/s, two threads) and 1.7 s from disk at a load (1.3 GB/s); BLAKE2b runs
at 0.41 GB/s a thread there, SHA-1 at half CRC-32's speed on the 2-core test machine. A ``stat``
per file (the sizes) costs about a millisecond. CRC-32 guards against damage, not tampering;
the manifest records the algorithm, so a later one can differ.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "nemo_gtp.checkpoint.manifest/1"
CHECKSUM = "crc32"
VERIFY = ("checksums", "sizes")  # what a load checks against the manifest
_CHUNK = 8 << 20
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp")
_STEP = re.compile(r"step=(\d+)")


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint as the manifest records it (``crc32``: 8 hex digits, or None
    when only the size was taken)."""

    size: int
    crc32: str | None = None


@dataclass(frozen=True)
class Mismatch:
    """A file that differs from its manifest record (``found`` None: the file is missing)."""

    name: str
    expected: FileRecord
    found: FileRecord | None

    def describe(self) -> str:
        """``__1_0.distcp: manifest 53248 bytes crc32 0a1b2c3d, found 53248 bytes crc32 ...``"""
        want = _text(self.expected)
        got = "missing" if self.found is None else _text(self.found)
        return f"{self.name}: manifest {want}, found {got}"


def _text(record: FileRecord) -> str:
    crc = f" crc32 {record.crc32}" if record.crc32 is not None else ""
    return f"{record.size} bytes{crc}"


class CheckpointIncompleteError(RuntimeError):
    """A checkpoint's data files are shorter than (or missing from) what its metadata records
    (the commit's manifest, or torch DCP's ``.metadata`` for a checkpoint without one).

    Attributes:
        checkpoint_dir: the checkpoint's weights directory.
        damaged: ``{file name: (bytes on disk or None if missing, bytes the metadata needs)}``.
        previous: the newest committed checkpoint before it, where known (None otherwise).
    """

    def __init__(
        self,
        checkpoint_dir: str | Path,
        damaged: dict[str, tuple[int | None, int]],
        previous: Path | None = None,
    ) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        self.damaged = damaged
        self.previous = previous
        lines = [
            f"  {name}: "
            + ("missing" if have is None else f"{have} bytes")
            + f", the metadata needs {need}"
            for name, (have, need) in sorted(damaged.items())
        ]
        other = f" (the previous committed one: +resume={previous})" if previous else ""
        super().__init__(
            f"checkpoint {self.checkpoint_dir} is incomplete (truncated or partly copied): "
            f"{len(damaged)} data file(s) hold less than its metadata records:\n"
            + "\n".join(lines)
            + f"\nResume from another checkpoint{other}, or copy these files again; loading "
            "with ckpt_load_strictness=False does not repair missing tensor data."
        )


class CheckpointCorruptError(RuntimeError):
    """A committed checkpoint's files differ from the manifest its commit wrote.

    Attributes: ``checkpoint_dir`` (the ``weights`` directory), ``mismatches`` (one
    :class:`Mismatch` per file), ``previous`` (the newest committed checkpoint before it, or
    None).
    """

    def __init__(
        self,
        checkpoint_dir: str | Path,
        mismatches: list[Mismatch],
        previous: Path | None,
        unreadable: str | None = None,
    ) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        self.mismatches = mismatches
        self.previous = previous
        what = (
            f"resume from the previous committed checkpoint instead: +resume={previous}"
            if previous is not None
            else "no earlier committed checkpoint is there to resume from"
        )
        if unreadable is not None:
            found = f"its {MANIFEST_NAME} is unreadable: {unreadable}"
        else:
            found = (
                f"{len(mismatches)} file(s) differ from the {MANIFEST_NAME} written at its "
                "commit:\n" + "\n".join(f"  {m.describe()}" for m in mismatches)
            )
        super().__init__(
            f"checkpoint {self.checkpoint_dir} is damaged: {found}\nDo not load it; {what} (or "
            "copy the named files again from a good copy)."
        )


def file_crc32(path: str | Path) -> str:
    """The CRC-32 of a file's bytes as 8 hex digits, read in 8 MiB chunks.

    Example: ``file_crc32("ckpts/step=9/weights/common.pt")`` -> ``"9c1e4a07"``.
    """
    crc, buffer = 0, bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while count := f.readinto(buffer):
            crc = zlib.crc32(view[:count], crc)
    return f"{crc:08x}"


def owner_rank(name: str, world: int) -> int:
    """Which of ``world`` ranks reads file ``name`` for its checksum: rank r's own data file
    ``__r_i.distcp`` is read by rank ``r % world``, the rest (rank 0's metadata) by rank 0."""
    match = _RANK_FILE.fullmatch(name)
    return int(match.group(1)) % world if match else 0


def checkpoint_files(directory: str | Path) -> list[str]:
    """The names of the regular files of a checkpoint directory (the manifest excluded)."""
    root = Path(directory)
    return sorted(p.name for p in root.iterdir() if p.is_file() and p.name != MANIFEST_NAME)


def record_files(
    directory: str | Path, names: Iterable[str], checksums: bool = True
) -> dict[str, FileRecord]:
    """Size (and CRC-32) of each named file; several files are read side by side (``zlib``
    releases the GIL). A missing file is left out."""
    root = Path(directory)

    def record(name: str) -> tuple[str, FileRecord | None]:
        path = root / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return name, None
        return name, FileRecord(size, file_crc32(path) if checksums else None)

    names = list(names)
    with ThreadPoolExecutor(max_workers=max(1, min(4, len(names)))) as pool:
        return {name: rec for name, rec in pool.map(record, names) if rec is not None}


def write_manifest(directory: str | Path, files: dict[str, FileRecord]) -> Path:
    """Write ``manifest.json`` (format, checksum algorithm, per-file size and CRC-32) into
    ``directory`` and flush it to disk; returns its path."""
    body = {
        "format": MANIFEST_FORMAT,
        "checksum": CHECKSUM,
        "files": {
            name: {"size": rec.size, CHECKSUM: rec.crc32} for name, rec in sorted(files.items())
        },
    }
    path = Path(directory) / MANIFEST_NAME
    with open(path, "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return path


def read_manifest(directory: str | Path) -> dict[str, FileRecord] | None:
    """The records of ``directory``'s manifest, None when it has none (a checkpoint written
    before manifests, or by a run without GTP). Raises ``ValueError`` for an unreadable one."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text())
        if body.get("format") != MANIFEST_FORMAT or body.get("checksum") != CHECKSUM:
            raise ValueError(f"unknown format {body.get('format')!r} / {body.get('checksum')!r}")
        return {
            name: FileRecord(int(entry["size"]), entry.get(CHECKSUM))
            for name, entry in body["files"].items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path} is not a readable checkpoint manifest: {err}") from err


def check_files(
    directory: str | Path,
    manifest: dict[str, FileRecord],
    checksums: Iterable[str] = (),
) -> list[Mismatch]:
    """Compare ``directory`` with ``manifest``: every file's size, and the CRC-32 of the files
    named in ``checksums`` (those whose size matches). Local, no collective."""
    root, mismatches = Path(directory), []
    wanted = set(checksums)
    sized = {}
    for name, expected in manifest.items():
        path = root / name
        found = FileRecord(path.stat().st_size) if path.is_file() else None
        if found is None or found.size != expected.size:
            mismatches.append(Mismatch(name, expected, found))
        else:
            sized[name] = expected
    to_hash = [n for n in sized if n in wanted and sized[n].crc32 is not None]
    for name, found in record_files(root, to_hash).items():
        if found.crc32 != sized[name].crc32:
            mismatches.append(Mismatch(name, sized[name], found))
    return sorted(mismatches, key=lambda m: m.name)


def previous_committed(checkpoint_dir: str | Path) -> Path | None:
    """The newest committed sibling checkpoint older than ``checkpoint_dir`` (its ``weights``
    directory, or the NeMo ``step=N`` directory holding it): ``step=M`` with M < N whose
    ``weights/metadata.json`` exists and whose NeMo ``-unfinished`` marker does not. None if
    there is none (or the name holds no step)."""
    path = Path(checkpoint_dir).absolute()
    if path.name == "weights" or path.name.startswith(".weights."):
        path = path.parent
    match = _STEP.search(path.name)
    if match is None or not path.parent.is_dir():
        return None
    step, best = int(match.group(1)), None
    for sibling in path.parent.iterdir():
        found = _STEP.fullmatch(sibling.name)
        if found is None or int(found.group(1)) >= step:
            continue
        marker = sibling.with_name(sibling.name + "-unfinished")
        if (sibling / "weights" / "metadata.json").is_file() and not marker.exists():
            if best is None or int(found.group(1)) > best[0]:
                best = (int(found.group(1)), sibling)
    return None if best is None else best[1]


def checks_checksums(verify: str) -> bool:
    """``verify`` (one of :data:`VERIFY`) as a flag; ``ValueError`` naming the choices."""
    if verify not in VERIFY:
        raise ValueError(f"verify={verify!r}: one of {', '.join(VERIFY)}")
    return verify == "checksums"


def verify_checkpoint(directory: str | Path, *, checksums: bool, shared: bool) -> bool:
    """Check a committed checkpoint's files against its manifest; False when it has none.

    Sizes of every file always; with ``checksums`` the CRC-32 of the metadata files (``.metadata``,
    ``common.pt``, ``metadata.json``: every rank reads them in a load anyway) and, with
    ``shared``, of the data files too: spread over the ranks of the default group when one is
    initialized (collective: each rank reads its share, :func:`owner_rank`, the verdicts are
    gathered), else all read by this process. Without ``shared`` no rank waits for another.
    Raises (on every rank alike) :class:`CheckpointIncompleteError` when files are only shorter
    or missing (truncated, partly copied), else :class:`CheckpointCorruptError`, naming each
    file that differs. Example::

        verify_checkpoint("ckpts/step=9/weights", checksums=True, shared=True)
    """
    import torch.distributed as dist

    try:
        manifest = read_manifest(directory)
    except ValueError as err:
        previous = previous_committed(directory)
        raise CheckpointCorruptError(directory, [], previous, str(err)) from None
    distributed = shared and dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if manifest is None:  # the same on every rank (one file system)
        return False
    hashed = []
    for name in manifest if checksums else ():
        if _RANK_FILE.fullmatch(name) is None:
            owner = 0  # metadata: every rank alone, or rank 0 for all
        elif shared:
            owner = owner_rank(name, world)
        else:
            continue
        if owner == rank:
            hashed.append(name)
    found = check_files(directory, manifest, hashed)
    if distributed:
        every: list[list[Mismatch]] = [[] for _ in range(world)]
        dist.all_gather_object(every, found)
        found = sorted({m.name: m for ms in every for m in ms}.values(), key=lambda m: m.name)
    if not found:
        return True
    previous = previous_committed(directory)
    if all(m.found is None or m.found.size < m.expected.size for m in found):
        damaged = {m.name: (m.found and m.found.size, m.expected.size) for m in found}
        raise CheckpointIncompleteError(directory, damaged, previous)
    raise CheckpointCorruptError(directory, found, previous)
