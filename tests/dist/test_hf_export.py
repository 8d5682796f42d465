"""`python -m dtf.export`: a checkpoint as a folder that transformers' from_pretrained loads.

Proof by equivalence: a checkpoint of untrained weights exports the input folder's weights bit
for bit (tied ones as save_pretrained writes them); after 2 FSDP ranks trained it, from_pretrained
of the export gives the logits of dtf's own model (model.pt) exactly; DDP, ZeRO-3, MiCS and a
resume from 2 ranks onto 1 export the weights FSDP's uninterrupted run exports, within the
strategy tests' tolerance (tests/dist/test_strategies.py). The runs are shared (module fixtures);
model=hf trains on token dicts (tests/helpers/hf_causal_lm.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dtf.export import main as export_main
from dtf.models.hf import HFModel
from tests.helpers.hf_causal_lm import overrides
from tests.helpers.hf_models import CORPUS, save_bert, save_llama, save_tied_llama, save_vit
from tests.helpers.inprocess import train_in_process, train_on_ranks
from tests.helpers.run_command import dtf_command, run_command

STEPS = 4
SGD = [
    "optimizer=sgd",
    "optimizer.lr=0.1",
    "trainer.lr_scaling=none",  # the same global batch of 16 and the same LR on 2 ranks (8 each) and on 1
    "checkpoint.every_n_steps=2",
    "trainer.export_weights=true",
]
STRATEGIES = {
    "ddp": ["strategy=ddp"],
    "zero3": ["strategy=zero", "strategy.stage=3"],
    "mics": ["strategy=mics", "strategy.partition_group_size=2"],
}
# LR 0 throughout (ConstantLR's factor 0; dtf refuses optimizer.lr=0): SGD leaves every weight as it was.
LR_ZERO = [
    "optimizer=sgd",
    "scheduler=step",
    "scheduler._target_=torch.optim.lr_scheduler.ConstantLR",
    "~scheduler.step_size",
    "~scheduler.gamma",
    "+scheduler.factor=0.0",
    "+scheduler.total_iters=1000",
]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def trained(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Runs of the same training: fsdp, each of STRATEGIES on 2 ranks; `resumed`: fsdp on 2 ranks
    for half the steps, then on 1 rank to the end."""
    root = tmp_path_factory.mktemp("trained")
    base = [*overrides(llama), *SGD, "data.batch_size=8"]
    runs = [(name, [*base, *args, f"trainer.max_steps={STEPS}"]) for name, args in [("fsdp", ["strategy=fsdp"])]]
    runs += [(name, [*base, *args, f"trainer.max_steps={STEPS}"]) for name, args in STRATEGIES.items()]
    runs += [("resumed", [*base, "strategy=fsdp", f"trainer.max_steps={STEPS // 2}"])]
    train_on_ranks(2, runs, root)
    alone = [*overrides(llama), *SGD, "data.batch_size=16", "strategy=fsdp", f"trainer.max_steps={STEPS}"]
    summary = train_on_ranks(1, [("resumed", alone)], root)["resumed"]
    assert summary["resumed_from_step"] == STEPS // 2 and summary["samples_seen"] == STEPS * 16
    return root


def _export(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """python -m dtf.export, in this process: (exit status, stdout, stderr)."""
    code = export_main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def fsdp_export(trained: Path) -> Path:
    assert export_main([str(trained / "fsdp")]) == 0
    return trained / "fsdp" / "hf_export"


def test_an_untrained_checkpoint_exports_the_input_weights_bit_for_bit_at_the_end_of_training(
    tmp_path: Path, llama: Path
) -> None:
    """checkpoint.export_hf (the final checkpoint and, with keep_best, the best) on a Llama whose
    LM head is tied to its embedding and on one whose is not: exactly the folder save_pretrained wrote."""
    from transformers import AutoTokenizer

    tied = save_tied_llama(tmp_path / "tied")
    for folder in (llama, tied):
        run_dir = tmp_path / f"run_{folder.name}"
        train_in_process(
            [
                *overrides(folder),
                *LR_ZERO,
                "trainer.max_steps=3",
                "data.val_fraction=0.25",
                "checkpoint.export_hf=true",
                "checkpoint.keep_best=1",
            ],
            run_dir,
        )
        given = load_file(folder / "model.safetensors")
        assert ("lm_head.weight" in given) == (folder == llama)  # save_pretrained dropped the tied copy
        for export in ("hf_export", "hf_export_best"):
            written = load_file(run_dir / export / "model.safetensors")
            assert written.keys() == given.keys()
            for name, tensor in given.items():
                assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), (export, name)
            for name in ("config.json", "generation_config.json"):
                assert (run_dir / export / name).read_bytes() == (folder / name).read_bytes(), name
            # the tokenizer as model=hf saved it (save_pretrained of the folder's): the same tokens
            exported, given_tokenizer = (AutoTokenizer.from_pretrained(p) for p in (run_dir / export, folder))
            assert exported(CORPUS)["input_ids"] == given_tokenizer(CORPUS)["input_ids"]


