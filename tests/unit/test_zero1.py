"""ZeRO stage 1, in process on gloo ranks: each rank steps one equal, element-wise slice of the
parameters (param groups and their settings kept), and its checkpoints are DDP's structure, so
they reshard onto any world size or strategy. Checked against a whole, unsharded optimizer."""

from __future__ import annotations

import copy
import functools
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.optim.lr_scheduler import LambdaLR

from dtf.config.schema import DDPStrategyConfig, ZeroStrategyConfig
from dtf.dist.env import DistEnv
from dtf.errors import UserError
from dtf.strategy.base import Strategy
from dtf.strategy.ddp import DDPStrategy
from dtf.strategy.zero import zero
from dtf.strategy.zero1 import flat_range_blocks
from tests.helpers.gloo import run_on_ranks


class Odd(nn.Module):
    """Parameters of every rank (0-d to 3-d) whose sizes no world size divides: 105 in all."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 7)
        self.mix = nn.Parameter(torch.randn(2, 7, 5) * 0.3)
        self.scale = nn.Parameter(torch.tensor(0.5))
        self.out = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.einsum("bi,kio->bo", h, self.mix)
        return self.out(torch.tanh(h) * self.scale)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Odd()


OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.05}),
    "adam_amsgrad": (torch.optim.Adam, {"lr": 0.01, "amsgrad": True}),
}


def _grouped(name: str, params: Any) -> torch.optim.Optimizer:
    """A user's factory with two groups: decay on matrices, none (and twice the LR) elsewhere."""
    cls, kwargs = OPTIMIZERS[name]
    params = list(params)
    return cls(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 2 * kwargs["lr"]},
        ],
        **kwargs,
    )


def _factory(name: str) -> Callable[[Any], torch.optim.Optimizer]:
    return functools.partial(_grouped, name)


def _zero1() -> Strategy:
    return zero(OmegaConf.structured(ZeroStrategyConfig(stage=1)))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 3, generator=g), torch.randn(6, 1, generator=g)


def _full_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(_batch(step, r) for r in range(world)), strict=True)
    return torch.cat(xs), torch.cat(ys)


def _train(model: nn.Module, opt: torch.optim.Optimizer, sched: LambdaLR, step: int, x: torch.Tensor, y: torch.Tensor):  # type: ignore[no-untyped-def]
    nn.functional.mse_loss(model(x), y).backward()
    if step == 2:  # a setting changed by hand on the optimizer's groups must reach the step too
        opt.param_groups[0]["weight_decay"] = 0.3
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()


def _same_on_every_rank(obj: Any) -> None:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    assert all(g == gathered[0] for g in gathered), gathered


def _params_digest(model: nn.Module) -> list[bytes]:
    return [p.detach().numpy().tobytes() for p in model.parameters()]


def _check_local_state(opt: Any, full: dict[str, Any]) -> None:
    """Every piece this rank steps holds exactly its elements of the full state."""
    assert opt.pieces, "this rank steps nothing"
    for piece in opt.pieces:
        local = opt.local.state[piece.tensor]
        assert local.keys() == full["state"][piece.fqn].keys(), piece.fqn
        for key, value in full["state"][piece.fqn].items():
            if local[key].dim() == 0:  # a counter (Adam's step), the same for every element
                assert torch.equal(local[key], value), (piece.fqn, key)
            else:
                assert torch.equal(local[key], value.reshape(-1)[piece.start : piece.stop]), (piece.fqn, key)


