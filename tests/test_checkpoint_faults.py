"""Checkpoint faults: a save that fails (a full disk) and a committed checkpoint that is damaged.

Promise: a failed save commits nothing under its name, leaves no staging directory and never
touches what was committed (bit for bit against a copy taken just before the fault); the run
stops with one line naming the path and the errno (``checkpoint.on_save_error=stop``, the
default) or warns and trains on, the next save trying again (``warn``); ``+resume=latest``
picks the last good checkpoint. A committed checkpoint's manifest (every file's size and
CRC-32, written at the commit) is checked before a load: a flipped byte or a truncated file is
named, with the previous committed checkpoint to resume from, instead of loading garbage.

The launch tests run the recipe CLI's launcher (``launch_fits``: the ranks forked from the
preloaded server, NeMo's ``ModelCheckpoint``, GTP's checkpoint IO); the disk fills up through
``tests.harness.checkpoint_faults.FillDiskAtSave`` in the recipe's ``callbacks`` section.
"""

from __future__ import annotations

import errno
import filecmp
import shutil
from pathlib import Path

import pytest

from nemo_gtp.checkpoint.manifest import (
    MANIFEST_NAME,
    CheckpointCorruptError,
    CheckpointIncompleteError,
    FileRecord,
    check_files,
    checkpoint_files,
    file_crc32,
    owner_rank,
    previous_committed,
    read_manifest,
    record_files,
    verify_checkpoint,
    write_manifest,
)
from nemo_gtp.checkpoint.save_faults import CheckpointSaveError, describe_error

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")


def _fake_checkpoint(step_dir: Path, sizes: dict[str, int]) -> Path:
    weights = step_dir / "weights"
    weights.mkdir(parents=True)
    for i, (name, size) in enumerate(sizes.items()):
        (weights / name).write_bytes(bytes((i + k) % 251 for k in range(size)))
    write_manifest(weights, record_files(weights, checkpoint_files(weights)))
    return weights


