"""ZeRO stage 1: DDP averages the gradients; each rank steps one equal, element-wise slice of the
parameters with the user's optimizer; the updated slices are all-gathered.

As in DeepSpeed's stage 1, the parameters are laid out in flat buffers (one per chunk of the
model's units, dtype and device), each padded to a multiple of the world size and cut into equal
contiguous slices, one per rank. The model's parameters become views of the buffers, so the
all-gathers write the new values straight into them. The units are the root and its blocks, as
FSDP shards them, in chunks of a few MB: the next forward need not wait for the whole model's
all-gather, as each chunk's runs async and each unit's forward pre-hook waits for its own chunk's
(ParameterGathers). A slice crosses parameter
boundaries: the part of one parameter inside it (a *piece*) is a 1-D view of the buffer, its
gradient a view of the parameter's (already averaged) gradient. The local optimizer, the user's
class with one group per user group and the same settings, steps the pieces: every rank holds
1/N of the optimizer state whatever the sizes of the parameters (ZeroRedundancyOptimizer assigns
whole parameters to ranks, so one large embedding lands on one rank with all its state).

Checkpoints have the structure torch.distributed.checkpoint.state_dict gives DDP: state keyed by
parameter name, every group with its current settings and the names of all its parameters. A
piece's state is a flat range of its parameter, i.e. a few rectangular blocks of the parameter's
shape; each state tensor goes to DCP as a SlicedState, a tensor of the parameter's shape whose
blocks are views of the local state, so DCP writes and reads them in place and reshards them
from and to any world size or strategy. Scalar state (Adam's step) is the same on every rank and
saved as it is.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.optim import Optimizer

from dtf.dist.compat import all_gather_single
from dtf.dist.env import DistEnv
from dtf.errors import UserError
from dtf.memory import OptimizerFactory, StateShares
from dtf.models.blocks import find_blocks, shares_parameters_outside
from dtf.strategy.base import (
    local_state_bytes,
    materialise_whole,
    no_optimizer,
    parameter_and_grad_bytes,
)
from dtf.strategy.ddp import DDPStrategy

# Optimizers whose update of an element depends on other elements of the same parameter (factored
# second moments, matrix orthogonalisation, line searches): a flat slice would change their math.
_NOT_ELEMENT_WISE = tuple(
    getattr(torch.optim, n) for n in ("LBFGS", "Adafactor", "SparseAdam", "Muon") if hasattr(torch.optim, n)
)

Block = tuple[list[int], list[int], int]  # offsets and sizes in the parameter's shape, start in the piece


def flat_range_blocks(shape: tuple[int, ...], start: int, stop: int) -> list[Block]:
    """Elements [start, stop) of a row-major tensor of this shape as rectangular blocks, in order:
    a partial first row, whole rows, a partial last row (recursively for more dimensions)."""
    if start >= stop:
        return []
    if not shape:
        return [([], [], 0)]
    inner = math.prod(shape[1:])
    blocks: list[Block] = []

    def in_row(i: int, a: int, b: int) -> list[Block]:
        return [([i, *o], [1, *s], p) for o, s, p in flat_range_blocks(shape[1:], a, b)]

    pos = start
    if pos % inner:
        row = pos // inner
        end = min(stop, (row + 1) * inner)
        blocks += [(o, s, p + pos - start) for o, s, p in in_row(row, pos - row * inner, end - row * inner)]
        pos = end
    whole_end = max(pos, stop // inner * inner)
    if whole_end > pos:
        blocks.append(([pos // inner] + [0] * (len(shape) - 1), [(whole_end - pos) // inner, *shape[1:]], pos - start))
        pos = whole_end
    if stop > pos:
        row = pos // inner
        blocks += [(o, s, p + pos - start) for o, s, p in in_row(row, 0, stop - row * inner)]
    return blocks


class SlicedState(torch.Tensor):
    """A state tensor of a parameter as DCP sees it: the parameter's shape, of which this rank
    holds some rectangular blocks (views of its local state). It implements DCP's checkpointable
    protocol (__create_write_items__, __create_chunk_list__, __get_tensor_shard__) as DTensor and
    torch's LocalShardsWrapper do: DCP writes the blocks and reads into them in place, and
    dcp.async_save can stage a copy (new_empty, then the attributes). It supports nothing else."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
    blocks: list[torch.Tensor]
    offsets: list[torch.Size]

    @staticmethod
    def __new__(cls, size: torch.Size, blocks: list[torch.Tensor], offsets: list[torch.Size]) -> SlicedState:
        r = torch.Tensor._make_wrapper_subclass(cls, size, dtype=blocks[0].dtype, device=blocks[0].device)
        r.blocks, r.offsets = blocks, offsets
        return r

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        kwargs = kwargs or {}
        self = args[0]
        if func is torch.ops.aten.new_empty.default:
            device = kwargs.get("device") or self.device
            return cls(self.size(), [torch.empty_like(b, device=device) for b in self.blocks], self.offsets)
        if func is torch.ops.aten.detach.default:
            return self
        raise NotImplementedError(f"{func} on a ZeRO-1 optimizer state slice (it only goes to checkpoints)")

    def _properties(self) -> TensorProperties:
        return TensorProperties.create_from_tensor(self.blocks[0])

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets, i),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=block.size()),
                    properties=self._properties(),
                    size=self.size(),
                ),
            )
            for i, (block, offsets) in enumerate(zip(self.blocks, self.offsets, strict=True))
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=b.size()) for b, o in zip(self.blocks, self.offsets, strict=True)]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for i, offsets in enumerate(self.offsets):
            if offsets == index.offset:
                return self.blocks[i]
        raise ValueError(f"no block at {index.offset} of {index.fqn} on this rank")

    def copy_into(self, local: torch.Tensor, piece: Piece) -> None:
        """Its blocks into the local state of piece (nothing to do when they are views of it)."""
        if self.offsets != [torch.Size(o) for o, _, _ in piece.blocks]:
            raise ValueError(f"{piece.fqn}: a state slice of another layout")
        for block, (_, _, pos) in zip(self.blocks, piece.blocks, strict=True):
            target = local[pos : pos + block.numel()]
            if target.data_ptr() != block.data_ptr():
                target.copy_(block.reshape(-1))

    def __repr__(self) -> str:  # type: ignore[override]
        return f"SlicedState(size={tuple(self.size())}, blocks at {[tuple(o) for o in self.offsets]})"


