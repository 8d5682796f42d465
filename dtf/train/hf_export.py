"""A checkpoint as a Hugging Face folder that `AutoModel*.from_pretrained(folder)` loads: the
run's `hf/` files (config.json, generation_config.json, the tokenizer's) and the weights as
`model.safetensors`, sharded above a size with `model.safetensors.index.json` (transformers'
convention). Any strategy's checkpoint at any world size, in one process without a process group.

Memory: DCP's metadata lists every tensor's global shape and dtype, so the shards are planned on
meta tensors (huggingface_hub's split_torch_state_dict_into_shards) and each shard is then read
tensor by tensor (DCP reassembles a tensor from whatever chunks the ranks saved) and written:
at most one shard's tensors are held at once, plus the one being read and what safetensors needs
to write the shard (transformers' default shard size, 50GB, or --max-shard-size, bounds it).

Keys: dtf's model state is DCP's `model.<name>`; a transformers model (dtf.models.hf.HFModel) holds
it as `hf`, so its names are `hf.<transformers' own name>`, written without the prefix. Tied
weights are written as save_pretrained writes them (the tied copy dropped): the model's skeleton,
built on the meta device from config.json, tells which, with transformers' own function.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dtf.errors import UserError
from dtf.heartbeat import Heartbeat
from dtf.train.checkpoint import BEST_FILE, W, _SafePlanner, committed, read_marker, reader, verify
from dtf.train.checkpoint_store import Where

if TYPE_CHECKING:
    from huggingface_hub import StateDictSplit

HF_DIR = "hf"  # <run_dir>/hf/: what save_pretrained writes besides the weights, and the tokenizer
EXPORT_DIR = "hf_export"  # checkpoint.export_hf: the final checkpoint's export
BEST_EXPORT_DIR = "hf_export_best"  # ... and the best one's, with checkpoint.keep_best
MAX_SHARD_SIZE = "50GB"  # transformers' save_pretrained default
WEIGHTS = "model{suffix}.safetensors"  # transformers' SAFE_WEIGHTS_NAME with huggingface_hub's {suffix}
INDEX = "model.safetensors.index.json"  # transformers' SAFE_WEIGHTS_INDEX_NAME
_MODEL = "model."  # dtf's model state inside a checkpoint (its app_state["model"])
_HF = "hf."  # HFModel's attribute holding the transformers model
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Exported:
    """What an export wrote."""

    out: Path
    checkpoint: Where
    step: int
    num_tensors: int
    shards: list[str]  # the safetensors files, in order
    hf_files: list[str]  # copied from <run_dir>/hf/ (none: not a transformers model)

    def describe(self) -> str:
        """The one line the export prints."""
        weights = self.shards[0] if len(self.shards) == 1 else f"{len(self.shards)} shards and {INDEX}"
        what = f"{weights} ({self.num_tensors} tensors)"
        if not self.hf_files:
            return (
                f"exported {self.checkpoint} (step {self.step}) to {self.out}: {what} alone, under dtf's own names "
                f"(the model is not a transformers model: its run dir has no {HF_DIR}/ folder)"
            )
        return (
            f"exported {self.checkpoint} (step {self.step}) to {self.out}: {what}, {', '.join(self.hf_files)}; "
            f"load it with from_pretrained('{self.out}')"
        )


def model_tensors(checkpoint: Where) -> dict[str, TensorStorageMetadata]:
    """The model's tensors in a checkpoint (dtf's names, without DCP's `model.`), from its
    metadata alone (read by dtf's restricted unpickler), in the order they were saved."""
    metadata = reader(checkpoint).read_metadata()
    return {
        key[len(_MODEL) :]: meta
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(_MODEL) and isinstance(meta, TensorStorageMetadata)
    }


def skeleton(hf_dir: Path) -> Any:
    """The transformers model that config.json's "architectures" names, built on the meta device
    (nothing allocated): its names, its tied weights and its weight conversions are the export's."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(hf_dir)
    names = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, names[0], None) if names else None
    if model_class is None:
        raise UserError(
            f'{hf_dir / "config.json"} names no transformers model class in its "architectures" '
            f'({names or "none"}): give it the class the model was trained as (e.g. ["LlamaForCausalLM"])'
        )
    with torch.device("meta"):
        return model_class(config)


def _hf_names(
    checkpoint: Where, config_file: Path, model: Any, stored: dict[str, TensorStorageMetadata]
) -> dict[str, str]:
    """transformers' name -> dtf's, for the tensors save_pretrained would write (tied copies and
    the model's _keys_to_ignore_on_save left out), in the model's order; a checkpoint that does
    not fit the model (its skeleton) is refused in one line."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    what = f"{config_file} ({type(model).__name__})"
    advice = f"export a checkpoint of the run whose {HF_DIR}/ folder this is"
    expected = model.state_dict()
    for key in getattr(model, "_keys_to_ignore_on_save", None) or []:
        expected.pop(key, None)
    ours = {name[len(_HF) :]: name for name in stored if name.startswith(_HF)}
    misfit = next((name for name in stored if not name.startswith(_HF) or name[len(_HF) :] not in expected), None)
    if misfit is not None:
        raise UserError(
            f"checkpoint {checkpoint} does not fit {what}: its tensor {misfit} is not the model's; {advice}"
        )
    kept = remove_tied_weights_from_state_dict(expected, model)  # what save_pretrained keeps of tied weights
    missing = next((name for name in kept if name not in ours), None)
    if missing is not None:
        raise UserError(f"checkpoint {checkpoint} does not fit {what}: it lacks {_HF}{missing}; {advice}")
    for name, tensor in kept.items():
        shape = list(stored[ours[name]].size)
        if shape != list(tensor.shape):
            raise UserError(
                f"checkpoint {checkpoint} does not fit {what}: {_HF}{name} has the shape {shape} there and "
                f"{list(tensor.shape)} in the model; {advice}"
            )
    return {name: ours[name] for name in kept}


def _read(checkpoint: Where, name: str, meta: TensorStorageMetadata) -> torch.Tensor:
    """One whole tensor of the model, as stored: DCP fills it from the chunks the ranks saved
    (in this process alone, whatever group there is)."""
    state = {_MODEL + name: torch.empty(meta.size, dtype=meta.properties.dtype)}
    with warnings.catch_warnings():  # DCP's note that it loads in a single process: what is meant here
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, storage_reader=reader(checkpoint), planner=_SafePlanner(), no_dist=True)
    return state[_MODEL + name]


def _converted(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    return tensor.contiguous()


def _copy_hf_files(hf_dir: Path, out: Path, dtype: torch.dtype | None) -> list[str]:
    """<run_dir>/hf/ as it is; config.json's dtype says what the weights now are (as save_pretrained's)."""
    copied = []
    for path in sorted(hf_dir.iterdir()):
        if path.is_dir():
            shutil.copytree(path, out / path.name)
        else:
            shutil.copy2(path, out / path.name)
        copied.append(path.name)
    if dtype is not None:
        config = json.loads((out / "config.json").read_text())
        config["dtype"] = str(dtype).removeprefix("torch.")
        config.pop("torch_dtype", None)  # transformers 4's name for it
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return copied


def _shards(
    checkpoint: Where, hf_dir: Path | None, model: Any, dtype: torch.dtype | None, max_shard_size: int | str
) -> tuple[StateDictSplit, dict[str, tuple[str, TensorStorageMetadata]], int]:
    """huggingface_hub's plan of the shards (planned on meta tensors: their sizes as written),
    the written name -> (dtf's name, its metadata), and the number of parameters."""
    from huggingface_hub import split_torch_state_dict_into_shards

    stored = model_tensors(checkpoint)
    if not stored:
        raise UserError(
            f"checkpoint {checkpoint} holds no model tensors: export a checkpoint that dtf's training saved"
        )
    if hf_dir is None:
        if all(name.startswith(_HF) for name in stored):
            raise UserError(
                f"checkpoint {checkpoint} holds a transformers model (hf.* tensors), but no {HF_DIR}/ folder (its "
                "config.json, tokenizer) is in the run directory above it: give the run directory, or export from "
                f"where the checkpoint's run directory with its {HF_DIR}/ folder is"
            )
        names = {name: name for name in stored}
        num_parameters = sum(int(torch.Size(meta.size).numel()) for meta in stored.values())
    else:
        names, num_parameters = _hf_names(checkpoint, hf_dir / "config.json", model, stored), model.num_parameters()
    written = {name: (ours, stored[ours]) for name, ours in names.items()}
    planned = {
        name: torch.empty(meta.size, dtype=_out_dtype(meta, dtype), device="meta")
        for name, (_, meta) in written.items()
    }
    split = split_torch_state_dict_into_shards(planned, filename_pattern=WEIGHTS, max_shard_size=max_shard_size)
    return split, written, num_parameters


def _out_dtype(meta: TensorStorageMetadata, dtype: torch.dtype | None) -> torch.dtype:
    stored = meta.properties.dtype
    return dtype if dtype is not None and stored.is_floating_point else stored


def export_checkpoint(
    checkpoint: Where,
    run_dir: Path,
    out: Path,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = MAX_SHARD_SIZE,
    replace: bool = False,
    beat: Heartbeat | None = None,
) -> Exported:
    """Writes the export of a committed checkpoint to out (made whole in a sibling folder, then
    renamed: never half written). An out folder that holds anything is refused, unless replace
    (the export at the end of training replaces the one before). dtype: floating tensors
    converted to it (None: as stored). beat: a rank's heartbeat, marked at every tensor (the
    driver's stall check sees the export progress)."""
    from safetensors.torch import save_file

    if out.exists() and not replace and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} is not empty: give a new or empty folder (--out)")
    hf_dir = run_dir / HF_DIR if (run_dir / HF_DIR / "config.json").is_file() else None
    model = skeleton(hf_dir) if hf_dir is not None else None
    split, written, num_parameters = _shards(checkpoint, hf_dir, model, dtype, max_shard_size)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        weight_map: dict[str, str] = {}
        for filename, names in split.filename_to_tensors.items():
            shard = {}
            for name in names:  # one tensor read at a time; the shard's converted tensors kept for safetensors
                ours, meta = written[name]
                shard[name] = _converted(_read(checkpoint, ours, meta), dtype)
                if beat is not None:
                    beat.mark(f"exporting {name}")
            if model is not None:  # as save_pretrained does for offloaded weights: shard by shard
                from transformers.core_model_loading import revert_weight_conversion

                shard = revert_weight_conversion(model, shard)  # transformers' saved layout, where it differs
            weight_map.update(dict.fromkeys(shard, filename))
            save_file(shard, str(partial / filename), metadata={"format": "pt"})
            del shard
        if split.is_sharded:  # as save_pretrained writes it
            index = {"metadata": {"total_parameters": num_parameters, **split.metadata}, "weight_map": weight_map}
            (partial / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        copied = _copy_hf_files(hf_dir, partial, dtype) if hf_dir is not None else []
        if out.exists():  # the export before it (replace), or an empty folder
            shutil.rmtree(out)
        os.replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    step = read_marker(checkpoint).step
    return Exported(out, checkpoint, step, len(weight_map), list(split.filename_to_tensors), copied)


# ---- which checkpoint ---------------------------------------------------------------------


def checkpoints_under(run_dir: Path) -> Iterator[Path]:
    """The committed checkpoints of a run directory, in any folder of it (checkpoint.dir)."""
    for folder in sorted(run_dir.iterdir()):
        if folder.is_dir():
            yield from committed(folder)


def checked(checkpoint: W) -> W:
    """The checkpoint, once every file's checksum is as committed; else one line."""
    ok, why = verify(checkpoint)
    if not ok:
        raise UserError(f"checkpoint {checkpoint} is not intact ({why}): export another one (give its step_* folder)")
    return checkpoint


def export_at_end(run_dir: Path, checkpoints: Where, keep_best: bool, beat: Heartbeat | None = None) -> list[Exported]:
    """checkpoint.export_hf, on rank 0 once the final checkpoint is committed: the newest one to
    <run_dir>/hf_export/, and with checkpoint.keep_best the best one (best.json's first) to
    <run_dir>/hf_export_best/, each replacing the export before it. Prints a line for each."""
    newest = committed(checkpoints)[:1]
    if not newest:
        raise UserError(f"checkpoint.export_hf: no committed checkpoint in {checkpoints}: keep checkpoint.at_end=true")
    done = [export_checkpoint(checked(newest[0]), run_dir, run_dir / EXPORT_DIR, replace=True, beat=beat)]
    if keep_best:
        best_file = checkpoints / BEST_FILE
        best = json.loads(best_file.read_text())["best"] if best_file.is_file() else []
        if best:
            path = checked(checkpoints / best[0]["path"])
            done.append(export_checkpoint(path, run_dir, run_dir / BEST_EXPORT_DIR, replace=True, beat=beat))
        else:
            print(
                f"dtf: checkpoint.export_hf: no evaluation chose a best checkpoint, so there is no {BEST_EXPORT_DIR}/",
                flush=True,
            )
    for exported in done:
        print(f"dtf: {exported.describe()}", flush=True)
    return done