def test_manifest_names_a_flipped_byte_a_truncated_and_a_missing_file(tmp_path: Path) -> None:
    files = {"__0_0.distcp": 3000, "__1_0.distcp": 2000, "common.pt": 500, "metadata.json": 40}
    older = _fake_checkpoint(tmp_path / "step=3", files)
    _fake_checkpoint(tmp_path / "step=5", files)  # committed, then its save marked unfinished
    (tmp_path / "step=5-unfinished").touch()
    weights = _fake_checkpoint(tmp_path / "step=7", files)
    manifest = read_manifest(weights)
    assert manifest is not None and set(manifest) == set(files)
    assert manifest["common.pt"] == FileRecord(500, file_crc32(weights / "common.pt"))
    assert verify_checkpoint(weights, checksums=True, shared=True)
    assert check_files(weights, manifest, manifest) == []

    data = bytearray((weights / "__1_0.distcp").read_bytes())
    data[1234] ^= 0x01  # one bit: same size, other CRC
    (weights / "__1_0.distcp").write_bytes(bytes(data))
    assert verify_checkpoint(weights, checksums=False, shared=True)  # sizes alone pass
    with pytest.raises(CheckpointCorruptError) as caught:
        verify_checkpoint(weights, checksums=True, shared=True)
    text = str(caught.value)
    want = manifest["__1_0.distcp"]
    assert f"__1_0.distcp: manifest 2000 bytes crc32 {want.crc32}, found 2000 bytes crc32" in text
    # the newest committed one before it; step=5 is not (NeMo's unfinished marker)
    assert caught.value.previous == older.parent
    assert f"+resume={older.parent}" in text

    with open(weights / "__0_0.distcp", "r+b") as f:
        f.truncate(1000)
    (weights / "metadata.json").unlink()
    with pytest.raises(CheckpointIncompleteError) as short:  # the fast path: sizes only
        verify_checkpoint(weights, checksums=False, shared=False)
    assert short.value.damaged == {"__0_0.distcp": (1000, 3000), "metadata.json": (None, 40)}
    assert "__0_0.distcp: 1000 bytes, the metadata needs 3000" in str(short.value)
    assert "metadata.json: missing" in str(short.value)
    assert f"(the previous committed one: +resume={older.parent})" in str(short.value)
    (weights / "metadata.json").write_text("x" * 41)  # longer: damaged, not merely cut short
    with pytest.raises(CheckpointCorruptError) as caught:
        verify_checkpoint(weights, checksums=False, shared=False)
    assert [m.describe() for m in caught.value.mismatches] == [
        f"__0_0.distcp: manifest 3000 bytes crc32 {manifest['__0_0.distcp'].crc32}, found 1000 "
        "bytes",
        f"metadata.json: manifest 40 bytes crc32 {manifest['metadata.json'].crc32}, found 41 bytes",
    ]

    (weights / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(CheckpointCorruptError, match="manifest.json is unreadable"):
        verify_checkpoint(weights, checksums=False, shared=False)
    (weights / MANIFEST_NAME).unlink()
    assert not verify_checkpoint(weights, checksums=True, shared=True)  # none: nothing to check
    assert previous_committed(older) is None
    assert [owner_rank(n, 2) for n in ("__3_1.distcp", "__2_0.distcp", "common.pt")] == [1, 0, 0]


def test_a_failed_write_is_one_line_with_the_errno() -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    full = OSError(errno.ENOSPC, "No space left on device", "/c/.weights.saving/__1_0.distcp")
    assert describe_error(full) == (
        "ENOSPC [Errno 28] No space left on device: '/c/.weights.saving/__1_0.distcp'"
    )
    try:
        try:
            raise full
        except OSError as err:
            raise RuntimeError("Worker failure") from err
    except RuntimeError as chained:
        assert describe_error(chained).startswith("ENOSPC [Errno 28]")
    # megatron's writer failures reach rank 0 as text (pickled without their cause)
    text = RuntimeError(f"Worker failure: {full}")
    assert describe_error(text) == describe_error(full)
    dcp = CheckpointException("write", {3: (text, None), 1: (text, None), 2: (text, None)})
    assert describe_error(dcp).startswith("rank 1: ENOSPC [Errno 28] No space left on device")
    assert describe_error(dcp).endswith("__1_0.distcp' (and on rank 2, 3)")
    error = CheckpointSaveError(Path("/c/step=5"), describe_error(full), Path("/c/step=3"))
    assert "\n" not in str(error)
    assert str(error).startswith("saving checkpoint /c/step=5 failed: ENOSPC [Errno 28]")
    assert str(error).endswith("the last committed checkpoint /c/step=3 is intact")


def test_checkpoint_safety_settings_are_checked() -> None:
    from nemo_gtp.checkpoint.io import CheckpointSafety

    assert CheckpointSafety() == CheckpointSafety("stop", "sizes")  # the API's default
    assert CheckpointSafety.from_recipe(None) == CheckpointSafety("stop", "checksums")
    assert CheckpointSafety.from_recipe({"on_save_error": "warn"}).on_save_error == "warn"
    with pytest.raises(ValueError, match="on_save_error='wran': one of stop, warn"):
        CheckpointSafety(on_save_error="wran")
    with pytest.raises(ValueError, match="verify='crc': one of checksums, sizes"):
        CheckpointSafety(verify="crc")
    # the recipe keys are refused before any process starts, naming the key and the choices
    from nemo_gtp.recipes.config import RecipeError
    from nemo_gtp.run import check

    saving = ["+checkpoint.dir=ckpts", "+checkpoint.every_n_train_steps=2"]
    check(TINY, [*saving, "+checkpoint.on_save_error=warn", "+checkpoint.verify=sizes"])
    with pytest.raises(RecipeError, match=r"checkpoint.on_save_error='wran': one of stop, warn"):
        check(TINY, [*saving, "+checkpoint.on_save_error=wran"])
    with pytest.raises(RecipeError, match=r"checkpoint.verify='crc32': one of checksums, sizes"):
        check(TINY, [*saving, "+checkpoint.verify=crc32"])


def _same_tree(got: Path, want: Path) -> None:
    """``got`` holds exactly ``want``'s files, byte for byte."""
    names = sorted(p.relative_to(want) for p in want.rglob("*"))
    assert sorted(p.relative_to(got) for p in got.rglob("*")) == names
    for name in names:
        if (want / name).is_file():
            assert filecmp.cmp(want / name, got / name, shallow=False), name


def _committed(ckpts: Path) -> list[str]:
    from nemo_gtp.recipes.resume import is_committed

    return sorted(p.name for p in ckpts.iterdir() if p.is_dir() and is_committed(p))


DISK = "tests.harness.checkpoint_faults.FillDiskAtSave"


@pytest.fixture(scope="module")
def disk_full(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One launch, three fits in the same ranks. ``warn``: saves at steps 1, 3, 5, 7; the second
    fails on rank 1's data writer (ENOSPC mid-file), the third on rank 0's ``metadata.json``
    (EDQUOT, rank 0 alone: the other ranks must not wait for it forever); training goes on and
    the fourth commits. ``async_warn``: the same with NeMo's asynchronous saves (the failure
    found when the save is finalized, steps later). ``stop``: ``+resume=latest`` continues from
    step 7 (checksums verified) and its first save, asynchronous, fails on every rank's writer
    (the directory copied just before)."""
    from nemo_gtp.recipes.launch import launch_fits

    tmp = tmp_path_factory.mktemp("disk_full")
    ckpts = tmp / "ckpts"
    saving = [f"+checkpoint.dir={ckpts}", "+checkpoint.every_n_train_steps=2"]
    warn = [
        *saving,
        "trainer.max_steps=8",
        "+checkpoint.on_save_error=warn",
        f"+callbacks.disk.target={DISK}",
        "+callbacks.disk.save=2",
        "+callbacks.disk.rank=1",
        f"+callbacks.disk.warnings_to={tmp / 'warnings.txt'}",
        f"+callbacks.meta.target={DISK}",
        "+callbacks.meta.save=3",
        "+callbacks.meta.rank=0",
        "+callbacks.meta.errno=EDQUOT",
        "+callbacks.meta.file=metadata.json",
        "+callbacks.meta.module=core",
    ]
    stop = [
        *saving,
        "trainer.max_steps=10",
        "strategy.ckpt_async_save=true",  # the failure surfaces in NeMo's finalize, later
        "+resume=latest",
        f"+callbacks.disk.target={DISK}",
        "+callbacks.disk.save=1",
        # each rank's first data file only: megatron writes two per rank from two writers, and
        # which fails first would be a race (the test names the file the error names)
        "+callbacks.disk.file=__*_0.distcp",
        f"+callbacks.disk.snapshot_to={tmp / 'before_stop'}",
    ]
    async_warn = [  # NeMo's default: the writers run beside training, the commit later
        f"+checkpoint.dir={tmp / 'async'}",
        "+checkpoint.every_n_train_steps=2",
        "trainer.max_steps=4",
        "strategy.ckpt_async_save=true",
        "+checkpoint.on_save_error=warn",
        f"+callbacks.disk.target={DISK}",
        "+callbacks.disk.save=1",
        "+callbacks.disk.rank=2",
        f"+callbacks.disk.warnings_to={tmp / 'warnings.txt'}",
    ]
    with pytest.raises(RuntimeError) as caught:
        launch_fits(TINY, {"warn": warn, "async_warn": async_warn, "stop": stop})
    return {"tmp": tmp, "ckpts": ckpts, "failure": str(caught.value)}


def test_disk_full_during_saves_warns_or_stops_and_keeps_what_was_committed(
    disk_full: dict,
) -> None:
    """The ``disk_full`` launch: ``warn`` trained on past two failed saves and committed the
    next; ``stop`` ended the run with one line naming the checkpoint, the errno, the file and
    the checkpoint kept; nothing staged is left, ``+resume=latest`` finds step 7, and every
    committed checkpoint is bit for bit what it was before the failed save."""
    from nemo_gtp.recipes.resume import latest_checkpoint

    tmp, ckpts = disk_full["tmp"], disk_full["ckpts"]
    line = next(x for x in disk_full["failure"].splitlines() if "CheckpointSaveError:" in x)
    assert f"saving checkpoint {ckpts / 'step=9'} failed: rank 0: ENOSPC " in line, line
    assert f"{ckpts / 'step=9'}/.weights.saving/__0_0.distcp' (and on rank 1, 2, 3)" in line
    assert line.endswith(f"the last committed checkpoint {ckpts / 'step=7'} is intact"), line
    warned = (tmp / "warnings.txt").read_text().splitlines()
    assert len(warned) == 3, warned
    for step, what in ((3, "rank 1: ENOSPC"), (5, "rank 0: EDQUOT")):
        assert f"saving checkpoint {ckpts / f'step={step}'} failed: {what}" in warned[step // 2 - 1]
    assert "metadata.json" in warned[1] and "Training continues" in warned[1]
    assert f"saving checkpoint {tmp / 'async' / 'step=1'} failed: rank 2: ENOSPC" in warned[2]
    assert warned[2].endswith(
        "no earlier checkpoint was committed. Training continues "
        "(checkpoint.on_save_error=warn); the next save tries again."
    )
    assert _committed(ckpts) == ["step=1", "step=7"]
    assert _committed(tmp / "async") == ["step=3"]
    assert not list(tmp.rglob(".weights.*"))
    assert latest_checkpoint(ckpts) == ckpts / "step=7"
    for name in ("step=1", "step=7"):
        _same_tree(ckpts / name, tmp / "before_stop" / name)  # weights/ and NeMo's context/
        assert (ckpts / name / "weights" / MANIFEST_NAME).is_file()
        assert verify_checkpoint(ckpts / name / "weights", checksums=True, shared=False)


def test_a_flipped_byte_or_a_truncated_file_is_named_before_loading(
    disk_full: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A copy of the committed step 7 with one bit flipped in rank 1's first data file:
    ``+resume`` (checksums, the recipes' default) stops before loading anything, naming the
    file, its recorded and found size and CRC-32, and step 1 to resume from; nothing of the
    copy is changed by the attempt; ``python -m nemo_gtp.checkpoint.show --verify`` names it
    too. A truncated file is caught by the sizes alone (the fast path every load takes)."""
    from nemo_gtp.recipes.launch import launch_fits

    copy = tmp_path / "ckpts"
    for name in ("step=1", "step=7"):
        shutil.copytree(disk_full["ckpts"] / name, copy / name)
    shard = copy / "step=7" / "weights" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    before = tmp_path / "before"
    shutil.copytree(copy, before)
    resume = [f"+resume={copy / 'step=7'}", "trainer.max_steps=9"]
    with pytest.raises(RuntimeError) as caught:
        launch_fits(TINY, {"corrupt": resume})
    failure = str(caught.value)
    assert f"CheckpointCorruptError: checkpoint {copy / 'step=7' / 'weights'} is damaged" in failure
    recorded = read_manifest(shard.parent)["__1_0.distcp"]  # type: ignore[index]
    size = shard.stat().st_size
    assert (
        f"__1_0.distcp: manifest {size} bytes crc32 {recorded.crc32}, found {size} bytes "
        f"crc32 {file_crc32(shard)}"
    ) in failure, failure[-3000:]
    assert f"+resume={copy / 'step=1'}" in failure
    _same_tree(copy, before)
    # the operator's check before a resume says the same
    from nemo_gtp.checkpoint.show import main as show

    assert show([str(copy / "step=7"), "--verify", "--filter", "nothing"]) == 1
    assert f"__1_0.distcp: manifest {size} bytes crc32 {recorded.crc32}" in capsys.readouterr().err
    assert show([str(copy / "step=1"), "--verify", "--filter", "nothing"]) == 0
    assert "manifest: all 11 files match" in capsys.readouterr().out

    with open(shard, "r+b") as f:  # the size fast path
        f.truncate(size - 1)
    with pytest.raises(CheckpointIncompleteError) as short:
        verify_checkpoint(shard.parent, checksums=False, shared=False)
    assert short.value.damaged == {"__1_0.distcp": (size - 1, size)}