def test_from_pretrained_of_a_2_rank_fsdp_export_gives_the_logits_of_dtf_s_model(
    trained: Path, fsdp_export: Path, llama: Path
) -> None:
    from transformers import AutoModelForCausalLM

    ours = HFModel(str(llama))
    weights = torch.load(trained / "fsdp" / "model.pt", weights_only=True)  # dtf's own, gathered from the ranks
    assert not torch.equal(weights["hf.model.embed_tokens.weight"], ours.hf.model.embed_tokens.weight)  # trained
    ours.load_state_dict(weights)
    theirs = AutoModelForCausalLM.from_pretrained(fsdp_export)
    tokens = torch.randint(0, ours.hf.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # fp32, the same weights and the same transformers code: bit for bit.
        assert torch.equal(theirs(input_ids=tokens).logits, ours.hf(input_ids=tokens).logits)


@pytest.mark.parametrize("name", [*STRATEGIES, "resumed"])
def test_every_strategy_and_a_resume_onto_1_rank_export_fsdp_s_weights(
    trained: Path, fsdp_export: Path, name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _export(capsys, trained / name, "--out", tmp_path / "out")
    assert code == 0, out
    assert f"(step {STEPS})" in out
    ours, reference = load_file(tmp_path / "out" / "model.safetensors"), load_file(fsdp_export / "model.safetensors")
    assert ours.keys() == reference.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], reference[key], rtol=1e-5, atol=1e-5)  # test_strategies' tolerance


def test_a_sharded_bf16_export_of_a_checkpoint_folder(trained: Path, fsdp_export: Path, tmp_path: Path) -> None:
    """The command line, as a user types it: shards with an index above --max-shard-size (the
    index as save_pretrained writes it), floating tensors in bf16, and from_pretrained loads it."""
    from transformers import AutoModelForCausalLM

    checkpoint = trained / "fsdp" / "checkpoints" / f"step_{STEPS:09d}"
    out = tmp_path / "bf16"
    done = run_command(
        dtf_command(checkpoint, "--out", out, "--dtype", "bf16", "--max-shard-size", "40KB", module="dtf.export")
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and sorted(p.name for p in out.glob("*.safetensors")) == shards
    assert f"to {out}: {len(shards)} shards and model.safetensors.index.json" in done.stdout
    reference = load_file(fsdp_export / "model.safetensors")
    written = {k: v for shard in shards for k, v in load_file(out / shard).items()}
    assert index["weight_map"].keys() == written.keys() == reference.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in reference.values())
    assert all(tensor_bytes(out / shard) <= 40_000 for shard in shards)  # 40KB: huggingface_hub's 10**3
    for key, tensor in reference.items():
        assert torch.equal(written[key], tensor.to(torch.bfloat16)), key
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    assert torch.equal(model.lm_head.weight, reference["lm_head.weight"].to(torch.bfloat16))


def tensor_bytes(path: Path) -> int:
    """The bytes of a shard's tensors (what --max-shard-size bounds)."""
    return sum(t.numel() * t.element_size() for t in load_file(path).values())


def test_a_model_that_is_not_a_transformers_model_exports_its_weights_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "approximator"
    train_in_process(
        ["trainer.max_steps=3", "data.dataset.num_points=400", "data.dataset.num_test=100", "optimizer=sgd"], run_dir
    )
    capsys.readouterr()
    code, out, _ = _export(capsys, run_dir)
    assert code == 0
    assert sorted(p.name for p in (run_dir / "hf_export").iterdir()) == ["model.safetensors"]
    written = load_file(run_dir / "hf_export" / "model.safetensors")
    weights = torch.load(run_dir / "model.pt", weights_only=True)
    line = f"model.safetensors ({len(weights)} tensors) alone, under dtf's own names (the model is not a transformers"
    assert line in out
    assert written.keys() == weights.keys()
    assert all(torch.equal(written[k], weights[k]) for k in weights)


