"""`data=text`: text tokenized once into Parquet token ids, then read by dtf's Parquet reader.

The text (.txt or .jsonl files, or a string column of Parquet) is tokenized with the model's
tokenizer, each document followed by the tokenizer's EOS, and the token stream is cut into
sequences of data.seq_len: one Parquet row each (input_ids: list<int32>, num_tokens: the real
tokens, seq_len but for the last sequence, whose tail is padding). That is done once: the driver
does it before the ranks start (dtf.preflight), and a rank finds it done (else rank 0 does it while
the others wait). The result is cached under a key of everything it depends on: the tokenizer's
files, the text files' content, and the settings that shape the sequences. From then on the data
are the Parquet reader's, with every guarantee it gives; batches are dicts as transformers' causal
LMs take them: {"input_ids": [B, L], "labels": [B, L]}, labels equal to input_ids (the model
shifts them) and -100 where there is no token.

data.remainder=pad fills the last batches with sequences whose labels are all -100: the reader's
padding repeats sequences, and here they are masked so that they count no token. So every token
of the training text is in exactly one sequence a rank trains on per epoch (as in transformers'
run_clm, the first token of a sequence is context only: the model predicts the ones after it).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dtf.config.schema import ParquetDataConfig, SampleBy, TextDataConfig
from dtf.data.interface import DataSplits
from dtf.data.parquet.data import BatchLayout, ParquetEvalData, ParquetTrainData
from dtf.data.parquet.plan import share_bounds
from dtf.dist.env import DistEnv
from dtf.errors import EveryRankUserError, UserError

IDS = "input_ids"
NUM_TOKENS = "num_tokens"
CACHE_FOLDER = ".dtf-tokens"
MANIFEST = "_manifest.json"  # "_": not data to the Parquet listing
# Bump when what a cache holds changes: older caches are then made anew.
FORMAT = 1
SUFFIXES = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
# Files of a tokenizer folder that are not the tokenizer: left out of its key (weights are large).
NOT_TOKENIZER = {"config.json", "generation_config.json", MANIFEST}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
# About 1 MB of token ids per row group: a few per partition on small corpora, cheap to shuffle.
ROW_GROUP_TOKENS = 1 << 18
ENCODE_BATCH = 256  # documents per call of the tokenizer (its Rust side runs a batch in parallel)


@dataclass(frozen=True)
class Corpus:
    """A text source: its files (sorted) and how each holds documents."""

    key: str  # the config key that named it
    path: Path
    kind: str  # txt | jsonl | parquet
    files: tuple[Path, ...]


def list_corpus(path: str, key: str) -> Corpus:
    """The .txt, .jsonl or .parquet files of a file or folder (names starting with . or _ are not data)."""
    if "://" in path:
        raise UserError(f"{key}={path}: data=text reads local files only: copy the text to a local folder")
    root = Path(path).expanduser()
    if not root.exists():
        raise UserError(f"{key}={path} does not exist: give a .txt or .jsonl file or folder, or Parquet with text")
    if root.is_file():
        files = [root] if root.suffix in SUFFIXES else []
    else:
        files = sorted(
            f
            for f in root.rglob("*")
            if f.suffix in SUFFIXES
            and f.is_file()
            and not any(part.startswith((".", "_")) for part in f.relative_to(root).parts)
        )
    if not files:
        raise UserError(
            f"{key}={path} holds no text files (.txt, .jsonl, or .parquet with a text column): give the text's file "
            "or folder"
        )
    kinds = sorted({SUFFIXES[f.suffix] for f in files})
    if len(kinds) > 1:
        raise UserError(f"{key}={path} holds {' and '.join(kinds)} files: give a folder of one kind")
    return Corpus(key, root, kinds[0], tuple(files))


def text_field(cfg: TextDataConfig) -> str:
    """The jsonl field or Parquet column holding the text (data.text_field, "text" when unset)."""
    return cfg.text_field or "text"


def documents(corpus: Corpus, text_field: str, sample_by: SampleBy) -> Iterator[str]:
    """The corpus's documents in order; empty ones are skipped (they hold no token)."""
    for file in corpus.files:
        if corpus.kind == "txt":
            text = _read_text(file, corpus.key)
            parts = text.splitlines() if sample_by == SampleBy.line else [text]
            yield from (p for p in parts if p.strip())
        elif corpus.kind == "jsonl":
            yield from _jsonl_documents(file, text_field, corpus.key)
        else:
            yield from _parquet_documents(file, text_field, corpus.key)


