"""data=text, checked against the text itself tokenized by the tokenizer, independently of dtf:
every token of the corpus in exactly one trained sequence per epoch on 1, 2 and 3 ranks, the
token cache made once and made anew when the tokenizer or the text changes, a resume mid-epoch,
perplexity as exp of the exact loss, and the bad-input lines.

Ranks are simulated in one process where the data is what is tested (a rank's batches are a
pure function of its rank and the world size); the runs at the end use real ranks."""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dtf.config.schema import TextDataConfig
from dtf.data import text
from dtf.dist.env import DistEnv
from dtf.errors import UserError
from tests.helpers.hf_models import CORPUS, save_llama, save_vit, train_tokenizer
from tests.helpers.inprocess import compose_config, train_on_ranks
from tests.helpers.run_command import run_dtf
from tests.helpers.token_lm import OVERRIDES

SEQ_LEN = 16


def documents() -> list[str]:
    """Documents of different lengths (a few tokens to several sequences), some with unseen words."""
    return [" ".join(CORPUS[: 1 + i % len(CORPUS)]) + f" Item {i} of {'many ' * (i % 5)}." for i in range(8)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("llama") / "model", max_positions=64)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of .txt files, one document each."""
    folder = tmp_path_factory.mktemp("text") / "corpus"
    folder.mkdir()
    for i, doc in enumerate(documents()):
        (folder / f"doc{i:02d}.txt").write_text(doc)
    return folder


def expected_sequences(model: Path, docs: list[str]) -> list[tuple[int, ...]]:
    """The corpus as transformers' tokenizer makes it: each document's ids, then EOS, all joined
    and cut into SEQ_LEN tokens (the last sequence shorter)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    stream = [t for doc in docs for t in [*tokenizer(doc)["input_ids"], tokenizer.eos_token_id]]
    return [tuple(stream[i : i + SEQ_LEN]) for i in range(0, len(stream), SEQ_LEN)]


def config(corpus: Path, model: Path, **settings: Any) -> TextDataConfig:
    return TextDataConfig(path=str(corpus), tokenizer=str(model), **{"seq_len": SEQ_LEN, **settings})


def env(rank: int = 0, world: int = 1) -> DistEnv:
    return DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))


def epoch(data: Any, number: int, start_batch: int = 0) -> list[dict[str, torch.Tensor]]:
    data.set_epoch(number, start_batch)
    return list(data)


def trained(batch: dict[str, torch.Tensor]) -> list[tuple[int, ...]]:
    """Each row's tokens that the loss takes (labels not -100); () for a padding sequence."""
    return [
        tuple(ids[labels != -100].tolist()) for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True)
    ]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_token_of_the_corpus_is_trained_on_exactly_once_per_epoch(model: Path, corpus: Path, world: int) -> None:
    expected = Counter(expected_sequences(model, documents()))
    batch = 2
    for number in range(2):
        rows: list[tuple[int, ...]] = []
        lengths = set()
        for rank in range(world):
            data = text.build_splits(config(corpus, model, batch_size=batch), env(rank, world), seed=7).train
            batches = epoch(data, number)
            lengths.add(len(batches))
            for b in batches:
                assert b["input_ids"].shape == b["labels"].shape == (batch, SEQ_LEN)
                assert b["input_ids"].dtype == b["labels"].dtype == torch.int64
                # labels are the ids (transformers shifts them), -100 only where no token is
                kept = b["labels"] != -100
                assert torch.equal(b["labels"][kept], b["input_ids"][kept])
                rows += trained(b)
        assert lengths == {len(data)}  # the same number of batches on every rank
        padding = [r for r in rows if not r]
        assert Counter(r for r in rows if r) == expected  # every sequence once, none twice, none left out
        assert len(padding) == data.num_padding_per_epoch == len(rows) - expected.total() > 0  # 129 sequences
        assert data.num_repeated_per_epoch == 0


def test_remainder_drop_leaves_whole_sequences_out_and_none_twice(model: Path, corpus: Path) -> None:
    expected = Counter(expected_sequences(model, documents()))
    rows = []
    for rank in range(3):
        data = text.build_splits(config(corpus, model, batch_size=2, remainder="drop"), env(rank, 3), seed=7).train
        rows += [r for b in epoch(data, 0) for r in trained(b)]
    assert all(rows) and not Counter(rows) - expected  # no padding, nothing but the corpus's sequences
    assert len(rows) == expected.total() - data.num_dropped_per_epoch and data.num_dropped_per_epoch > 0