def test_bad_input_is_one_line_naming_the_path_and_the_fix_and_writes_nothing(
    trained: Path, fsdp_export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    no_checkpoint = tmp_path / "run"
    (no_checkpoint / ".hydra").mkdir(parents=True)
    interrupted = tmp_path / "interrupted"
    shutil.copytree(trained / "fsdp" / "checkpoints", interrupted / "checkpoints")
    for marker in (interrupted / "checkpoints").glob("*/COMMITTED.json"):
        marker.unlink()  # saves that never committed
    empty = tmp_path / "empty"
    empty.mkdir()
    lone = tmp_path / "lone" / f"step_{STEPS:09d}"  # a transformers model's checkpoint away from its run's hf/
    shutil.copytree(trained / "fsdp" / "checkpoints" / lone.name, lone)
    damaged = tmp_path / "damaged"
    shutil.copytree(trained / "fsdp", damaged)
    shard = sorted((damaged / "checkpoints" / lone.name).glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte flipped in place, the same size
    shard.write_bytes(bytes(data))
    cases = {
        (no_checkpoint,): f"{no_checkpoint} has no committed checkpoint: export a run that saved one",
        (interrupted,): f"{interrupted} has no committed checkpoint: export a run that saved one",
        (empty,): f"{empty} is neither a run directory nor a checkpoint: give a run directory or one of its step_*",
        (tmp_path / "missing",): f"{tmp_path / 'missing'} is neither a run directory nor a checkpoint",
        (lone,): f"checkpoint {lone} holds a transformers model (hf.* tensors), but no hf/ folder",
        (trained / "fsdp",): f"--out {fsdp_export} is not empty: give a new or empty folder (--out)",
        (trained / "fsdp", "--max-shard-size", "lots"): "--max-shard-size lots: give a size such as 5GB",
        (damaged, "--out", str(tmp_path / "out")): f"checkpoint {shard.parent} is not intact ({shard.name} is damaged",
    }
    before = sorted(p for p in tmp_path.rglob("*"))
    exported = (fsdp_export / "model.safetensors").read_bytes()
    for args, line in cases.items():
        code, out, err = _export(capsys, *args)
        assert code == 2 and out == "", args
        assert err.startswith(f"dtf: error: {line}") and err.count("\n") == 1, err
    assert sorted(p for p in tmp_path.rglob("*")) == before
    assert (fsdp_export / "model.safetensors").read_bytes() == exported
    assert not list(trained.glob("*/*.partial"))


def test_export_at_the_end_needs_the_final_checkpoint() -> None:
    from dtf.errors import UserError
    from dtf.preflight import validate
    from tests.helpers.inprocess import compose

    with pytest.raises(UserError, match=r"^checkpoint.export_hf=True is invalid: it exports the final checkpoint"):
        validate(compose("checkpoint.export_hf=true", "checkpoint.at_end=false"))


def _vit_and_bert(root: Path) -> dict[str, tuple[Path, list[str]]]:
    """The other two families, each with the overrides that train it on its kind of data."""
    vit, bert = save_vit(root / "vit"), save_bert(root / "bert")
    data_of_bert = [
        "data=digits",
        "~data.dataset.image_size",
        "~data.dataset.test_fraction",
        "~data.dataset.seed",
        "data.dataset._target_=tests.helpers.token_data.classes",
        f"+data.dataset.folder={bert}",
    ]
    return {
        "vit": (vit, ["model.auto_class=AutoModelForImageClassification", "data=digits"]),
        "bert": (bert, ["model.auto_class=AutoModelForSequenceClassification", *data_of_bert]),
    }


def test_vit_and_bert_export_their_folders_untrained_and_dtfs_logits_after_fsdp(tmp_path: Path) -> None:
    """ViTForImageClassification and BertForSequenceClassification: an untrained checkpoint
    exports the folder's weights bit for bit; after 2 FSDP ranks trained them, from_pretrained of
    the export gives the logits of dtf's own model.pt, exactly (fp32, the same transformers code)."""
    from transformers import AutoModelForImageClassification, AutoModelForSequenceClassification

    families = _vit_and_bert(tmp_path)
    base = {
        name: ["model=hf", f"model.name_or_path={folder}", *args, "loss=cross_entropy", "metrics=none"]
        for name, (folder, args) in families.items()
    }
    for name, (folder, _) in families.items():
        run_dir = tmp_path / f"untrained_{name}"
        train_in_process([*base[name], *LR_ZERO, "trainer.max_steps=2", "checkpoint.export_hf=true"], run_dir)
        given, written = load_file(folder / "model.safetensors"), load_file(run_dir / "hf_export" / "model.safetensors")
        assert written.keys() == given.keys()
        assert all(torch.equal(written[k], v) for k, v in given.items()), name
    runs = [
        (name, [*base[name], *SGD, "strategy=fsdp", "trainer.max_steps=2", "checkpoint.export_hf=true"])
        for name in families
    ]
    train_on_ranks(2, runs, tmp_path / "fsdp")
    inputs = {
        "vit": {"pixel_values": torch.randn(3, 1, 28, 28, generator=torch.Generator().manual_seed(0))},
        "bert": {"input_ids": torch.randint(5, 100, (3, 12), generator=torch.Generator().manual_seed(0))},
    }
    for name, auto in (("vit", AutoModelForImageClassification), ("bert", AutoModelForSequenceClassification)):
        run_dir = tmp_path / "fsdp" / name
        ours = HFModel(str(families[name][0]), auto.__name__)
        weights = torch.load(run_dir / "model.pt", weights_only=True)
        ours.load_state_dict(weights)
        theirs = auto.from_pretrained(run_dir / "hf_export")
        ours.eval(), theirs.eval()
        with torch.no_grad():
            assert torch.equal(theirs(**inputs[name]).logits, ours.hf(**inputs[name]).logits), name
