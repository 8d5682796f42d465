"""model=hf: a transformers model by its Auto class, from a folder save_pretrained wrote. Its first
step in dtf is transformers' own forward on the same batch; pretrained=false is transformers'
initialisation; its blocks are transformers' _no_split_modules; bad settings are one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dtf.errors import UserError
from dtf.models.blocks import find_blocks
from dtf.models.hf import HFModel
from dtf.preflight import validate
from tests.helpers import token_data
from tests.helpers.hf_models import save_bert, save_llama, save_tied_llama, save_vit
from tests.helpers.inprocess import compose, train_in_process

# One step on the first batch, in the data's order, with nothing but the loss measured.
FIRST_STEP = ["trainer.max_steps=1", "data.shuffle=false", "data.batch_size=4", "metrics=none"]


def token_data_overrides(builder: str, folder: Path) -> list[str]:
    """data= a builder of tests/helpers/token_data.py over the model's own tokenizer."""
    return [
        "data=digits",
        "~data.dataset.image_size",
        "~data.dataset.test_fraction",
        "~data.dataset.seed",
        f"data.dataset._target_=tests.helpers.token_data.{builder}",
        f"+data.dataset.folder={folder}",
    ]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("hf")
    bert = save_bert(root / "bert")
    # No dropout: a training step's forward is then the same computation as transformers' eval forward.
    config = AutoConfig.from_pretrained(bert)
    config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
    config.save_pretrained(bert)
    return {
        "llama": save_llama(root / "llama"),
        "tied": save_tied_llama(root / "tied"),
        "vit": save_vit(root / "vit"),
        "bert": bert,
    }


@pytest.fixture(scope="module")
def llama_run(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """model=hf on the Llama folder, dict batches (hf_step), one step; its summary and run dir."""
    run_dir = tmp_path_factory.mktemp("llama_run")
    overrides = ["model=hf", f"model.name_or_path={folders['llama']}", *FIRST_STEP]
    summary = train_in_process([*overrides, *token_data_overrides("causal_lm", folders["llama"])], run_dir)
    return summary, run_dir


def test_a_causal_lm_step_is_transformers_own_loss(folders: dict[str, Path], llama_run: Any) -> None:
    from transformers import AutoModelForCausalLM

    summary, _ = llama_run
    train, _ = token_data.causal_lm(str(folders["llama"]))
    first = {k: v[:4] for k, v in train.columns.items()}
    reference = AutoModelForCausalLM.from_pretrained(folders["llama"])
    with torch.no_grad():
        expected = reference(**first).loss.item()
    # The same weights, batch and kernels in float32: the very same number.
    assert summary["final_train_loss"] == expected


def test_a_causal_lm_evaluation_weighs_tokens_not_batches(folders: dict[str, Path], llama_run: Any) -> None:
    from transformers import AutoModelForCausalLM

    summary, run_dir = llama_run
    _, test = token_data.causal_lm(str(folders["llama"]))
    trained = AutoModelForCausalLM.from_pretrained(folders["llama"])
    weights = torch.load(run_dir / "model.pt")
    trained.load_state_dict({k.removeprefix("hf."): v for k, v in weights.items()})
    with torch.no_grad():
        whole = trained(**test.columns).loss.item()  # every test token at once
        halves = [trained(**{k: v[i : i + 4] for k, v in test.columns.items()}).loss.item() for i in (0, 4)]
    # dtf evaluates 2 batches of 4 that hold different numbers of tokens; summed per batch, then
    # divided, in another order than one forward over all: equal to float32's rounding.
    assert summary["final_test_loss"] == pytest.approx(whole, rel=1e-6)
    assert sum(halves) / 2 != pytest.approx(whole, rel=1e-6)  # a mean of the batches' means would be caught


def test_the_run_dir_holds_the_config_and_tokenizer(folders: dict[str, Path], llama_run: Any) -> None:
    from transformers import AutoTokenizer

    _, run_dir = llama_run
    written = run_dir / "hf"
    for name in ("config.json", "generation_config.json"):  # what save_pretrained wrote beside the weights
        assert json.loads((written / name).read_text()) == json.loads((folders["llama"] / name).read_text()), name
    assert not any(written.glob("*.safetensors"))  # the weights are dtf's (model.pt, checkpoints)
    text = "Return the number of items in a container."
    ours, theirs = AutoTokenizer.from_pretrained(written), AutoTokenizer.from_pretrained(folders["llama"])
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]