def test_validation_and_test_text_are_evaluated_every_sequence_once(model: Path, corpus: Path, tmp_path: Path) -> None:
    val_docs, test_docs = documents()[:3], documents()[5:]
    for name, docs in (("val", val_docs), ("test", test_docs)):
        (tmp_path / name).mkdir()
        for i, doc in enumerate(docs):
            (tmp_path / name / f"{i}.txt").write_text(doc)
    cfg = config(corpus, model, batch_size=2, eval_batch_size=3, val_path=str(tmp_path / "val"))
    cfg.test_path = str(tmp_path / "test")
    for name, docs in (("val", val_docs), ("test", test_docs)):
        rows = []
        for rank in range(3):
            data = getattr(text.build_splits(cfg, env(rank, 3), seed=0), name)
            rows += [r for j, b in enumerate(data) for r in trained(b)[: data.num_real_in_batch(j)]]
        assert rows == expected_sequences(model, docs)  # in order: rank 0's share first


def test_a_resume_mid_epoch_gives_the_batches_of_the_straight_run_on_any_world_size(model: Path, corpus: Path) -> None:
    two = [text.build_splits(config(corpus, model, batch_size=2), env(r, 2), seed=3).train for r in range(2)]
    straight = [epoch(d, 1) for d in two]
    for start in (1, len(straight[0]) - 1):
        resumed = epoch(two[1], 1, start_batch=start)
        assert all(torch.equal(a[k], b[k]) for a, b in zip(resumed, straight[1][start:], strict=True) for k in a)
    # one rank with the same global batch continues the two ranks' sequence (padding masks included)
    one = text.build_splits(config(corpus, model, batch_size=4), env(0, 1), seed=3).train
    global_steps = [{k: torch.cat([a[k], b[k]]) for k in a} for a, b in zip(*straight, strict=True)]
    start = one.seek(1, samples_in_epoch=2 * 4)
    assert start == 2
    resumed = epoch(one, 1, start_batch=start)
    assert len(resumed) == len(global_steps) - 2
    assert all(torch.equal(a[k], b[k]) for a, b in zip(resumed, global_steps[2:], strict=True) for k in a)
    assert any(not r for b in global_steps[2:] for r in trained(b))  # the resumed part holds padding


def test_jsonl_and_a_parquet_column_give_the_sequences_of_the_same_text(model: Path, tmp_path: Path) -> None:
    docs = documents()
    (tmp_path / "jsonl").mkdir()
    lines = [json.dumps({"id": i, "body": d}) for i, d in enumerate(docs)]
    (tmp_path / "jsonl" / "a.jsonl").write_text("\n".join(lines[:10]) + "\n")
    (tmp_path / "jsonl" / "b.jsonl").write_text("\n".join(lines[10:]) + "\n\n")  # a blank line is no document
    pq.write_table(pa.table({"body": docs, "n": list(range(len(docs)))}), tmp_path / "docs.parquet", row_group_size=5)
    (tmp_path / "lines.txt").write_text("\n".join(docs) + "\n")
    expected = expected_sequences(model, docs)
    for path, settings in [
        (tmp_path / "jsonl", {"text_field": "body"}),
        (tmp_path / "docs.parquet", {"text_field": "body"}),
        (tmp_path / "lines.txt", {"sample_by": "line"}),
    ]:
        folder = Path(text.prepare(config(path, model, **settings)).train)
        table = pq.read_table(folder)
        got = [
            tuple(ids[:n])
            for ids, n in zip(table["input_ids"].to_pylist(), table["num_tokens"].to_pylist(), strict=True)
        ]
        assert got == expected, path
        manifest = json.loads((folder / text.MANIFEST).read_text())
        assert manifest["documents"] == len(docs) and manifest["tokens"] == sum(map(len, expected))


