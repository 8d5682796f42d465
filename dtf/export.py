"""Export a run's checkpoint as a Hugging Face folder, which `AutoModel*.from_pretrained(folder)`
loads: `python -m dtf.export <run dir | checkpoint> [--out DIR] [--dtype bf16|fp32]`.

A run directory exports its newest committed checkpoint; a checkpoint folder (step_*) itself.
The folder holds the run's `hf/` files (config.json, generation_config.json, the tokenizer's, as
dtf.models.hf wrote them at the start of the run) and the weights as `model.safetensors` (sharded
above --max-shard-size, with its index). From any strategy's checkpoint at any world size, in this
one process, one tensor read at a time (dtf.train.hf_export). A model that is not a transformers
model (no `hf/` folder) exports its weights alone, under dtf's own names.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from dtf.errors import UserError


@dataclass(frozen=True)
class Target:
    """A committed checkpoint and the run directory that holds it (its hf/ folder)."""

    checkpoint: Path
    run_dir: Path


def _run_dir_of(checkpoint: Path) -> Path:
    """The nearest folder above a checkpoint with an hf/ folder or a .hydra/ record; else the
    folder above its checkpoints folder (dtf's layout: <run_dir>/checkpoints/step_*)."""
    from dtf.train.hf_export import HF_DIR

    for parent in checkpoint.parents:
        if (parent / HF_DIR).is_dir() or (parent / ".hydra").is_dir():
            return parent
    return checkpoint.parent.parent


def locate(target: str | Path) -> Target:
    """A run directory (its newest committed checkpoint) or a checkpoint folder (step_*), its
    checksums verified; UserError (one line) when it is neither, or has no committed checkpoint."""
    from dtf.train.checkpoint import MARKER, is_complete
    from dtf.train.hf_export import HF_DIR, checked, checkpoints_under

    path = Path(target).resolve()
    neither = f"{target} is neither a run directory nor a checkpoint: give a run directory or one of its step_* folders"
    if not path.is_dir():
        raise UserError(neither)
    if (path / MARKER).exists() or path.name.startswith("step_"):
        complete, why = is_complete(path)
        if not complete:
            raise UserError(
                f"{target} is not a committed checkpoint ({why}): give a run directory or a committed step_*"
            )
        return Target(checked(path), _run_dir_of(path))
    found = list(checkpoints_under(path))
    if found:
        return Target(checked(max(found, key=lambda c: c.name)), path)
    saved_some = any(folder.is_dir() and any(folder.glob("step_*")) for folder in path.iterdir())
    if saved_some or (path / ".hydra").is_dir() or (path / HF_DIR).is_dir():
        raise UserError(
            f"{target} has no committed checkpoint: export a run that saved one (checkpoint.at_end=true, the default), "
            "or give a committed step_* folder"
        )
    raise UserError(neither)


def main(argv: list[str] | None = None) -> int:
    from dtf.results import EXIT_USER_ERROR

    parser = argparse.ArgumentParser(
        prog="python -m dtf.export",
        description=(
            "Export a run's checkpoint as a Hugging Face folder (config.json, tokenizer, model.safetensors) that "
            "AutoModel*.from_pretrained(folder) loads; a model that is not a transformers model exports "
            "model.safetensors alone."
        ),
    )
    parser.add_argument("target", help="a run directory (its newest committed checkpoint) or a checkpoint (step_*)")
    parser.add_argument("--out", help="a new or empty folder (default: <run dir>/hf_export)")
    parser.add_argument(
        "--dtype", choices=["bf16", "fp32"], help="convert floating-point tensors to it (default: as stored)"
    )
    parser.add_argument(
        "--max-shard-size",
        default=None,
        help='above it the weights are split in shards with an index (default: transformers\' "50GB"; e.g. 5GB, 200MB)',
    )
    args = parser.parse_args(argv)
    try:
        from dtf.train.hf_export import DTYPES, EXPORT_DIR, MAX_SHARD_SIZE, export_checkpoint

        found = locate(args.target)
        out = Path(args.out).resolve() if args.out else found.run_dir / EXPORT_DIR
        size = args.max_shard_size or MAX_SHARD_SIZE
        dtype = DTYPES[args.dtype] if args.dtype else None
        exported = export_checkpoint(found.checkpoint, found.run_dir, out, dtype, _shard_size(size))
    except UserError as e:
        print(f"dtf: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    print(f"dtf: {exported.describe()}", flush=True)
    return 0


def _shard_size(text: str) -> int:
    """--max-shard-size in bytes, read as huggingface_hub reads it ("5GB", "200MB", a number)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        return int(text) if text.isdigit() else parse_size_to_int(text)
    except ValueError:
        raise UserError(f"--max-shard-size {text}: give a size such as 5GB, 200MB or a number of bytes") from None


if __name__ == "__main__":
    from dtf.export import main as _main

    sys.exit(_main())