def test_an_image_classifier_step_is_transformers_logits_into_dtfs_loss(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForImageClassification

    from dtf.data.datasets import digits

    overrides = ["model=hf", f"model.name_or_path={folders['vit']}", "model.auto_class=AutoModelForImageClassification"]
    summary = train_in_process([*overrides, "data=digits", "loss=cross_entropy", *FIRST_STEP], tmp_path / "run")
    images, labels = digits()[0][:4]
    reference = AutoModelForImageClassification.from_pretrained(folders["vit"])
    with torch.no_grad():
        expected = F.cross_entropy(reference(pixel_values=images).logits, labels).item()
    assert summary["final_train_loss"] == expected
    assert sorted(p.name for p in (tmp_path / "run" / "hf").iterdir()) == ["config.json"]  # no tokenizer


def test_a_sequence_classifier_step_is_transformers_logits_into_dtfs_loss(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForSequenceClassification

    overrides = [
        "model=hf",
        f"model.name_or_path={folders['bert']}",
        "model.auto_class=AutoModelForSequenceClassification",
        "loss=cross_entropy",
    ]
    run = [*overrides, *FIRST_STEP, *token_data_overrides("classes", folders["bert"])]
    summary = train_in_process(run, tmp_path / "run")
    ids, labels = token_data.class_columns(str(folders["bert"]), 4, 12, 3)
    reference = AutoModelForSequenceClassification.from_pretrained(folders["bert"])
    with torch.no_grad():
        expected = F.cross_entropy(reference(input_ids=ids).logits, labels).item()
    assert summary["final_train_loss"] == expected


def test_pretrained_false_is_transformers_initialisation(folders: dict[str, Path]) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(7)
    ours = HFModel(str(folders["llama"]), pretrained=False)
    torch.manual_seed(7)
    theirs = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folders["llama"]))
    ours_state, theirs_state = ours.state_dict(), theirs.state_dict()
    assert list(ours_state) == [f"hf.{k}" for k in theirs_state]
    for key, value in theirs_state.items():
        assert torch.equal(ours_state[f"hf.{key}"], value), key
    files = load_file(folders["llama"] / "model.safetensors")  # and not the files' weights
    assert not torch.equal(ours_state["hf.model.embed_tokens.weight"], files["model.embed_tokens.weight"])


