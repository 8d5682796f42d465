"""model=hf under the strategies that shard parameters (fsdp, zero 3, mics), on 2 gloo ranks: built
on the meta device, the pretrained weights go into each rank's shards (or whole replicas: ddp with
strategy.meta_init), each rank reading its own slices of safetensors files, or rank 0 alone reading
other files; gathered back they are the files, bit for bit; tied
weights stay tied; the blocks are transformers' _no_split_modules; and a run's first step is
transformers' loss over the global batch."""

from __future__ import annotations

import functools
import itertools
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.hf_models import save_bert, save_tied_llama
from tests.helpers.inprocess import train_on_ranks
from tests.unit.test_hf_model import FIRST_STEP, token_data_overrides


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("hf_shards")
    tied = save_tied_llama(root / "tied")
    # The same model as a folder of older days holds it: pytorch_model.bin, which no rank can read by shard.
    as_bin = root / "tied_bin"
    shutil.copytree(tied, as_bin)
    torch.save(load_file(as_bin / "model.safetensors"), as_bin / "pytorch_model.bin")
    (as_bin / "model.safetensors").unlink()
    return {"tied": tied, "tied_bin": as_bin, "bert": save_bert(root / "bert")}


def _strategies() -> dict[str, Any]:
    from dtf.config.schema import DDPStrategyConfig, FSDPStrategyConfig, MicsStrategyConfig, ZeroStrategyConfig

    return {
        "ddp_meta_init": DDPStrategyConfig(meta_init=True),  # whole replicas, filled from rank 0 alike
        "fsdp": FSDPStrategyConfig(),
        "zero3": ZeroStrategyConfig(name="zero", stage=3),
        "mics": MicsStrategyConfig(partition_group_size=2),  # sharded over both ranks
        "mics_replicated": MicsStrategyConfig(partition_group_size=1),  # the 2-D mesh's other axis
    }


def _load_into_shards(rank: int, world_size: int, folders: dict[str, Path]) -> None:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModelForCausalLM

    from dtf import strategy as strategies
    from dtf.dist import env as dist_env
    from dtf.models.hf import HFModel

    torch.set_num_threads(1)
    env = dist_env.init("cpu", "gloo", 60.0)
    files = load_file(folders["tied"] / "model.safetensors") if rank == 0 else {}
    reference = AutoModelForCausalLM.from_pretrained(folders["tied"]) if rank == 0 else None
    from_pretrained = AutoModelForCausalLM.from_pretrained

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"rank {rank} loaded the whole model")

    # What each rank reads of the safetensors files, in elements.
    read: list[int] = []
    by_slices = HuggingFaceStorageReader._process_read_request

    def counted(self: Any, f: Any, req: Any, planner: Any) -> None:
        read.append(math.prod(req.lengths))
        by_slices(self, f, req, planner)

    HuggingFaceStorageReader._process_read_request = counted  # type: ignore[method-assign]
    ids = torch.arange(12).reshape(2, 6) % 50
    # model.safetensors: every rank reads its own slices, and none loads the whole model.
    # pytorch_model.bin: rank 0 loads it whole and sends each rank its part; the others never load it.
    for (name, cfg), folder in itertools.product(_strategies().items(), ("tied", "tied_bin")):
        by_shard = folder == "tied"
        AutoModelForCausalLM.from_pretrained = refuse if by_shard or rank != 0 else from_pretrained  # type: ignore[method-assign]
        read.clear()
        strategy = strategies.build(cfg, "32")
        model = strategy.build_model(functools.partial(HFModel, str(folders[folder])))
        assert all(p.is_meta for p in model.parameters()), name  # whatever strategy.meta_init says
        model, optimizer = strategy.setup(model, lambda ps: torch.optim.SGD(ps, lr=0.5), env)
        hf = getattr(model, "module", model).hf  # (DDP's wrapper)
        assert hf.lm_head.weight is hf.model.embed_tokens.weight, name
        total = sum(p.numel() for p in hf.parameters())
        if name not in ("ddp_meta_init", "mics_replicated"):  # each rank holds half of the embeddings
            assert hf.lm_head.weight.to_local().shape[0] < hf.lm_head.weight.shape[0], name
            assert not by_shard or 0 < sum(read) < 0.75 * total, (name, sum(read), total)  # its half
        else:
            assert sum(read) == (total if by_shard else 0), (name, sum(read), total)  # a whole replica each
        full = strategy.full_state_dict(model)  # collective: gathered from the shards
        if rank == 0:
            # save_pretrained wrote the tied weight once: the output layer is the input embeddings
            assert "lm_head.weight" not in files
            assert set(full) == {f"hf.{k}" for k in files} | {"hf.lm_head.weight"}, name
            for key, value in files.items():
                assert torch.equal(full[f"hf.{key}"], value), (name, key)
            assert torch.equal(full["hf.lm_head.weight"], files["model.embed_tokens.weight"]), name
        # The buffers no file holds (rotary frequencies) too: the model computes transformers' logits.
        logits = model(ids)
        if rank == 0:
            assert reference is not None
            with torch.no_grad():
                assert torch.equal(logits, reference(ids).logits), name
        # A step changes the shared weight once, for both of its uses.
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        after = strategy.full_state_dict(model)
        if rank == 0:
            embeddings = after["hf.model.embed_tokens.weight"]
            assert not torch.equal(embeddings, files["model.embed_tokens.weight"]), name
            assert torch.equal(after["hf.lm_head.weight"], embeddings), name
    # BERT: BertEmbeddings, which is no child of a ModuleList, is a unit of its own: _no_split_modules.
    strategy = strategies.build(_strategies()["fsdp"], "32")
    bert = strategy.build_model(lambda: HFModel(str(folders["bert"]), "AutoModelForSequenceClassification"))
    bert, _ = strategy.setup(bert, lambda ps: torch.optim.SGD(ps, lr=0.1), env)
    units = [type(m).__name__.removeprefix("FSDP") for m in bert.modules() if isinstance(m, FSDPModule)]
    named = bert.block_classes  # transformers 5.0 names none for BERT: the default rule, the layers alone
    assert sorted(units) == [*(["BertEmbeddings"] if "BertEmbeddings" in named else []), *["BertLayer"] * 2, "HFModel"]


def test_pretrained_weights_go_into_the_shards(folders: dict[str, Path]) -> None:
    from tests.helpers.gloo import run_on_ranks

    run_on_ranks(_load_into_shards, 2, folders)


def test_a_sharded_runs_first_step_is_transformers_loss_over_the_global_batch(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from tests.helpers import token_data

    run = ["model=hf", f"model.name_or_path={folders['tied']}", "strategy=fsdp", *FIRST_STEP]
    summary = train_on_ranks(2, [("fsdp", [*run, *token_data_overrides("causal_lm", folders["tied"])])], tmp_path)
    train, _ = token_data.causal_lm(str(folders["tied"]))
    # Unshuffled, rank r's first batch is samples r, r+2, ...: together, the first 8.
    batch = {k: v[:8] for k, v in train.columns.items()}
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(folders["tied"])(**batch).loss.item()
    # Each rank's loss over its tokens, weighed by its tokens (not its sequences): transformers'
    # loss over all 8 sequences' tokens, to float32's rounding (summed in another order).
    assert summary["fsdp"]["final_train_loss"] == pytest.approx(expected, rel=1e-6)
    assert (tmp_path / "fsdp" / "hf" / "tokenizer.json").is_file()
