"""model=hf: any Hugging Face transformers model, by its Auto class and a local folder or a Hub id,
with its pretrained weights (or transformers' initialisation from its config alone).

The transformers model is the attribute `hf`, so dtf's state-dict keys (checkpoints, model.pt) are
"hf." + transformers' own. Built eagerly it is from_pretrained's model. Built on the meta device
(strategy.meta_init, the memory check, and always under the strategies that shard parameters: see
dtf.models.for_shards) it is the model's skeleton from its config; the strategy allocates
it (each rank its shards), initialises it (dtf.strategy.base.initialise: reset_parameters, here
transformers' own initialisation, which also computes the buffers no file holds) and then calls
load_pretrained_in_place: where every rank can read the folder's safetensors files, each reads the
slices of them its shards hold (no process holds the whole model); otherwise rank 0 reads the files
with from_pretrained and every rank receives its part of each tensor, one tensor at a time, through
torch.distributed.checkpoint's state-dict API. Only rank 0 ever holds the whole model.

transformers is imported inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtf.errors import UserError
from dtf.models import building_for_shards

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# The files from_pretrained reads weights from, safetensors first (transformers.utils' names).
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")
GENERATION_FILE = "generation_config.json"
IGNORE_INDEX = -100  # transformers' label for a position that takes no loss


class HFModel(nn.Module):
    """A transformers model (self.hf) by its Auto class. Called with keyword arguments (a dict
    batch: model(**batch)) it returns transformers' output object; called with one tensor (dtf's
    supervised step: model(inputs)) it returns the output's logits."""

    def __init__(
        self,
        name_or_path: str,
        auto_class: str = "AutoModelForCausalLM",
        pretrained: bool = True,
        dtype: str | None = None,
    ) -> None:
        super().__init__()
        self.name_or_path = str(name_or_path)
        self.pretrained = pretrained
        self.dtype = _torch_dtype(dtype)
        config = load_config(self.name_or_path)
        self.auto = auto_model_class(auto_class, config)
        if pretrained:
            check_weights(self.name_or_path)
        # Weights that come from files go into the shards of a sharding strategy, never whole into every rank.
        on_meta = torch.get_default_device().type == "meta" or (pretrained and building_for_shards())
        if pretrained and not on_meta:
            self.hf = self.auto.from_pretrained(self.name_or_path, config=config, dtype=self.dtype)
        else:
            with torch.device("meta") if on_meta else contextlib.nullcontext():
                self.hf = self.auto.from_config(config, dtype=self.dtype)
            # transformers 5.0 built on meta leaves tied weights apart (later versions tie them): the
            # memory check would count them twice, and the strategy would shard them as two tensors.
            self.hf.tie_weights()
            if pretrained and self.hf.can_generate() and has_file(self.name_or_path, GENERATION_FILE):
                from transformers import GenerationConfig  # the folder's, as from_pretrained takes it

                self.hf.generation_config = GenerationConfig.from_pretrained(self.name_or_path)
        self.takes_use_cache = "use_cache" in inspect.signature(self.hf.forward).parameters
        # Built on meta with pretrained weights: they come in load_pretrained_in_place, once the
        # strategy has allocated the model (or its shards).
        self.weights_pending = pretrained and on_meta

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training and self.takes_use_cache:
            # No key/value cache in training: it is of use to generation alone, and activation
            # checkpointing's recomputation would append to it a second time (transformers 5.0).
            kwargs.setdefault("use_cache", False)
        if len(args) == 1 and set(kwargs) <= {"use_cache"}:
            return self.hf(args[0], **kwargs).logits
        return self.hf(*args, **kwargs)

    @property
    def block_classes(self) -> list[str]:
        """The classes transformers keeps whole when it splits the model over devices (its
        `_no_split_modules`, gathered over its sub-models): dtf's blocks where the user names none
        (FSDP's units, trainer.compile=blocks; see dtf.models.blocks.find_blocks)."""
        return sorted(getattr(self.hf, "_no_split_modules", None) or [])

    @property
    def step_fn(self) -> Callable[..., Any]:
        """The step this model trains with unless trainer.step_fn names another (dtf.train.loop)."""
        return hf_step

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """transformers' initialisation of the whole model, buffers that no file holds included (the
        rotary embeddings' frequencies, BERT's position ids). dtf.strategy.base.initialise calls
        every module's reset_parameters innermost first after allocating a model built on meta, so
        this one, the outermost, has the last word, as at construction."""
        for module in self.hf.modules():  # transformers skips what it marked initialised at construction
            module._is_hf_initialized = False
        self.hf.initialize_weights()
        self.hf.tie_weights()

    def load_pretrained_in_place(self) -> None:
        """The pretrained weights into this model, allocated and initialised after a build on meta
        (whole or sharded). Rank 0 reads the files; every rank receives its part of each tensor,
        one tensor at a time. Collective where a process group runs; nothing to do when the weights
        came with the build or pretrained=false."""
        if not self.weights_pending:
            return
        if dist.is_available() and dist.is_initialized():
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            shapes = self._shard_readable_shapes()
            if _everywhere(shapes is not None):
                assert shapes is not None
                self._load_by_shard(shapes)
            else:
                full: dict[str, Any] = dict(self._read_pretrained()) if dist.get_rank() == 0 else {}
                options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
                set_model_state_dict(self, full, options=options)
        else:
            self.load_state_dict(self._read_pretrained())
        self.weights_pending = False

    def _shard_readable_shapes(self) -> dict[str, list[int]] | None:
        """The shapes of the tensors in the folder's safetensors files where this rank can read its
        part of every tensor straight from them: a local folder (a Hub id is downloaded by rank 0
        alone) whose files hold each of the model's tensors under transformers' own name and shape,
        a tied one at least once; else None. Where from_pretrained would convert keys or fill in
        tensors, rank 0 loads the model instead."""
        shapes = _safetensors_shapes(Path(self.name_or_path).expanduser())
        if not shapes:
            return None
        tensors = self.hf.state_dict(keep_vars=True)
        in_files = {id(t) for key, t in tensors.items() if key in shapes}
        for key, tensor in tensors.items():
            if key in shapes:
                if list(tensor.shape) != shapes[key]:
                    return None
            elif id(tensor) not in in_files:  # neither in the files nor tied to a tensor that is
                return None
        return shapes

    def _load_by_shard(self, shapes: dict[str, list[int]]) -> None:
        """Every rank reads the slices of the files that make its shards (torch.distributed.checkpoint's
        reader of Hugging Face safetensors: safetensors' get_slice), one file at a time: no process
        holds the whole model."""
        from torch.distributed.checkpoint import HuggingFaceStorageReader
        from torch.distributed.checkpoint import load as dcp_load
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            set_model_state_dict,
        )

        mine = get_model_state_dict(self)  # this rank's shards (DTensors), or whole tensors
        wanted = {k.removeprefix("hf."): v for k, v in mine.items() if k.removeprefix("hf.") in shapes}
        dcp_load(wanted, storage_reader=HuggingFaceStorageReader(str(Path(self.name_or_path).expanduser())))
        loaded = {f"hf.{k}": v for k, v in wanted.items()}
        set_model_state_dict(self, loaded, options=StateDictOptions(strict=False))  # the tied ones follow

    def _read_pretrained(self) -> dict[str, torch.Tensor]:
        """The whole model's pretrained weights under this module's keys, as from_pretrained loads
        them (its key conversions, shards, tied weights), on the CPU."""
        loaded = self.auto.from_pretrained(self.name_or_path, dtype=self.dtype)
        return {f"hf.{k}": v for k, v in loaded.state_dict().items()}