def _read_text(file: Path, key: str) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{key}: {file} is not UTF-8 text ({e.reason} at byte {e.start}): save it as UTF-8") from None


def _jsonl_documents(file: Path, field: str, key: str) -> Iterator[str]:
    for number, line in enumerate(_read_text(file, key).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{key}: {file}:{number} is not JSON ({e.msg}): one JSON object per line") from None
        value = record.get(field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            has = f"its keys: {', '.join(record)}" if isinstance(record, dict) else "not an object"
            raise UserError(
                f"{key}: {file}:{number} has no text field {field!r} ({has}): give data.text_field=<the field "
                "holding the text>"
            )
        if value.strip():
            yield value


def _parquet_documents(file: Path, column: str, key: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(file)
    except Exception as e:
        raise UserError(f"{key}: {file} is not a readable Parquet file ({type(e).__name__}: {e})") from None
    schema = parquet.schema_arrow
    if column not in schema.names:
        raise UserError(
            f"{key}: {file} has no column {column!r} (its columns: {', '.join(schema.names)}): give "
            "data.text_field=<the column holding the text>"
        )
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise UserError(f"data.text_field: column {column!r} of {file} holds {kind}, not text: name a string column")
    for batch in parquet.iter_batches(columns=[column], batch_size=1024):
        values = batch.column(0)
        if values.null_count:
            raise UserError(f"{key}: column {column!r} of {file} has null values: fill or drop them first")
        yield from (v for v in values.to_pylist() if v.strip())


def load_tokenizer(name: str) -> Any:
    """AutoTokenizer of data.tokenizer; one line where there is none, or it has no EOS."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except Exception as e:
        line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UserError(
            f"data.tokenizer={name} cannot be loaded ({type(e).__name__}: {line}): give a folder or Hub id with the "
            "model's tokenizer"
        ) from None
    if tokenizer.eos_token_id is None:
        raise UserError(
            f"data.tokenizer={name} has no EOS token to end documents with: give a tokenizer with one (its eos_token)"
        )
    return tokenizer


def _tokenizer_name(cfg: TextDataConfig) -> str:
    if not cfg.tokenizer:
        raise UserError(
            "data.tokenizer is not set: give the tokenizer's folder or Hub id, e.g. data.tokenizer=path/to/model "
            "(with model=hf it is model.name_or_path)"
        )
    name = os.path.expanduser(cfg.tokenizer)
    if os.path.isdir(name) and not any(f in TOKENIZER_FILES or f.endswith(".model") for f in os.listdir(name)):
        raise UserError(
            f"data.tokenizer={cfg.tokenizer} holds no tokenizer ({', '.join(TOKENIZER_FILES[:2])}, ...): save the "
            "model's tokenizer there (tokenizer.save_pretrained), or give data.tokenizer=<a folder or Hub id with one>"
        )
    return name


def tokenizer_digest(name: str) -> str:
    """What the tokenizer is, by content: a folder's files but the weights and the model's config;
    a Hub id's loaded state (its files are in the Hub's cache, wherever that is)."""
    h = hashlib.sha256()
    if os.path.isdir(name):
        for file in sorted(Path(name).iterdir()):
            if file.is_file() and file.name not in NOT_TOKENIZER and not file.name.endswith(WEIGHT_SUFFIXES):
                h.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    else:
        tokenizer = load_tokenizer(name)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        h.update(backend.to_str().encode() if backend is not None else repr(tokenizer.get_vocab()).encode())
        h.update(repr(sorted(tokenizer.special_tokens_map.items())).encode())
    return h.hexdigest()


def model_positions(name: str) -> tuple[int, str] | None:
    """(the model's positions, the key saying so) from the config beside the tokenizer; None without one."""
    if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
        return None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name)
    except Exception:  # a tokenizer without a model config: nothing to check against
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            return value, key
    return None


def check_seq_len(cfg: TextDataConfig, name: str) -> None:
    positions = model_positions(name)
    if positions is not None and cfg.seq_len > positions[0]:
        raise UserError(
            f"data.seq_len={cfg.seq_len} is longer than the model's {positions[0]} positions ({positions[1]} in "
            f"{cfg.tokenizer}'s config.json): use data.seq_len={positions[0]} or less"
        )


def _file_digest(file: Path) -> str:
    with open(file, "rb") as f:
        digest = hashlib.blake2b()  # read by chunks (hashlib.file_digest is Python 3.11's; dtf runs on 3.10)
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
        return digest.hexdigest()


def cache_key(corpus: Corpus, cfg: TextDataConfig, tokenizer: str) -> str:
    """Everything the sequences depend on: the format, the tokenizer, the files' names and content,
    and the settings that shape them. Content, not modification times: a copy or a same-second
    edit is caught; hashing reads the text once per start (about 1 s per GB), far less than tokenizing it."""
    setting = {"txt": str(SampleBy(cfg.sample_by).value), "jsonl": text_field(cfg), "parquet": text_field(cfg)}
    h = hashlib.sha256(json.dumps([FORMAT, tokenizer, cfg.seq_len, corpus.kind, setting[corpus.kind]]).encode())
    base = corpus.path if corpus.path.is_dir() else corpus.path.parent
    for file in corpus.files:
        h.update(f"{file.relative_to(base)}\0{_file_digest(file)}\0".encode())
    return h.hexdigest()[:20]


def cache_root(corpus: Corpus, cfg: TextDataConfig) -> Path:
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    return (corpus.path if corpus.path.is_dir() else corpus.path.parent) / CACHE_FOLDER


@dataclass(frozen=True)
class Prepared:
    """The token caches (Parquet folders) of the splits."""

    train: str
    val: str | None
    test: str | None


@dataclass(frozen=True)
class _Pending:
    corpus: Corpus
    folder: Path  # where its cache belongs


def prepare(cfg: TextDataConfig) -> Prepared:
    """Every split's cache: found, or made (all of them written before any is put in place, so a
    bad file in one split leaves nothing behind)."""
    name = _tokenizer_name(cfg)
    check_seq_len(cfg, name)
    sources = {"train": list_corpus(cfg.path, "data.path")}
    for split in ("val", "test"):
        path = getattr(cfg, f"{split}_path")
        if path:
            sources[split] = list_corpus(path, f"data.{split}_path")
    for corpus in sources.values():
        if corpus.kind == "txt" and cfg.text_field is not None:
            raise UserError(
                f"data.text_field={cfg.text_field} applies to .jsonl and Parquet, and {corpus.key}={corpus.path} holds "
                ".txt files, whose whole text is read: remove it"
            )
        if corpus.kind != "txt" and cfg.sample_by != SampleBy.document:
            raise UserError(
                f"data.sample_by={SampleBy(cfg.sample_by).value} applies to .txt files, and {corpus.key}={corpus.path} "
                f"holds {corpus.kind}, one document per {'line' if corpus.kind == 'jsonl' else 'row'}: remove it"
            )
    digest = tokenizer_digest(name)
    folders: dict[str, Path] = {}
    missing: list[_Pending] = []
    for split, corpus in sources.items():
        folder = cache_root(corpus, cfg) / f"{split}-{cache_key(corpus, cfg, digest)}"
        folders[split] = folder
        if not (folder / MANIFEST).is_file():
            missing.append(_Pending(corpus, folder))
    if missing:
        _make(missing, cfg, name, digest)
    return Prepared(
        str(folders["train"]),
        str(folders["val"]) if "val" in folders else None,
        str(folders["test"]) if "test" in folders else None,
    )


def _make(missing: Sequence[_Pending], cfg: TextDataConfig, name: str, digest: str) -> None:
    tokenizer = load_tokenizer(name)
    made: list[tuple[Path, Path]] = []  # (temporary folder, its place)
    created: list[Path] = []  # cache roots made here, removed again if nothing goes in
    try:
        for pending in missing:
            root = pending.folder.parent
            if not root.exists():
                try:
                    root.mkdir(parents=True)
                except OSError as e:
                    raise _unwritable(pending.corpus, cfg, root, e) from None
                created.append(root)
            if not os.access(root, os.W_OK):
                raise _unwritable(pending.corpus, cfg, root, None)
            tmp = Path(tempfile.mkdtemp(prefix=".making-", dir=root))
            made.append((tmp, pending.folder))
            counts = write_sequences(
                documents(pending.corpus, text_field(cfg), cfg.sample_by), tokenizer, cfg.seq_len, tmp
            )
            if counts["tokens"] == 0:
                raise UserError(f"{pending.corpus.key}={pending.corpus.path} holds no text: give files with text")
            manifest = {
                "format": FORMAT,
                "tokenizer": cfg.tokenizer,
                "tokenizer_digest": digest,
                "seq_len": cfg.seq_len,
                "source": str(pending.corpus.path),
                "files": [str(f) for f in pending.corpus.files],
                **counts,
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        for tmp, folder in made:
            try:
                tmp.rename(folder)
            except OSError:  # another process (the driver, a sweep's trial) put the same cache in place first
                shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        for tmp, _ in made:
            shutil.rmtree(tmp, ignore_errors=True)
        for root in reversed(created):
            with_nothing = root.exists() and not any(root.iterdir())
            if with_nothing:
                root.rmdir()
        raise


def _unwritable(corpus: Corpus, cfg: TextDataConfig, root: Path, error: OSError | None) -> UserError:
    why = f" ({error.strerror})" if error is not None and error.strerror else ""
    key = "data.cache_dir" if cfg.cache_dir else corpus.key
    return UserError(
        f"{key}: cannot write the token cache to {root}{why}: give data.cache_dir=<a writable folder every rank reads>"
    )


def write_sequences(docs: Iterable[str], tokenizer: Any, seq_len: int, folder: Path) -> dict[str, int]:
    """Tokenizes docs (each followed by EOS) into rows of seq_len token ids, written as they fill."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    eos = int(tokenizer.eos_token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos  # ids under labels -100
    rows_per_group = max(1, ROW_GROUP_TOKENS // seq_len)
    schema = pa.schema([(IDS, pa.list_(pa.int32())), (NUM_TOKENS, pa.int32())])
    counts = {"documents": 0, "tokens": 0, "sequences": 0}
    carry = np.empty(0, np.int32)  # tokens of the stream not yet in a full sequence
    full: list[np.ndarray] = []  # full sequences not yet written
    num_full = 0

    def write(rows: np.ndarray, num_tokens: np.ndarray) -> None:
        offsets = pa.array(np.arange(len(rows) + 1, dtype=np.int32) * seq_len)
        ids = pa.ListArray.from_arrays(offsets, pa.array(rows.reshape(-1)))
        writer.write_table(pa.Table.from_arrays([ids, pa.array(num_tokens)], schema=schema))
        counts["sequences"] += len(rows)

    with pq.ParquetWriter(folder / "part-00000.parquet", schema) as writer:
        for batch in _batched(docs, ENCODE_BATCH):
            encoded = tokenizer(batch, verbose=False)[IDS]  # verbose: no warning about documents longer than a sequence
            pieces = [carry]
            for ids in encoded:
                pieces.append(np.asarray(ids if ids and ids[-1] == eos else [*ids, eos], dtype=np.int32))
            counts["documents"] += len(batch)
            stream = np.concatenate(pieces)
            n = len(stream) // seq_len
            full.append(stream[: n * seq_len].reshape(n, seq_len))
            carry = stream[n * seq_len :]
            num_full += n
            while num_full >= rows_per_group:  # whole row groups, as they fill
                rows = np.concatenate(full)
                write(rows[:rows_per_group], np.full(rows_per_group, seq_len, np.int32))
                full, num_full = [rows[rows_per_group:]], num_full - rows_per_group
        rows = np.concatenate(full) if full else np.empty((0, seq_len), np.int32)
        num_tokens = np.full(len(rows), seq_len, np.int32)
        if len(carry):  # the last sequence: its tokens, then padding its labels mask
            tail = np.full(seq_len, pad, np.int32)
            tail[: len(carry)] = carry
            rows = np.concatenate([rows, tail[None]])
            num_tokens = np.append(num_tokens, np.int32(len(carry)))
        if len(rows):
            write(rows, num_tokens)
    counts["tokens"] = (counts["sequences"] - (1 if len(carry) else 0)) * seq_len + len(carry)
    return counts


def _batched(items: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def parquet_view(cfg: TextDataConfig, prepared: Prepared) -> ParquetDataConfig:
    """The token caches as data=parquet reads them, with data=text's reading settings."""
    return ParquetDataConfig(
        path=prepared.train,
        val_path=prepared.val,
        test_path=prepared.test,
        feature_columns=[IDS],
        label_column=NUM_TOKENS,
        batch_size=cfg.batch_size,
        global_batch_size=cfg.global_batch_size,
        eval_batch_size=cfg.eval_batch_size,
        val_fraction=cfg.val_fraction,
        val_seed=cfg.val_seed,
        shuffle_row_groups=cfg.shuffle_row_groups,
        shuffle_rows=cfg.shuffle_rows,
        remainder=cfg.remainder,
        canonical_partitions=cfg.canonical_partitions,
        workers_count=cfg.workers_count,
        results_queue_size=cfg.results_queue_size,
    )


@dataclass(frozen=True)
class TokenLayout(BatchLayout):
    """A row's token ids and its number of real tokens, both int64 (as embeddings take ids)."""

    feature_columns: tuple[str, ...] = (IDS,)
    label_column: str = NUM_TOKENS
    feature_dtype: torch.dtype = torch.int64

    def arrays(self, cols: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        return cols[IDS].astype(np.int64), cols[NUM_TOKENS].astype(np.int64)


def token_batch(ids: torch.Tensor, num_tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"input_ids", "labels"}: labels are the ids, -100 beyond each row's num_tokens."""
    beyond = torch.arange(ids.shape[1]).unsqueeze(0) >= num_tokens.unsqueeze(1)
    return {IDS: ids, "labels": ids.masked_fill(beyond, -100)}


class TokenTrainData(ParquetTrainData):
    """The reader's training batches as token dicts; the rows its remainder=pad repeats to fill
    the last steps count no token (labels -100), so every sequence is trained on once per epoch."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        first, used = self._grid
        b = self.rows_per_step
        parts = self.partitions()
        owned = parts.owned(self.world_size, self.rank)
        # A partition's own rows come first in its stream; those after (padding) repeat its first ones.
        bounds = [share_bounds(parts.order.num_rows, self.num_partitions, c) for c in owned]
        shares = torch.tensor([stop - start for start, stop in bounds])
        offsets = torch.arange(b)
        for t, (ids, num_tokens) in enumerate(super().__iter__(), start=self.start_batch):
            row = used + (t - first) * b  # the partitions' row this step starts at
            real = ((row + offsets).unsqueeze(0) < shares.unsqueeze(1)).reshape(-1)
            yield token_batch(ids, num_tokens * real)

    @property
    def num_padding_per_epoch(self) -> int:
        """Sequences that fill the last steps (pad) and count no token, over all ranks."""
        return super().num_repeated_per_epoch

    @property
    def num_repeated_per_epoch(self) -> int:
        return 0  # the padding sequences count no token: nothing is trained on twice

    def describe(self) -> str:
        if self.pad:
            rest = f"{self.num_padding_per_epoch} padding sequences per epoch (labels -100: no token counts)"
        else:
            rest = f"{self.num_dropped_per_epoch} sequences dropped per epoch (data.remainder=drop)"
        return (
            f"{self.num_samples} token sequences in {len(self.stream.source.pieces)} row groups, {len(self)} "
            f"batches per rank per epoch, {rest}, {self.num_partitions} canonical partitions"
        )


class TokenEvalData(ParquetEvalData):
    """The reader's evaluation batches as token dicts (its padding rows are cut off by the evaluation)."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for ids, num_tokens in super().__iter__():
            yield token_batch(ids, num_tokens)


def prepared_on_rank0(cfg: TextDataConfig, env: DistEnv) -> Prepared:
    """prepare() on rank 0 (it finds what the driver made), its result sent to every rank."""
    if not dist.is_initialized() or env.world_size == 1:
        return prepare(cfg)
    box: list[Any] = [None]
    if env.rank == 0:
        try:
            box = [prepare(cfg)]
        except UserError as e:
            box = [str(e)]
        except BaseException:
            dist.broadcast_object_list([None], src=0)  # the others stop too; this rank's traceback tells why
            raise
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise EveryRankUserError(box[0])
    if box[0] is None:
        raise RuntimeError("rank 0 failed while tokenizing data=text (its error is rank 0's)")
    return box[0]


def build_splits(cfg: TextDataConfig, env: DistEnv, seed: int, recorded_partitions: int | None = None) -> DataSplits:
    from dtf.data.parquet import data as parquet

    view = parquet_view(cfg, prepared_on_rank0(cfg, env))
    return parquet.build_splits(
        view, env, seed, recorded_partitions, layout=TokenLayout(), train_class=TokenTrainData, eval_class=TokenEvalData
    )
