"""What +recipe=hf_causal_lm starts from, made offline on any machine: a text corpus, a tokenizer
trained on it, and a Llama-architecture causal LM saved with save_pretrained beside the tokenizer,
as a user's own model folder would be.

    .venv/bin/python recipes/hf_causal_lm_prepare.py --out data/stdlib_lm

The corpus is the docstrings of Python's standard library (every machine that runs dtf has it),
read from the sources with `ast` (nothing imported), one document per docstring, in a stable order:
<out>/corpus/train.jsonl. The tokenizer is a byte-level BPE trained on it with `tokenizers`; the
model (<out>/model) is initialised from its config (no weights exist offline to start from).
"""

from __future__ import annotations

import argparse
import ast
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

# Sources that are tests, demos or vendored code rather than the library's own documentation.
SKIPPED_PARTS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "dist-packages", "__pycache__"}


def stdlib_docstrings(min_chars: int = 40) -> Iterator[str]:
    """The docstrings of the standard library's modules, classes and functions, sorted by file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if SKIPPED_PARTS.intersection(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= min_chars:
                    yield doc


def train_tokenizer(texts: list[str], vocab_size: int) -> object:
    """A byte-level BPE (as Llama's and GPT-2's), wrapped as transformers wraps a fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--hidden-size", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--max-positions", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-docs", type=int, help="the first n docstrings only (tests)")
    args = p.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    texts = list(stdlib_docstrings())[: args.max_docs]
    corpus = args.out / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    with open(corpus / "train.jsonl", "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    tokenizer = train_tokenizer(texts, args.vocab_size)
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),  # type: ignore[arg-type]
        hidden_size=args.hidden_size,
        intermediate_size=args.hidden_size * 8 // 3 // 64 * 64,  # Llama's ~8/3 ratio, a multiple of 64
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden_size // 64,
        num_key_value_heads=args.hidden_size // 64,
        max_position_embeddings=args.max_positions,
        bos_token_id=tokenizer.bos_token_id,  # type: ignore[attr-defined]
        eos_token_id=tokenizer.eos_token_id,  # type: ignore[attr-defined]
        pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(args.out / "model")
    tokenizer.save_pretrained(args.out / "model")  # type: ignore[attr-defined]
    chars = sum(len(t) for t in texts)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"{len(texts)} docstrings ({chars / 1e6:.1f} M characters) in {corpus / 'train.jsonl'}; a {params / 1e6:.1f} M "
        f"parameter Llama and its {len(tokenizer)}-token tokenizer in {args.out / 'model'}"  # type: ignore[arg-type]
    )


if __name__ == "__main__":
    main()
