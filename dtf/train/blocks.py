"""trainer.activation_checkpointing and trainer.compile: the same switches for every strategy.

Both replace forward on the module instance (module.forward = ...), so the module tree, the
parameter names and the state-dict keys stay exactly as they were: a checkpoint written with
either switch resumes without it, and the other way round. (checkpoint_wrapper would add
`_checkpoint_wrapped_module.` to the names, torch.compile(module) `_orig_mod.`; Module.compile()
keeps them, but in torch 2.13 compiles nothing for torch.nn's own modules, pytorch#150915.)

- Activation checkpointing runs each block's forward under torch.utils.checkpoint
  (non-reentrant): only the block's inputs are kept, backward recomputes the rest with the RNG
  state of the forward (dropout draws the same), so the gradients are the same bits. Applied
  before the strategy wraps the model: DDP's and FSDP's hooks stay outside the recomputed part.
- Compilation (torch.compile, inductor) of the model's forward, or of each block's forward
  (torchtitan's way: blocks of one shape reuse one compiled graph), after checkpointing (the
  graph holds the recomputation) and after the strategy wrapped the model: DDP's and FSDP's
  hooks run eagerly around the compiled code (dynamo cannot trace FSDP2's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from dtf.errors import UserError
from dtf.models.blocks import find_blocks


def outermost(blocks: list[nn.Module]) -> list[nn.Module]:
    """The blocks that are not inside another one of the list (a block inside a checkpointed or
    compiled block is already recomputed or compiled with it)."""
    inner = {id(sub) for b in blocks for sub in b.modules() if sub is not b}
    return [b for b in blocks if id(b) not in inner]


def checkpointed_blocks(
    model: nn.Module, setting: list[str] | str | None, block_classes: list[str] | None
) -> list[nn.Module]:
    """What trainer.activation_checkpointing recomputes: the modules of the named classes, or with
    blocks the model's blocks as the strategy finds them (its block_classes, else the model's own:
    model=hf's _no_split_modules, else the default rule)."""
    if not setting:
        return []
    if setting == "blocks":
        found = outermost(find_blocks(model, block_classes))
        if not found:
            raise UserError(
                "trainer.activation_checkpointing=blocks: the model has no blocks (no nn.Sequential / nn.ModuleList "
                "children, no children with parameters); name the classes: trainer.activation_checkpointing=[<class>]"
            )
        return found
    return outermost(find_blocks(model, list(setting), key="trainer.activation_checkpointing"))


def checkpoint_activations(
    model: nn.Module, setting: list[str] | str | None, block_classes: list[str] | None
) -> list[nn.Module]:
    """Recompute in backward the activations of what checkpointed_blocks names; returns them."""
    blocks = checkpointed_blocks(model, setting, block_classes)
    for block in blocks:
        block.forward = _checkpointed(block.forward)
    return blocks


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)  # evaluation: nothing is stored for backward anyway
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return checkpointed_forward


def compile_targets(model: nn.Module, mode: bool | str, block_classes: list[str] | None) -> list[nn.Module]:
    """What trainer.compile compiles. blocks: each block, as the strategy's block_classes (or the
    default rule) finds them. true: the model (each module of a ModuleDict); where FSDP2 has made
    units of it (fsdp, mics, zero 2/3), each unit, blocks and root: their hooks are opaque to dynamo
    (it breaks the graph there), so a compiled root alone would leave the blocks eager."""
    if not mode:
        return []
    if mode == "blocks":
        return outermost(find_blocks(model, block_classes))
    units: list[nn.Module] = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if units:
        return units
    return list(model.values()) if isinstance(model, nn.ModuleDict) else [model]


def compile_model(model: nn.Module, mode: bool | str, block_classes: list[str] | None) -> list[nn.Module]:
    """torch.compile the forward of what compile_targets names (compiled at its first call)."""
    targets = compile_targets(model, mode, block_classes)
    if targets:
        import torch._dynamo

        # As in a fresh process: an earlier run in this one (tests, notebooks) would otherwise
        # count against dynamo's recompile limit, past which it silently stays eager.
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        # The compiled forwards of torch.nn's own modules share one code object (dynamo's wrapper),
        # and so one recompile limit: each block of another shape is a recompilation, and so is
        # evaluation (no grad) and a short last batch. Room for every target in each of these.
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, 4 * len(targets))
    for module in targets:
        module.forward = torch.compile(module.forward)
    return targets


def compiled_graphs() -> int:
    """Graphs dynamo compiled in this process so far (0 when nothing could be compiled)."""
    import torch._dynamo.utils

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