@dataclass(eq=False)
class Piece:
    """The part of one parameter inside this rank's slice: elements [start, stop) of the
    flattened parameter. tensor, a 1-D view of the flat buffer, is what the local optimizer steps."""

    fqn: str
    param: nn.Parameter
    start: int
    stop: int
    tensor: torch.Tensor
    blocks: list[Block]  # the same elements as blocks of the parameter's shape


@dataclass(eq=False)
class _FlatBuffer:
    data: torch.Tensor  # every parameter of one chunk, dtype and device, padded to a multiple of the world size
    mine: torch.Tensor  # this rank's equal slice of it
    padding: int
    params: set[nn.Parameter]  # the parameters laid out in it
    chunk: int  # the chunk of the model's units whose parameters these are (model_units)


class FlatLayout:
    """The parameters as views of flat buffers (one per chunk of the model, dtype and device), each
    cut into equal slices, and the pieces of this rank's slice (see the module doc). Made before
    DDP wraps the model (a later move of the parameters would copy them out of the buffers).
    chunk_of: each parameter's chunk of units (model_units), in the order they run; default: one."""

    def __init__(
        self,
        params: list[nn.Parameter],
        names: Mapping[nn.Parameter, str],
        rank: int,
        world_size: int,
        chunk_of: Mapping[nn.Parameter, int] | None = None,
    ) -> None:
        self.flat: list[_FlatBuffer] = []
        self.pieces: list[Piece] = []
        kinds: dict[tuple[int, torch.dtype, torch.device], list[nn.Parameter]] = {}
        for p in params:
            kinds.setdefault((chunk_of[p] if chunk_of else 0, p.dtype, p.device), []).append(p)
        for (chunk, dtype, device), group in sorted(kinds.items(), key=lambda kind: kind[0][0]):
            numel = sum(p.numel() for p in group)
            per_rank = -(-numel // world_size)
            data = torch.zeros(per_rank * world_size, dtype=dtype, device=device)
            mine_lo, mine_hi = rank * per_rank, (rank + 1) * per_rank
            offset = 0
            with torch.no_grad():
                for p in group:
                    size = p.numel()
                    data[offset : offset + size].copy_(p.detach().reshape(-1))
                    p.data = data[offset : offset + size].view(p.shape)
                    lo, hi = max(offset, mine_lo), min(offset + size, mine_hi)
                    if lo < hi:
                        blocks = flat_range_blocks(tuple(p.shape), lo - offset, hi - offset)
                        self.pieces.append(Piece(names[p], p, lo - offset, hi - offset, data[lo:hi], blocks))
                    offset += size
            self.flat.append(_FlatBuffer(data, data[mine_lo:mine_hi], per_rank * world_size - numel, set(group), chunk))

    @property
    def padding_bytes(self) -> int:
        return sum(b.padding * b.data.element_size() for b in self.flat)


# The least a unit's all-gather carries: a unit smaller than this is gathered with the ones after it.
# Each async collective costs its round trips and a wait: a model of many small layers (deep_mlp's
# 0.1 MB blocks) stepped 2x slower gathered block by block than in one all-gather.
GATHER_CHUNK_BYTES = 4 * 2**20


def model_units(
    roots: list[nn.Module], block_classes: list[str] | None, chunk_bytes: int
) -> tuple[list[nn.Module], list[int], dict[nn.Parameter, int]]:
    """The units whose parameters are gathered apart, in the order they run (each root, then its
    blocks as FSDP shards them: find_blocks), each unit's chunk (consecutive units of at least
    chunk_bytes together: one all-gather each), and each parameter's chunk: that of the innermost
    block that holds it, unless a module outside that block holds it too (tied weights: they go
    with the root, which the forward enters first)."""
    units: list[nn.Module] = []
    unit_of: dict[nn.Parameter, int] = {}
    for root in roots:
        first = len(units)
        blocks = find_blocks(root, block_classes)
        units += [root, *blocks]
        for p in root.parameters():
            unit_of.setdefault(p, first)
        for i, block in enumerate(blocks, start=first + 1):  # outermost first: an inner block has the last word
            if not shares_parameters_outside(block, root):
                for p in block.parameters():
                    unit_of[p] = i
    unit_bytes = [0] * len(units)
    for p, unit in unit_of.items():
        unit_bytes[unit] += p.numel() * p.element_size()
    chunk_of_unit: list[int] = []
    chunk = filled = 0
    for size in unit_bytes:
        if chunk_of_unit and filled >= chunk_bytes:
            chunk, filled = chunk + 1, 0
        chunk_of_unit.append(chunk)
        filled += size
    return units, chunk_of_unit, {p: chunk_of_unit[unit] for p, unit in unit_of.items()}


class ParameterGathers:
    """ZeRO-1's all-gathers of the updated parameters, one per chunk of units (model_units), issued
    async after the step; each unit's forward pre-hook waits for its chunk's, so the next forward
    computes while the later units' parameters still cross (as FSDP prefetches). What reads the
    parameters otherwise (a
    checkpoint, an export, the next step) settles them all first; so does the end of the root's
    forward, for a unit that did not run. A module that runs on its own waits for its own parameters.
    A module reads, as under FSDP, only the parameters of its own unit, of the units that ran before
    it, and its own."""

    def __init__(self, units: list[nn.Module], chunk_of_unit: list[int], chunk_of: Mapping[nn.Parameter, int]) -> None:
        self.pending: dict[int, list[dist.Work]] = {}  # by chunk
        roots = _roots_of(units)
        # Each unit waits for its chunk; so does every module for its own parameters' chunks, in
        # case it runs on its own (a submodule called outside its unit's forward).
        waits = {id(unit): {chunk} for unit, chunk in zip(units, chunk_of_unit, strict=True)}
        modules = {id(m): m for root in roots for m in root.modules()}
        for key, module in modules.items():
            waits.setdefault(key, set()).update(chunk_of[p] for p in module.parameters(recurse=False) if p in chunk_of)
        for key, chunks in waits.items():
            if chunks:
                modules[key].register_forward_pre_hook(_waits_for(self, sorted(chunks)))
        for root in roots:
            root.register_forward_hook(_settles(self))

    def add(self, chunk: int, work: dist.Work) -> None:
        self.pending.setdefault(chunk, []).append(work)

    def wait(self, chunk: int) -> None:
        for work in self.pending.pop(chunk, ()):
            work.wait()

    def settle(self) -> None:
        for chunk in list(self.pending):
            self.wait(chunk)


def _roots_of(units: list[nn.Module]) -> list[nn.Module]:
    inner = {id(m) for u in units for m in u.modules() if m is not u}
    return [u for u in units if id(u) not in inner]


def _waits_for(gathers: ParameterGathers, chunks: list[int]) -> Callable[..., None]:
    @torch.compiler.disable  # trainer.compile: the wait runs as it is, between compiled graphs
    def hook(module: nn.Module, args: Any) -> None:
        for chunk in chunks:
            gathers.wait(chunk)

    return hook


def _settles(gathers: ParameterGathers) -> Callable[..., None]:
    @torch.compiler.disable
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        gathers.settle()

    return hook


class ShardedOptimizer(Optimizer):
    """The user's optimizer, stepped on this rank's slice of the parameters (see the module doc).

    param_groups are the user's groups over the whole parameters: what LR schedulers and dtf
    edit. Their settings are copied into the local optimizer's groups before every step and
    every checkpoint. The state lives in `local`; save and load it with sharded_state_dict() and
    load_sharded_state_dict() (Optimizer.state_dict would hold none of it).

    layout: the parameters' layout when it was made already (a function's model, laid out before
    its optimizer exists, dtf.train.function_model); default: laid out here, in the groups' order,
    one buffer per chunk of chunk_of. gathers: where the all-gathers after a step run async (the
    units' hooks wait for them); default: they block."""

    def __init__(
        self,
        template: Optimizer,
        names: Mapping[nn.Parameter, str],
        group: dist.ProcessGroup | None = None,
        layout: FlatLayout | None = None,
        chunk_of: Mapping[nn.Parameter, int] | None = None,
        gathers: ParameterGathers | None = None,
    ) -> None:
        self.process_group = group
        self.gathers = gathers
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        super().__init__([dict(g) for g in template.param_groups], dict(template.defaults))
        self._names: dict[nn.Parameter, str] = {}
        for g in self.param_groups:
            for p in g["params"]:
                if p not in names:
                    raise UserError(
                        "optimizer._target_: the optimizer holds a tensor that is not a parameter of the model; "
                        "build it over the parameters it is given"
                    )
                self._names[p] = names[p]
        mine = [p for g in self.param_groups for p in g["params"]]
        self.layout = layout or FlatLayout(mine, self._names, self.rank, self.world_size, chunk_of)
        self.pieces = [pc for pc in self.layout.pieces if pc.param in self._names]
        self._flat = [b for b in self.layout.flat if b.params & self._names.keys()]
        in_group = [{id(p) for p in g["params"]} for g in self.param_groups]
        local_groups = [
            {**_settings(g), "params": [pc.tensor for pc in self.pieces if id(pc.param) in members]}
            for g, members in zip(self.param_groups, in_group, strict=True)
        ]
        self.local = _same_class_over(template, local_groups)

    @property
    def padding_bytes(self) -> int:
        return self.layout.padding_bytes

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "local"):
            raise NotImplementedError("ShardedOptimizer: parameters cannot be added after the layout is made")
        super().add_param_group(param_group)

    def _push_settings(self) -> None:
        """The current settings of each group (what the scheduler set) into the local groups."""
        for group, local in zip(self.param_groups, self.local.param_groups, strict=True):
            local.update(_settings(group))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        self.settle()
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._push_settings()
        for piece in self.pieces:
            grad = piece.param.grad
            if grad is not None and grad.is_sparse:
                raise UserError(
                    f"model: {piece.fqn} has a sparse gradient (nn.Embedding(sparse=True)); strategy=zero stage 1 "
                    "shards dense gradients: make it dense, or use strategy=ddp"
                )
            piece.tensor.grad = None if grad is None else grad.reshape(-1)[piece.start : piece.stop]
        try:
            self.local.step()
        finally:
            for piece in self.pieces:
                piece.tensor.grad = None
        for buffer in self._flat:
            if self.gathers is None:
                all_gather_single(buffer.data, buffer.mine, group=self.process_group)
            else:
                work = all_gather_single(buffer.data, buffer.mine, group=self.process_group, async_op=True)
                self.gathers.add(buffer.chunk, work)
        return loss

    def settle(self) -> None:
        """Every parameter holds its value after the latest step (the all-gathers have ended)."""
        if self.gathers is not None:
            self.gathers.settle()

    def _materialise_state(self) -> None:
        """The local state exists after the first step only, and a checkpoint loads into existing
        tensors: step once with zero gradients and LR 0, as torch.distributed.checkpoint's
        get_optimizer_state_dict does for a whole optimizer. The parameters do not change."""
        if self.local.state or not self.pieces:
            return
        lrs = [g.get("lr") for g in self.local.param_groups]
        for g in self.local.param_groups:
            if "lr" in g:
                g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        for piece in self.pieces:
            piece.tensor.grad = torch.zeros_like(piece.tensor)
        try:
            self.local.step()
        finally:
            for piece in self.pieces:
                piece.tensor.grad = None
            for g, lr in zip(self.local.param_groups, lrs, strict=True):
                if lr is not None:
                    g["lr"] = lr

    def sharded_state_dict(self) -> dict[str, Any]:
        """{"state": {name: {key: value}}, "param_groups": [{settings..., "params": [names]}]}, as
        get_optimizer_state_dict returns for DDP; this rank's state tensors as SlicedStates."""
        self.settle()
        self._push_settings()
        self._materialise_state()
        state: dict[str, Any] = {}
        for piece in self.pieces:
            entry = {
                key: self._savable(piece, key, value) for key, value in self.local.state.get(piece.tensor, {}).items()
            }
            if entry:
                state[piece.fqn] = entry
        groups = [{**_settings(g), "params": [self._names[p] for p in g["params"]]} for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def _savable(self, piece: Piece, key: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value  # the same on every rank that steps a piece of this parameter
        if value.shape != piece.tensor.shape:
            raise UserError(
                f"optimizer._target_: {type(self.local).__name__} keeps state '{key}' of shape {tuple(value.shape)} "
                f"for a slice of {piece.tensor.numel()} elements of {piece.fqn}: it is not element-wise, which "
                "strategy=zero stage 1 needs; use strategy=ddp"
            )
        return SlicedState(
            piece.param.shape,
            [value[pos : pos + math.prod(sizes)].view(sizes) for _, sizes, pos in piece.blocks],
            [torch.Size(offsets) for offsets, _, _ in piece.blocks],
        )

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Takes over a state dict of sharded_state_dict()'s structure, after DCP loaded it in place
        (its SlicedStates are views of the local state). Whole tensors of a parameter's shape (a
        state dict of a whole optimizer) are sliced."""
        self.settle()
        saved_groups = state["param_groups"]
        ours = [[self._names[p] for p in g["params"]] for g in self.param_groups]
        if [list(g["params"]) for g in saved_groups] != ours:
            raise UserError(
                "checkpoint.resume: the checkpoint's optimizer groups hold other parameters than this run's "
                "(optimizer._target_ groups them differently); resume with the optimizer that wrote it"
            )
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            group.update(_settings(saved))
        for piece in self.pieces:
            local = self.local.state[piece.tensor]
            for key, value in state["state"].get(piece.fqn, {}).items():
                if isinstance(value, SlicedState):
                    value.copy_into(local[key], piece)
                    continue
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    value = value.reshape(-1)[piece.start : piece.stop]
                if isinstance(value, torch.Tensor) and isinstance(local.get(key), torch.Tensor):
                    if local[key] is not value:
                        local[key].copy_(value)
                else:
                    local[key] = value
        self._push_settings()

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError("ShardedOptimizer: the state is sharded; use sharded_state_dict() (DCP)")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise NotImplementedError("ShardedOptimizer: the state is sharded; use load_sharded_state_dict() (DCP)")


def _settings(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _same_class_over(template: Optimizer, groups: list[dict[str, Any]]) -> Optimizer:
    """The template's class over the local groups. The groups carry every setting; the
    constructor gets the template's defaults it accepts (AdamW's defaults hold a key its
    constructor does not take)."""
    cls = type(template)
    accepted = inspect.signature(cls).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    kwargs = {k: v for k, v in template.defaults.items() if takes_any or k in accepted}
    try:
        return cls(groups, **kwargs)
    except (TypeError, ValueError) as e:
        raise UserError(
            f"optimizer._target_: strategy=zero stage 1 rebuilds {cls.__name__} over each rank's slice as "
            f"{cls.__name__}(param_groups, **defaults), which failed ({e}); use a torch.optim class"
        ) from None


def check_element_wise(cls: type[Optimizer]) -> None:
    if issubclass(cls, _NOT_ELEMENT_WISE):
        raise UserError(
            f"optimizer._target_: {cls.__name__} updates an element from other elements of its parameter, but "
            "strategy=zero stage 1 steps an element-wise slice of the parameters on each rank: use an element-wise "
            "optimizer (SGD, Adam, AdamW, RMSprop, ...) or strategy=ddp"
        )


class Zero1Strategy(DDPStrategy):
    """DDP for the gradients (no_sync, bucketing as configured) + ShardedOptimizer, whose
    all-gathers after the step run beside the next forward (ParameterGathers). block_classes: the
    units (find_blocks)."""

    name = "zero"

    def __init__(self, cfg: Any, precision: str = "32", block_classes: list[str] | None = None) -> None:
        super().__init__(cfg, precision)
        self.block_classes = block_classes
        self.gathers: ParameterGathers | None = None

    def setup(self, model: nn.Module, optimizer_factory: OptimizerFactory, env: DistEnv) -> tuple[nn.Module, Optimizer]:
        # before the layout: a later move would copy the parameters out of it
        model = materialise_whole(model, env.device).to(env.device)
        template = optimizer_factory(model.parameters())  # the user's optimizer: class, groups, settings
        if not isinstance(template, Optimizer):
            raise UserError(
                "optimizer._target_ must build a torch.optim.Optimizer from the parameters (with _partial_: true); "
                f"it built a {type(template).__name__}"
            )
        check_element_wise(type(template))
        sparse = [
            type(m).__name__ for m in model.modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.sparse
        ]
        if sparse:
            raise UserError(
                f"model: {sparse[0]}(sparse=True) makes sparse gradients; strategy=zero stage 1 slices dense "
                "gradients: build it with sparse=False, or use strategy=ddp"
            )
        roots = list(model.values()) if isinstance(model, nn.ModuleDict) else [model]
        units, chunk_of_unit, chunk_of = model_units(roots, self.block_classes, GATHER_CHUNK_BYTES)
        self.gathers = ParameterGathers(units, chunk_of_unit, chunk_of) if env.world_size > 1 else None
        names = {p: name for name, p in model.named_parameters()}
        optimizer = ShardedOptimizer(template, names, chunk_of=chunk_of, gathers=self.gathers)
        del template  # its state, if its class makes any up front (Adagrad), would be the whole model's
        wrapped, _ = super().setup(model, no_optimizer, env)  # ShardedOptimizer is the optimizer
        return wrapped, optimizer

    def _settle(self) -> None:
        """Before anything but a forward reads the parameters."""
        if self.gathers is not None:
            self.gathers.settle()

    def whole_tensors(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        self._settle()
        return super().whole_tensors(model)

    def state_dict(self, model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
        self._settle()
        return {"model": get_model_state_dict(model), "optim": _sharded(optimizer).sharded_state_dict()}

    def load_state_dict(self, model: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
        self._settle()  # a gather in flight would overwrite what is loaded
        set_model_state_dict(model, state["model"])
        _sharded(optimizer).load_sharded_state_dict(state["optim"])

    def state_shares(self, world_size: int) -> StateShares:
        return StateShares(1, 1, 1 / world_size, f"ZeRO-1: optimizer state sharded over {world_size} ranks")

    def model_state_bytes(self, model: nn.Module, optimizer: Optimizer) -> int:
        sharded = _sharded(optimizer)
        return parameter_and_grad_bytes(model) + sharded.padding_bytes + local_state_bytes(sharded.local)

    def local_state_tensors(self, model: nn.Module, optimizer: Optimizer) -> Iterator[torch.Tensor]:
        self._settle()  # their values are read (checked finite, copied by an asynchronous save)
        return super().local_state_tensors(model, _sharded(optimizer).local)  # the state of this rank's slice


def _sharded(optimizer: Optimizer) -> ShardedOptimizer:
    assert isinstance(optimizer, ShardedOptimizer), type(optimizer)
    return optimizer