def test_initialised_after_a_build_on_meta_as_transformers_initialises(folders: dict[str, Path]) -> None:
    """strategy.meta_init with pretrained=false: allocated, then transformers' own initialisation
    (dtf.strategy.base.initialise), buffers no file holds included (the rotary frequencies)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dtf.strategy.base import materialise_whole

    with torch.device("meta"):
        delayed = HFModel(str(folders["llama"]), pretrained=False)
    materialise_whole(delayed, torch.device("cpu"))
    eager = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folders["llama"]))
    std = AutoConfig.from_pretrained(folders["llama"]).initializer_range
    for name, tensor in eager.state_dict().items():
        ours = delayed.state_dict()[f"hf.{name}"]
        if "norm" in name:
            assert torch.equal(ours, tensor), name  # ones
        else:  # transformers' normal(0, initializer_range), not torch's default uniform
            assert abs(ours.std().item() - std) < 0.25 * std, (name, ours.std().item())
    for name, buffer in eager.named_buffers():  # non-persistent: computed, not loaded
        assert torch.equal(dict(delayed.hf.named_buffers())[name], buffer), name


def test_built_on_meta_with_pretrained_weights_loads_them_in_place(folders: dict[str, Path]) -> None:
    """strategy.meta_init=true under ddp, one process: allocated, initialised, then the files'
    weights, bit for bit; the tied output layer is the input embeddings."""
    from safetensors.torch import load_file

    from dtf.strategy.base import materialise_whole

    with torch.device("meta"):
        model = HFModel(str(folders["tied"]))
    assert all(p.is_meta for p in model.parameters()) and model.weights_pending
    materialise_whole(model, torch.device("cpu"))
    state = model.state_dict()
    for key, value in load_file(folders["tied"] / "model.safetensors").items():
        assert torch.equal(state[f"hf.{key}"], value), key
    assert model.hf.lm_head.weight is model.hf.model.embed_tokens.weight


def test_the_memory_check_counts_the_model_as_built(folders: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    from dtf import memory

    found = memory.estimate_built(lambda: HFModel(str(folders["tied"])), None, memory.WHOLE_REPLICA)
    real = AutoModelForCausalLM.from_pretrained(folders["tied"])
    assert found is not None and found.parameters == sum(p.numel() for p in real.parameters())  # tied: once
    half = memory.estimate_built(lambda: HFModel(str(folders["tied"]), dtype="bfloat16"), None, memory.WHOLE_REPLICA)
    assert half is not None and half.param_bytes == found.param_bytes // 2


def test_blocks_are_transformers_no_split_modules(folders: dict[str, Path]) -> None:
    with torch.device("meta"):
        classifier = HFModel(str(folders["bert"]), "AutoModelForSequenceClassification")
        masked_lm = HFModel(str(folders["bert"]), "AutoModelForMaskedLM", pretrained=False)
    assert classifier.block_classes == sorted(classifier.hf._no_split_modules or [])
    if "BertEmbeddings" in classifier.block_classes:  # (transformers 5.0 names none for BERT: the default rule)
        # BertEmbeddings is no child of a ModuleList: the default rule alone would leave it out.
        assert [type(b).__name__ for b in find_blocks(classifier, None)] == ["BertEmbeddings", "BertLayer", "BertLayer"]
    # Tied to the output layer, the embeddings cannot be a unit of their own: they stay in the root's.
    assert [type(b).__name__ for b in find_blocks(masked_lm, None)] == ["BertLayer", "BertLayer"]
    # A class the user names still wins.
    assert [type(b).__name__ for b in find_blocks(classifier, ["BertLayer"])] == ["BertLayer", "BertLayer"]


def test_activation_checkpointing_of_blocks_recomputes_the_decoder_layers_and_trains_alike(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    from dtf.train.blocks import checkpointed_blocks

    with torch.device("meta"):
        model = HFModel(str(folders["llama"]), pretrained=False)
    assert [type(b).__name__ for b in checkpointed_blocks(model, "blocks", None)] == ["LlamaDecoderLayer"] * 2
    assert [type(b).__name__ for b in checkpointed_blocks(model, "blocks", ["LlamaMLP"])] == ["LlamaMLP"] * 2
    # recomputed: each layer's attention runs twice in a training step, once in forward, once in backward
    from dtf.train.blocks import checkpoint_activations

    real = HFModel(str(folders["llama"])).train()
    checkpoint_activations(real, "blocks", None)
    calls: list[str] = []
    for name, module in real.named_modules():
        if name.endswith("self_attn"):
            module.register_forward_hook(lambda *_, name=name: calls.append(name))
    ids = torch.randint(0, real.hf.config.vocab_size, (2, 5))
    real(input_ids=ids, labels=ids).loss.backward()
    assert sorted(calls) == sorted(2 * ["hf.model.layers.0.self_attn", "hf.model.layers.1.self_attn"])
    # trained with and without: the same parameters bit for bit (the recomputation is the forward again)
    data = ["trainer.max_steps=3", *token_data_overrides("causal_lm", folders["llama"]), "+data.dataset.length=4"]
    data += ["+data.dataset.num_train=24", "+data.dataset.num_test=8", "metrics=none", "model=hf"]
    data += [f"model.name_or_path={folders['llama']}"]
    plain = train_in_process(data, tmp_path / "plain")
    recomputed = train_in_process([*data, "trainer.activation_checkpointing=blocks"], tmp_path / "ac")
    assert recomputed["params_sha256"] == plain["params_sha256"]


def test_activation_checkpointing_takes_class_names_blocks_or_null_and_refuses_the_rest() -> None:
    for bad in ("[]", "all", "[1]"):
        with pytest.raises(UserError, match=r"trainer.activation_checkpointing.*blocks \(the model's own\)"):
            validate(compose(f"trainer.activation_checkpointing={bad}"))


def test_a_dict_batch_without_labels_is_one_line(folders: dict[str, Path]) -> None:
    from dtf.models.hf import hf_step

    model = HFModel(str(folders["llama"]))
    with pytest.raises(UserError, match=r"a dict batch without labels \(its keys: input_ids\)"):
        hf_step(model, {"input_ids": torch.ones(2, 4, dtype=torch.long)}, lambda *a: torch.tensor(0.0))


def test_a_batch_of_padding_alone_counts_nothing_and_trains_nothing(folders: dict[str, Path]) -> None:
    # data=text pads the last steps with sequences whose labels are all -100: transformers' mean
    # over no label is NaN, which would stop the run as diverged. The step is a zero that counts
    # nothing and gives zero gradients.
    from dtf.models.hf import hf_step

    model = HFModel(str(folders["llama"]))
    ids = torch.randint(5, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    loss, count = hf_step(model, {"input_ids": ids, "labels": torch.full_like(ids, -100)}, lambda *a: torch.tensor(0.0))
    assert count == 0 and loss.item() == 0.0
    loss.backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


@pytest.mark.parametrize(
    ("settings", "line"),
    [
        ([], r"model.name_or_path is not set: give a folder that save_pretrained wrote, or a Hugging Face Hub id"),
        (["model.name_or_path={empty}"], r"model.name_or_path=.*: the folder has no config.json: give a folder"),
        (
            ["model.name_or_path={vit}"],
            r"model.auto_class=AutoModelForCausalLM does not build a vit model \(its "
            r"config.json\): use one of .*AutoModelForImageClassification",
        ),
        (
            ["model.name_or_path={llama}", "model.auto_class=AutoModelForCasualLM"],
            r"model.auto_class=AutoModelForCasualLM is not a transformers Auto model class \(did you mean "
            r"AutoModelForCausalLM\?\)",
        ),
        (["model.name_or_path={config_only}"], r"the folder holds no weights .*model.pretrained=false"),
        (["model.name_or_path={llama}", "model.dtype=fp16"], r"model.dtype=fp16 is invalid: use one of bfloat16"),
    ],
)
def test_bad_settings_are_refused_before_any_rank(
    folders: dict[str, Path], tmp_path: Path, settings: list[str], line: str
) -> None:
    (tmp_path / "empty").mkdir()
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text((folders["llama"] / "config.json").read_text())
    paths = {"empty": tmp_path / "empty", "config_only": config_only, **folders}
    overrides = ["model=hf", *(s.format(**paths) for s in settings)]
    with pytest.raises(UserError, match=line) as refused:
        validate(compose(*overrides))
    assert "\n" not in str(refused.value)


def test_a_folder_of_config_alone_builds_with_pretrained_false(tmp_path: Path, folders: dict[str, Path]) -> None:
    config = json.loads((folders["llama"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    validate(compose("model=hf", f"model.name_or_path={tmp_path}", "model.pretrained=false"))