def test_the_cache_is_reused_and_made_anew_when_the_tokenizer_or_the_text_changes(
    model: Path, corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text_dir, model_dir = tmp_path / "corpus", tmp_path / "model"
    shutil.copytree(corpus, text_dir, ignore=shutil.ignore_patterns(text.CACHE_FOLDER))
    shutil.copytree(model, model_dir)
    tokenized: list[Path] = []
    write = text.write_sequences

    def counted(docs: Any, tokenizer: Any, seq_len: int, folder: Path) -> dict[str, int]:
        tokenized.append(folder)
        return write(docs, tokenizer, seq_len, folder)

    monkeypatch.setattr(text, "write_sequences", counted)
    cfg = config(text_dir, model_dir)
    first = text.prepare(cfg).train
    assert len(tokenized) == 1 and Path(first).parent == text_dir / text.CACHE_FOLDER
    made = {p: p.stat().st_mtime_ns for p in Path(first).iterdir()}
    assert text.prepare(cfg).train == first and len(tokenized) == 1  # reused: no second tokenization
    assert {p: p.stat().st_mtime_ns for p in Path(first).iterdir()} == made
    # the text changes (same size, same file): a new cache
    doc = text_dir / "doc03.txt"
    doc.write_text(doc.read_text().replace("Item", "Itex"))
    second = text.prepare(cfg).train
    assert second != first and len(tokenized) == 2
    # the tokenizer changes (its files; the model's weights and config stay): a new cache
    train_tokenizer([*CORPUS, "Other text for another vocabulary."], vocab_size=300).save_pretrained(model_dir)  # type: ignore[attr-defined]
    third = text.prepare(cfg).train
    assert third not in (first, second) and len(tokenized) == 3
    assert text.prepare(cfg).train == third and len(tokenized) == 3
    # a cache folder elsewhere (the text's folder not writable)
    cache = tmp_path / "cache"
    assert Path(text.prepare(config(text_dir, model_dir, cache_dir=str(cache))).train).parent == cache


def one_line(cfg: TextDataConfig) -> str:
    with pytest.raises(UserError) as err:
        text.prepare(cfg)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_bad_input_is_refused_in_one_line_and_nothing_is_written(model: Path, corpus: Path, tmp_path: Path) -> None:
    vit = save_vit(tmp_path / "vit")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "table.csv").write_text("a,b\n")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.jsonl").write_text('{"text": "fine"}\n{"text": "also fine"}\n{"body": "no text field"}\n')
    before = sorted(tmp_path.rglob("*"))
    assert one_line(config(corpus, vit)).startswith(f"data.tokenizer={vit} holds no tokenizer")
    assert one_line(config(corpus, model, text_field="body")).startswith(
        "data.text_field=body applies to .jsonl and Parquet, and data.path="
    )  # .txt is read whole: a field there would be ignored
    assert one_line(config(corpus, model, seq_len=65)) == (
        f"data.seq_len=65 is longer than the model's 64 positions (max_position_embeddings in {model}'s "
        "config.json): use data.seq_len=64 or less"
    )
    assert one_line(config(tmp_path / "notes", model)).startswith(f"data.path={tmp_path / 'notes'} holds no text files")
    assert one_line(config(tmp_path / "nope", model)).startswith(f"data.path={tmp_path / 'nope'} does not exist")
    assert one_line(config(bad, model)) == (
        f"data.path: {bad / 'a.jsonl'}:3 has no text field 'text' (its keys: body): give data.text_field=<the field "
        "holding the text>"
    )
    assert one_line(config(corpus, model, val_path=str(bad))).startswith(f"data.val_path: {bad / 'a.jsonl'}:3")
    assert one_line(TextDataConfig(path=str(corpus), tokenizer=None)).startswith("data.tokenizer is not set")
    assert sorted(tmp_path.rglob("*")) == before  # no cache, not even its folder


def test_a_bad_line_exits_2_without_a_traceback_and_writes_nothing(model: Path, tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text('{"content": "no text field"}\n')
    run = run_dtf(
        [
            *OVERRIDES,
            "data=text",
            f"data.path={tmp_path / 'bad.jsonl'}",
            f"data.tokenizer={model}",
            "data.seq_len=16",
            "launcher.nproc=1",
        ],
        tmp_path / "run",
        expect=2,
    )
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0] == (
        f"dtf: error: data.path: {tmp_path / 'bad.jsonl'}:1 has no text field 'text' (its keys: content): give "
        "data.text_field=<the field holding the text>"
    ), run.stderr
    assert not (tmp_path / text.CACHE_FOLDER).exists() and not (run.run_dir / "summary.json").exists()


def test_training_on_two_ranks_reports_perplexity_as_exp_of_the_exact_loss(
    model: Path, corpus: Path, tmp_path: Path
) -> None:
    overrides = [
        *OVERRIDES,
        "data=text",
        f"data.path={corpus}",
        f"data.tokenizer={model}",
        f"data.seq_len={SEQ_LEN}",
        "data.batch_size=2",
        "data.val_fraction=0.2",
        "metrics=perplexity",
        "trainer.max_epochs=2",
        "trainer.train_metrics=true",
        "optimizer.lr=0.05",
        "logger=[]",
    ]
    compose_config(overrides)  # the driver's check: it tokenizes, before the ranks start
    summary = train_on_ranks(2, [("run", overrides)], tmp_path)["run"]
    figures = summary["final_metrics"]
    for split in ("train", "val"):
        assert figures[f"{split}/perplexity"] == pytest.approx(math.exp(figures[f"{split}/loss"]), rel=1e-9)
    assert figures["val/loss"] < math.log(256)  # it learned something: below a uniform guess


def test_model_hf_trains_through_a_step_where_a_rank_holds_padding_alone(model: Path, tmp_path: Path) -> None:
    # 10 sequences on 2 ranks of 4: the last step's batch is padding alone on a rank (labels all
    # -100). Its loss counts nothing, trains nothing, and is not mistaken for a diverged step.
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(5):  # 10 sequences of 16 tokens: the second step holds 2, and 6 of padding
        (corpus / f"doc{i}.txt").write_text("Return the number of items.")
    overrides = [
        "model=hf",
        f"model.name_or_path={model}",
        "data=text",
        f"data.path={corpus}",
        "data.seq_len=16",
        "data.batch_size=4",
        "metrics=none",
        "trainer.max_epochs=1",
        "logger=[]",
    ]
    compose_config(overrides)
    summary = train_on_ranks(2, [("run", overrides)], tmp_path)["run"]
    assert summary["global_step"] == 2 and math.isfinite(summary["final_train_loss"])
