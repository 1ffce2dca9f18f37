"""Print what a checkpoint holds: ``python -m nemo_gtp.checkpoint.show <dir>`` (design §1.8).

``<dir>`` is a ``torch_dist`` directory or a NeMo checkpoint (``<dir>/weights``), so the path
given to ``+resume=`` works as it is.

Shows the layout it was saved with (:mod:`nemo_gtp.checkpoint.layout`; "not recorded" for a
checkpoint nemo_gtp did not write), then every tensor key with its global shape and dtype, and
the sharded objects. Reads only the checkpoint's metadata files; no process group is needed.
``--verify`` first checks every file against the manifest of its commit (size and CRC-32;
exit 1 naming a damaged file).

Example::

    $ python -m nemo_gtp.checkpoint.show ckpt/step100 --filter linear_fc1
    checkpoint: /abs/ckpt/step100
    layout: TP2 x GTP2 x DP1 (PP1, CP1; world 4), pad_for_alignment=16
    GTP padding (TP-local rows -> padded rows):
      decoder.layers.mlp.linear_fc1.weight  40 -> 64
    tensors (4 of 61):
      decoder.layers.mlp.linear_fc1.bias    (2, 80)      torch.float32
      ...
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from nemo_gtp.checkpoint.io import resolve_checkpoint
from nemo_gtp.checkpoint.layout import read_layout
from nemo_gtp.checkpoint.manifest import (
    CheckpointCorruptError,
    CheckpointIncompleteError,
    read_manifest,
    verify_checkpoint,
)


def weights_dir(checkpoint_dir: str | Path) -> Path:
    """The committed ``torch_dist`` directory of a checkpoint: ``checkpoint_dir`` itself, or its
    ``weights/`` for a NeMo checkpoint (what ``+resume=`` takes)."""
    path = Path(checkpoint_dir)
    if (path / "weights").is_dir():
        path = path / "weights"
    return resolve_checkpoint(path)


def verify(checkpoint_dir: str | Path) -> str:
    """One line on a checkpoint's files against the manifest of its commit (sizes and CRC-32,
    :func:`~nemo_gtp.checkpoint.manifest.verify_checkpoint`); raises naming a damaged file."""
    path = weights_dir(checkpoint_dir)
    if not verify_checkpoint(path, checksums=True, shared=True):  # no group here: all files
        return "manifest: none (written without one): nothing to verify"
    count = len(read_manifest(path) or {})
    return f"manifest: all {count} files match their recorded size and crc32"


def describe(checkpoint_dir: str | Path, key_filter: str = "") -> dict:
    """Layout, tensors (key -> (global shape, dtype)) and object keys of a checkpoint."""
    from megatron.core.dist_checkpointing import load_tensors_metadata
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    path = weights_dir(checkpoint_dir)
    tensors = {
        key: (tuple(meta.global_shape), str(meta.dtype))
        for key, meta in sorted(load_tensors_metadata(str(path)).items())
    }
    objects = sorted(k for k in load_sharded_metadata(str(path)) if k not in tensors)
    layout = read_layout(path)
    return {
        "path": str(path),
        "filter": key_filter,
        "layout": None if layout is None else layout.to_dict(),
        "layout_line": "not recorded" if layout is None else layout.describe(),
        "num_tensors": len(tensors),
        "tensors": {k: v for k, v in tensors.items() if key_filter in k},
        "objects": [k for k in objects if key_filter in k],
    }


def render(info: dict) -> str:
    """Human-readable form of :func:`describe`'s result."""
    lines = [f"checkpoint: {info['path']}", f"layout: {info['layout_line']}"]
    padded = {
        k: v
        for k, v in ((info["layout"] or {}).get("padded_rows") or {}).items()
        if info["filter"] in k
    }
    if padded:
        lines.append("GTP padding (TP-local rows -> padded rows):")
        width = max(map(len, padded))
        lines += [f"  {k:<{width}}  {rows} -> {pad}" for k, (rows, pad) in padded.items()]
    tensors = info["tensors"]
    lines.append(f"tensors ({len(tensors)} of {info['num_tensors']}):")
    if tensors:
        width = max(map(len, tensors))
        lines += [
            f"  {k:<{width}}  {str(shape):<14} {dtype}" for k, (shape, dtype) in tensors.items()
        ]
    lines.append(f"objects ({len(info['objects'])}):")
    lines += [f"  {k}" for k in info["objects"]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m nemo_gtp.checkpoint.show", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "checkpoint_dir",
        help="a torch_dist checkpoint directory, or a NeMo checkpoint holding one in weights/ "
        "(the path +resume= takes, e.g. ckpts/step=9)",
    )
    parser.add_argument("--filter", default="", help="only keys containing this substring")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="check every file's size and CRC-32 against the manifest of the commit first "
        "(exit 1 naming a damaged file)",
    )
    args = parser.parse_args(argv)
    if args.verify:
        try:
            print(verify(args.checkpoint_dir))
        except (CheckpointCorruptError, CheckpointIncompleteError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        except FileNotFoundError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    try:
        info = describe(args.checkpoint_dir, args.filter)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=2) if args.json else render(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
