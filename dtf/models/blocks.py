"""A model's blocks, as FSDP's units (dtf.strategy.fsdp), compiled blocks and activation
checkpointing (dtf.train.blocks) all find them: one rule in a module that both import."""

from __future__ import annotations

from torch import nn

from dtf.errors import UserError


def find_blocks(
    model: nn.Module, class_names: list[str] | None, key: str = "strategy.block_classes"
) -> list[nn.Module]:
    """The model's blocks (never the root), outermost first: the modules of the named classes, or
    by default those of the classes the model names itself (`model.block_classes`: model=hf's, from
    transformers' `_no_split_modules`), else the children of every nn.Sequential / nn.ModuleList
    that hold parameters, else the model's direct children with parameters. FSDP shards them as
    units; trainer.compile=blocks compiles them. key: the setting that named the classes, for the
    error message."""
    if class_names:
        blocks = [m for m in model.modules() if m is not model and type(m).__name__ in class_names]
        present = {type(m).__name__ for m in model.modules() if m is not model}
        missing = [n for n in class_names if n not in present]
        if missing:
            raise UserError(
                f"{key}: no module of class {', '.join(missing)} in the model; "
                f"its classes are: {', '.join(sorted(present))}"
            )
        return blocks
    own = getattr(model, "block_classes", None)
    if own:
        named = [m for m in model.modules() if m is not model and type(m).__name__ in own]
        # A block that shares a weight with the rest of the model (tied embeddings) cannot be a unit
        # of its own (FSDP would free the weight while the rest still uses it): it stays in its parent's.
        blocks = [m for m in named if not shares_parameters_outside(m, model)]
        if blocks:
            return blocks
    containers = [m for m in model.modules() if isinstance(m, nn.Sequential | nn.ModuleList)]
    candidates = [c for container in containers for c in container.children()] or list(model.children())
    return [m for m in candidates if any(True for _ in m.parameters())]


def shares_parameters_outside(block: nn.Module, model: nn.Module) -> bool:
    """Whether a parameter of block is also registered on a module of the model outside it."""
    inside = {id(m) for m in block.modules()}
    mine = {id(p) for p in block.parameters()}
    return any(id(p) in mine for m in model.modules() if id(m) not in inside for p in m.parameters(recurse=False))