def _safetensors_shapes(folder: Path) -> dict[str, list[int]] | None:
    """The shape of each tensor in the folder's safetensors files (their headers alone), as
    torch.distributed.checkpoint's reader sees them; None where there are none, or where a name
    is in two files (the index would choose: from_pretrained's way)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    shapes: dict[str, list[int]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open's handle is no mapping)
                if key in shapes:
                    return None
                shapes[key] = list(f.get_slice(key).get_shape())
    return shapes or None


def _everywhere(ok: bool) -> bool:
    """Whether ok holds on every rank (a collective; on the side gloo group where there is one)."""
    from dtf.dist.env import side_group

    answers: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(answers, ok, group=side_group())
    return all(answers)


def _torch_dtype(dtype: str | None) -> torch.dtype:
    if dtype is None:
        return torch.get_default_dtype()  # float32 unless the user's code changed torch's default
    if dtype not in DTYPES:
        raise UserError(f"model.dtype={dtype} is invalid: use one of {', '.join(DTYPES)}, or null (float32)")
    return DTYPES[dtype]


def load_config(name_or_path: str) -> Any:
    """transformers' config of a local folder or a Hub id; UserError when there is none."""
    from transformers import AutoConfig

    key = f"model.name_or_path={name_or_path}"
    folder = Path(name_or_path).expanduser()
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise UserError(
            f"{key}: the folder has no config.json: give a folder that save_pretrained wrote (config.json beside "
            "the weights), or a Hugging Face Hub id"
        )
    if not folder.exists() and (name_or_path.startswith(("/", "./", "../", "~")) or name_or_path.count("/") > 1):
        raise UserError(f"{key}: no such folder: give a folder that save_pretrained wrote, or a Hugging Face Hub id")
    try:
        return AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as e:  # not on the Hub, no network, a config transformers cannot read
        reason = " ".join(str(e).split())
        raise UserError(
            f"{key}: transformers cannot load its config ({reason[:300]}): give a local folder with config.json, "
            "or a Hub id reachable from here"
        ) from None


def auto_model_classes() -> dict[str, Any]:
    """transformers' Auto model classes by name (AutoModel, AutoModelForCausalLM, ...)."""
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    return {
        name: cls
        for name, cls in vars(modeling_auto).items()
        if isinstance(cls, type)
        and issubclass(cls, _BaseAutoModelClass)
        and getattr(cls, "_model_mapping", None) is not None  # (not the base classes)
    }