# -- the layout ------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(7, 5), (2, 3, 4), (10,), (), (3, 1, 2), (1, 6)])
def test_a_flat_range_becomes_the_blocks_that_cover_exactly_it(shape: tuple[int, ...]) -> None:
    numel = math.prod(shape)
    positions = torch.arange(numel).reshape(shape)
    for start in range(numel + 1):
        for stop in range(start, numel + 1):
            covered = []
            for offsets, sizes, pos in flat_range_blocks(shape, start, stop):
                block = positions[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
                # a block is a run of consecutive elements, at its place in the piece
                assert block.reshape(-1).tolist() == list(range(start + pos, start + pos + block.numel()))
                covered += block.reshape(-1).tolist()
            assert covered == list(range(start, stop)), (shape, start, stop)


# -- a step ----------------------------------------------------------------------------------
def _steps_like_the_whole_optimizer(rank: int, world: int, name: str) -> None:
    env = DistEnv(rank, world, rank, torch.device("cpu"))
    reference = _model()
    ref_opt = _grouped(name, reference.parameters())
    ref_sched = LambdaLR(ref_opt, lambda s: 0.8**s)
    model, opt = _zero1().setup(_model(), _factory(name), env)
    sched = LambdaLR(opt, lambda s: 0.8**s)
    for step in range(5):
        _train(model, opt, sched, step, *_batch(step, rank))
        _train(reference, ref_opt, ref_sched, step, *_full_batch(step, world))
        opt.settle()  # the all-gathers after the step (waited for by the next forward, or here)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        _same_on_every_rank(_params_digest(model))
    # each rank steps its slice with the settings of each parameter's group, as they are at the step
    assert [len(g["params"]) for g in opt.param_groups] == [len(g["params"]) for g in ref_opt.param_groups]
    opt.step()  # no gradients: nothing changes but the local groups' settings
    for group, local_group in zip(opt.param_groups, opt.local.param_groups, strict=True):
        assert {k: v for k, v in local_group.items() if k != "params"} == {
            k: v for k, v in group.items() if k != "params"
        }


@pytest.mark.parametrize(("name", "world"), [("sgd", 2), ("adamw", 3), ("adam_amsgrad", 2)])
def test_a_sharded_step_equals_the_whole_optimizer_with_its_param_groups(name: str, world: int) -> None:
    run_on_ranks(_steps_like_the_whole_optimizer, world, name)


def _holds_an_equal_slice(rank: int, world: int) -> None:
    env = DistEnv(rank, world, rank, torch.device("cpu"))
    model, opt = _zero1().setup(_model(), _factory("adamw"), env)
    _train(model, opt, LambdaLR(opt, lambda s: 1.0), 0, *_batch(0, rank))
    numel = sum(p.numel() for p in model.parameters())
    per_rank = -(-numel // world)
    mine = sum(piece.stop - piece.start for piece in opt.pieces)
    assert mine == min(per_rank, numel - rank * per_rank)
    moments = sum(v.numel() for s in opt.local.state.values() for v in s.values() if v.dim() > 0)
    assert moments == 2 * mine  # AdamW: two moments per element of the slice, nothing else


def test_every_rank_steps_an_equal_slice_of_the_parameters() -> None:
    run_on_ranks(_holds_an_equal_slice, 4)


# -- the all-gathers beside the next forward ------------------------------------------------
class _Deferred:
    """An all-gather that runs only when waited for: a unit that computed before waiting for its
    parameters would compute with the last step's."""

    def __init__(self, output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
        self.args = (output, input, group)

    def wait(self) -> bool:
        output, input, group = self.args
        dist.all_gather_into_tensor(output, input, group=group)
        return True


def _forward_waits_for_each_unit(rank: int, world: int) -> None:
    from dtf.strategy import zero1

    def deferred(output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
        assert async_op, "the all-gathers after a step are async"
        return _Deferred(output, input, group)

    zero1.all_gather_single = deferred  # type: ignore[assignment]
    zero1.GATHER_CHUNK_BYTES = 0  # every unit its own all-gather (the model is tiny)
    env = DistEnv(rank, world, rank, torch.device("cpu"))
    reference = _model()
    ref_opt = _grouped("adamw", reference.parameters())
    strategy = _zero1()
    model, opt = strategy.setup(_model(), _factory("adamw"), env)
    gathers = strategy.gathers
    assert gathers is not None
    waited: list[int] = []
    wait = gathers.wait
    gathers.wait = lambda chunk: (waited.append(chunk) if chunk in gathers.pending else None, wait(chunk))[1]  # type: ignore[method-assign]
    for step in range(4):
        x, y = _batch(step, rank)
        full_x, full_y = _full_batch(step, world)
        out, ref_out = model(x), reference(full_x)
        # the forward after a step computes with the stepped parameters: each unit waited for its own
        torch.testing.assert_close(out, ref_out[rank * len(x) : (rank + 1) * len(x)], rtol=1e-5, atol=1e-6)
        nn.functional.mse_loss(out, y).backward()
        nn.functional.mse_loss(ref_out, full_y).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        # the root (mix, scale), then its children with parameters (inp, out): three units, in flight
        assert sorted(gathers.pending) == [0, 1, 2]
        waited.clear()
    model(x)
    assert waited == [0, 1, 2] and not gathers.pending  # in forward order, and no more
    opt.step()  # what reads the parameters otherwise settles them: the next step, a checkpoint
    assert sorted(gathers.pending) == [0, 1, 2]
    strategy.state_dict(model, opt)
    assert not gathers.pending
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_the_all_gathers_after_a_step_run_beside_the_next_forward_which_waits_unit_by_unit() -> None:
    run_on_ranks(_forward_waits_for_each_unit, 2)


class _Wrapped(nn.Module):
    """Odd inside a wrapper: one unit (body) whose submodules are not units of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _a_submodule_run_alone_waits_for_its_parameters(rank: int, world: int) -> None:
    from dtf.strategy import zero1

    zero1.all_gather_single = lambda output, input, group=None, async_op=False: _Deferred(output, input, group)  # type: ignore[assignment]
    zero1.GATHER_CHUNK_BYTES = 0
    env = DistEnv(rank, world, rank, torch.device("cpu"))
    reference = _Wrapped()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    strategy = _zero1()
    model, opt = strategy.setup(_Wrapped(), functools.partial(torch.optim.SGD, lr=0.1), env)
    x, y = _full_batch(0, world)
    for m, o in ((model, opt), (reference, ref_opt)):
        nn.functional.mse_loss(m(x), y).backward()
        o.step()
    h = torch.randn(4, 3)
    # body.inp is not a unit (body is): called on its own, it waits for its own parameters
    torch.testing.assert_close(model.module.body.inp(h), reference.body.inp(h), rtol=1e-5, atol=1e-6)


def test_a_submodule_run_on_its_own_after_a_step_computes_with_the_stepped_parameters() -> None:
    run_on_ranks(_a_submodule_run_alone_waits_for_its_parameters, 2)


def _block_classes_name_the_units(rank: int, world: int) -> None:
    from dtf.strategy import zero1

    zero1.GATHER_CHUNK_BYTES = 0  # every unit its own all-gather
    env = DistEnv(rank, world, rank, torch.device("cpu"))
    x, y = _full_batch(0, world)
    in_flight = []
    for classes in (None, ["Linear"]):
        strategy = zero(OmegaConf.structured(ZeroStrategyConfig(stage=1, block_classes=classes)))
        model, opt = strategy.setup(_Wrapped(), functools.partial(torch.optim.SGD, lr=0.1), env)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        assert strategy.gathers is not None
        in_flight.append(len(strategy.gathers.pending))
        opt.settle()
    # by default the wrapper's one child (body) is its only unit with parameters; with
    # strategy.block_classes=[Linear], body.inp and body.out are units of their own, and the root's
    # unit holds the rest (body's mix and scale)
    assert in_flight == [1, 3]


def test_strategy_block_classes_name_stage_1s_units() -> None:
    run_on_ranks(_block_classes_name_the_units, 2)


def test_units_are_gathered_in_chunks_of_a_few_mb_and_tied_weights_with_the_root() -> None:
    from dtf.strategy.zero1 import model_units

    mb = 2**20
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(1024, 1024), nn.Linear(8, 8), nn.Linear(8, 8))
    units, chunk_of_unit, chunk_of = model_units([model], None, 4 * mb)
    assert units == [model, *model]
    # small units go with those after them until a chunk holds 4 MB (the 1024x1024 layer's 4 MB)
    assert chunk_of_unit == [0, 0, 0, 0, 1, 1]
    assert {chunk_of[p] for p in model[2].parameters()} == {0} and {chunk_of[p] for p in model[3].parameters()} == {1}
    model[4].weight = model[0].weight  # tied: both layers read it, and the root's unit runs first
    _, chunk_of_unit, chunk_of = model_units([model], None, 0)
    assert chunk_of_unit == [0, 1, 2, 3, 4, 5]
    assert chunk_of[model[0].weight] == 0 and chunk_of[model[0].bias] == 0 and chunk_of[model[4].bias] == 0
    assert chunk_of[model[1].weight] == 2


# -- checkpoints -----------------------------------------------------------------------------
def _state_dict_like_ddp(rank: int, world: int) -> None:
    env = DistEnv(rank, world, rank, torch.device("cpu"))
    reference = _model()
    ref_opt = _grouped("adamw", reference.parameters())
    ref_sched = LambdaLR(ref_opt, lambda s: 0.5**s)
    strategy = _zero1()
    model, opt = strategy.setup(_model(), _factory("adamw"), env)
    sched = LambdaLR(opt, lambda s: 0.5**s)
    for step in range(3):
        _train(model, opt, sched, step, *_batch(step, rank))
        _train(reference, ref_opt, ref_sched, step, *_full_batch(step, world))
    ours = strategy.state_dict(model, opt)["optim"]
    theirs = get_optimizer_state_dict(reference, ref_opt)
    # the hyperparameters the scheduler set last (not those of the step before), every parameter
    # name in every group, on every rank
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["param_groups"][0]["lr"] == 0.01 * 0.5**3
    _same_on_every_rank(ours["param_groups"])
    # the state: each rank its slices, as parts of tensors of the parameters' shapes
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, sorted(ours["state"]))
    assert set().union(*gathered) == theirs["state"].keys()
    for fqn, entry in ours["state"].items():
        assert entry.keys() == theirs["state"][fqn].keys()
        for key, value in entry.items():
            assert value.size() == theirs["state"][fqn][key].size(), (fqn, key)


def test_the_state_dict_has_ddps_structure_and_the_current_hyperparameters() -> None:
    run_on_ranks(_state_dict_like_ddp, 2)


def _train_and_save(rank: int, world: int, strategy_name: str, out: str, in_background: bool) -> None:
    """Trains 3 steps with zero1 or ddp, saves a DCP checkpoint (in_background: as dtf's
    checkpoint.async_save does), and (rank 0) the reference's full state: a whole model and
    optimizer trained on the full batch in this process."""
    env = DistEnv(rank, world, rank, torch.device("cpu"))
    reference = _model()
    ref_opt = _grouped("adamw", reference.parameters())
    ref_sched = LambdaLR(ref_opt, lambda s: 0.5**s)
    if strategy_name == "zero1":
        strategy = _zero1()
        model, opt = strategy.setup(_model(), _factory("adamw"), env)
    else:
        strategy = DDPStrategy(OmegaConf.structured(DDPStrategyConfig()))
        model, opt = strategy.setup(_model(), _factory("adamw"), env)
    sched = LambdaLR(opt, lambda s: 0.5**s)
    for step in range(3):
        _train(model, opt, sched, step, *_batch(step, rank))
        _train(reference, ref_opt, ref_sched, step, *_full_batch(step, world))
    if in_background:  # the state is staged (copied) first, then written by a thread
        dcp.async_save(strategy.state_dict(model, opt), checkpoint_id=out).result()
    else:
        dcp.save(strategy.state_dict(model, opt), checkpoint_id=out)
    if rank == 0:
        full = {"model": reference.state_dict(), "optim": get_optimizer_state_dict(reference, ref_opt)}
        torch.save(full, Path(out) / "reference.pt")


def _load_full(path: Path) -> dict[str, Any]:
    """What a checkpoint holds, loaded whole in this (non-distributed) process."""
    reference = torch.load(path / "reference.pt", weights_only=True)
    target = copy.deepcopy(reference)
    for values in [target["model"], *target["optim"]["state"].values()]:
        for key, value in values.items():
            values[key] = torch.full_like(value, float("nan"))
    for group in target["optim"]["param_groups"]:
        group["lr"] = -1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP notes that it loads in a single process
        dcp.load(target, checkpoint_id=str(path))
    # the checkpoint holds what a whole optimizer computes, whatever wrote it
    torch.testing.assert_close(target["model"], reference["model"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(target["optim"]["state"], reference["optim"]["state"], rtol=1e-5, atol=1e-6)
    assert target["optim"]["param_groups"] == reference["optim"]["param_groups"]
    return target


def _load_and_check(rank: int, world: int, strategy_name: str, path: str, full_file: str) -> None:
    """Loads the checkpoint at path into a fresh zero1 or ddp run (other initial weights); its
    state must be the checkpoint's, and one more step must equal the whole optimizer's."""
    env = DistEnv(rank, world, rank, torch.device("cpu"))
    full = torch.load(full_file, weights_only=True)
    if strategy_name == "zero1":
        strategy = _zero1()
        model, opt = strategy.setup(_model(seed=7), _factory("adamw"), env)
    else:
        strategy = DDPStrategy(OmegaConf.structured(DDPStrategyConfig()))
        model, opt = strategy.setup(_model(seed=7), _factory("adamw"), env)
    LambdaLR(opt, lambda s: 0.5**s)  # the run's scheduler exists before it resumes (it adds initial_lr)
    app_state = strategy.state_dict(model, opt)  # as Trainer.resume_from does
    dcp.load(app_state, checkpoint_id=path)
    strategy.load_state_dict(model, opt, app_state)
    for name, p in model.module.named_parameters():
        assert torch.equal(p, full["model"][name]), name
    saved_groups = [{k: v for k, v in g.items() if k != "params"} for g in full["optim"]["param_groups"]]
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == saved_groups
    if strategy_name == "zero1":
        _check_local_state(opt, full["optim"])
        for local_group, saved in zip(opt.local.param_groups, saved_groups, strict=True):
            assert {k: v for k, v in local_group.items() if k != "params"} == saved
    else:
        torch.testing.assert_close(
            get_optimizer_state_dict(model, opt)["state"], full["optim"]["state"], rtol=0, atol=0
        )
    # the loaded state steps as the whole optimizer does from the same state
    reference = _model(seed=9)
    reference.load_state_dict(full["model"])
    ref_opt = _grouped("adamw", reference.parameters())
    set_optimizer_state_dict(reference, ref_opt, copy.deepcopy(full["optim"]))
    for m, o, batch in ((model, opt, _batch(3, rank)), (reference, ref_opt, _full_batch(3, world))):
        nn.functional.mse_loss(m(batch[0]), batch[1]).backward()
        o.step()
    if strategy_name == "zero1":
        opt.settle()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("saved_by", "saved_world", "loaded_by", "loaded_world", "in_background"),
    [
        ("zero1", 2, "ddp", 1, False),
        ("zero1", 2, "zero1", 4, False),
        ("ddp", 2, "zero1", 2, False),
        ("zero1", 3, "zero1", 2, True),
    ],
)
def test_a_checkpoint_reshards_between_zero1_ddp_and_world_sizes(
    tmp_path: Path, saved_by: str, saved_world: int, loaded_by: str, loaded_world: int, in_background: bool
) -> None:
    path = tmp_path / "ckpt"
    run_on_ranks(_train_and_save, saved_world, saved_by, str(path), in_background)
    full = _load_full(path)
    torch.save(full, tmp_path / "full.pt")
    run_on_ranks(_load_and_check, loaded_world, loaded_by, str(path), str(tmp_path / "full.pt"))


# -- what a user can get wrong ----------------------------------------------------------------
@pytest.mark.parametrize("cls", [torch.optim.LBFGS, torch.optim.Adafactor])
def test_optimizers_that_are_not_element_wise_are_refused(cls: type[torch.optim.Optimizer]) -> None:
    env = DistEnv(0, 1, 0, torch.device("cpu"))
    with pytest.raises(UserError, match=rf"optimizer\._target_: {cls.__name__} .* or strategy=ddp$"):
        _zero1().setup(_model(), functools.partial(cls, lr=0.1), env)


def test_sparse_gradients_are_refused() -> None:
    env = DistEnv(0, 1, 0, torch.device("cpu"))
    with pytest.raises(UserError, match=r"model: Embedding\(sparse=True\) .* sparse=False, or use strategy=ddp"):
        _zero1().setup(nn.Embedding(10, 3, sparse=True), functools.partial(torch.optim.SGD, lr=0.1), env)