def auto_model_class(name: str, config: Any) -> Any:
    """The Auto class of that name, where it knows the config's model type; UserError otherwise,
    naming the Auto classes that do (transformers' auto mappings tell)."""
    classes = auto_model_classes()
    if name not in classes:
        close = difflib.get_close_matches(name, sorted(classes), n=1)
        hint = f"did you mean {close[0]}?" if close else "e.g. AutoModelForCausalLM, AutoModelForSequenceClassification"
        raise UserError(f"model.auto_class={name} is not a transformers Auto model class ({hint})")
    if type(config) not in classes[name]._model_mapping:
        fitting = sorted(n for n, cls in classes.items() if type(config) in cls._model_mapping)
        raise UserError(
            f"model.auto_class={name} does not build a {config.model_type} model (its config.json): use one of "
            f"{', '.join(fitting) or 'none (no Auto class knows this model type)'}"
        )
    return classes[name]


def check_weights(name_or_path: str) -> None:
    """A local folder holds weights for from_pretrained (a Hub id is from_pretrained's to check)."""
    folder = Path(name_or_path).expanduser()
    if folder.is_dir() and not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise UserError(
            f"model.name_or_path={name_or_path}: the folder holds no weights ({', '.join(WEIGHT_FILES)}): give the "
            "folder save_pretrained wrote them to, or set model.pretrained=false to start from the config's "
            "initialisation"
        )


def hf_step(model: nn.Module, batch: Any, loss_fn: Callable[..., torch.Tensor]) -> Any:
    """A step for transformers models. A dict batch goes in as keyword arguments (model(**batch));
    where the model computes a loss (the batch holds its labels), that loss is the step's, counted
    over the label positions that enter it, so dtf's averages across batches and ranks weigh tokens,
    not sequences; otherwise the output's logits and batch["labels"] go to dtf's loss section. Any
    other batch is dtf's supervised step: (inputs, targets), the loss of model(inputs) against targets."""
    if not isinstance(batch, Mapping):
        inputs, targets = batch
        return loss_fn(model(inputs), targets)
    outputs = model(**batch)
    labels = batch.get("labels")
    loss = getattr(outputs, "loss", None)
    if loss is not None:
        if labels is None:  # a loss from other inputs: counted by sequences
            return loss
        metrics = getattr(loss_fn, "metrics", None)  # the run's metrics (dtf.train.metrics), if any
        if metrics is not None:  # they judge what the loss judged; one line where they cannot take it
            metrics.update(outputs.logits, labels)
        count = label_count(labels, shifted=_loss_type(model) == "ForCausalLM")
        if count == 0:  # padding alone (data=text's last steps): transformers' mean over no label is NaN
            loss = outputs.logits.sum() * 0.0  # a zero that counts nothing and gives zero gradients
        return loss, count
    if labels is None:
        raise UserError(
            f"a dict batch without labels (its keys: {', '.join(map(str, batch))}): the data must give "
            "'labels' (token batches: the input ids, -100 where no loss is taken)"
        )
    return loss_fn(outputs.logits, labels)


def label_count(labels: torch.Tensor, shifted: bool) -> int:
    """How many label positions enter transformers' loss: those that are not -100 (a causal LM
    predicts each token from those before it, so its first label never enters); float labels
    (regression) count one per sample."""
    if labels.is_floating_point():
        return int(labels.shape[0])
    if shifted:
        labels = labels[..., 1:]
    return int((labels != IGNORE_INDEX).sum())


def _loss_type(model: nn.Module) -> str | None:
    """transformers' loss type of the model under dtf's wrappers (DDP's .module)."""
    inner = getattr(model, "module", model)
    hf = getattr(inner, "hf", inner)
    return getattr(hf, "loss_type", None)


def write_hf_files(model: nn.Module, directory: str | os.PathLike[str]) -> bool:
    """What save_pretrained writes besides the weights (config.json, generation_config.json where
    the model generates) and the tokenizer's files where name_or_path has a tokenizer, into
    directory; each file whole or not at all. False, and nothing written, for a model that is not
    an HFModel."""
    if not isinstance(model, HFModel):
        return False
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target, prefix=".writing-") as tmp:
        model.hf.config.save_pretrained(tmp)
        if model.hf.can_generate() and model.hf.generation_config is not None:
            model.hf.generation_config.save_pretrained(tmp)
        if has_tokenizer(model.name_or_path):
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(model.name_or_path).save_pretrained(tmp)
        for written in Path(tmp).iterdir():
            os.replace(written, target / written.name)
    return True


def has_file(name_or_path: str, name: str) -> bool:
    """Whether a local folder or a Hub repository holds the file."""
    from transformers.utils.hub import cached_file

    return cached_file(name_or_path, name, _raise_exceptions_for_missing_entries=False) is not None


def has_tokenizer(name_or_path: str) -> bool:
    return any(has_file(name_or_path, name) for name in TOKENIZER_FILES)
