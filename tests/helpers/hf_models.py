"""Tiny Hugging Face models as a user has them: built from their configs, saved with
save_pretrained into a folder, with a tokenizer trained by `tokenizers` beside the text models.
Nothing is downloaded. Three families: a Llama-architecture causal LM, ViTForImageClassification
(for data=digits' 1x28x28 images) and BertForSequenceClassification."""

from __future__ import annotations

from pathlib import Path

import torch

# A corpus every machine has: a few lines of prose, repeated with variations (the tokenizer's training text).
CORPUS = [
    "Return a new list containing all items from the iterable in ascending order.",
    "Open file and return a corresponding file object. If the file cannot be opened, an OSError is raised.",
    "Return the number of items in a container.",
    "Create a new dictionary with keys from iterable and values set to value.",
    "Return the absolute value of a number. The argument may be an integer or a floating point number.",
    "Print objects to the text stream file, separated by sep and followed by end.",
]


def train_tokenizer(texts: list[str], vocab_size: int = 200, wordpiece: bool = False) -> object:
    """A fast tokenizer trained on texts with `tokenizers`, wrapped as transformers wraps one."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if wordpiece:  # as BERT's
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        tok.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials))
        return PreTrainedTokenizerFast(
            tokenizer_object=tok,
            unk_token="[UNK]",
            pad_token="[PAD]",
            cls_token="[CLS]",
            sep_token="[SEP]",
            mask_token="[MASK]",
        )
    tok = Tokenizer(models.BPE())  # byte-level BPE, as Llama's and GPT-2's
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def save_llama(folder: Path, texts: list[str] | None = None, seed: int = 0, max_positions: int = 64) -> Path:
    """A 2-layer Llama-architecture causal LM (a few thousand parameters) and its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = train_tokenizer(texts or CORPUS)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),  # type: ignore[arg-type]
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,  # type: ignore[attr-defined]
        eos_token_id=tokenizer.eos_token_id,  # type: ignore[attr-defined]
        pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)  # type: ignore[attr-defined]
    return folder


def save_tied_llama(folder: Path, seed: int = 0) -> Path:
    """save_llama's model and tokenizer with the LM head tied to the token embedding
    (tie_word_embeddings, as GPT-2's and Gemma's): save_pretrained writes the embedding alone."""
    from transformers import AutoConfig, LlamaForCausalLM

    save_llama(folder, seed=seed)
    config = AutoConfig.from_pretrained(folder)
    config.tie_word_embeddings = True
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def save_vit(folder: Path, seed: int = 0) -> Path:
    """ViTForImageClassification for 1x28x28 images in 10 classes (data=digits), no tokenizer."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    config = ViTConfig(
        image_size=28,
        patch_size=7,
        num_channels=1,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=10,
    )
    ViTForImageClassification(config).save_pretrained(folder)
    return folder


def save_bert(folder: Path, seed: int = 0, num_labels: int = 3) -> Path:
    """BertForSequenceClassification with its WordPiece tokenizer."""
    from transformers import BertConfig, BertForSequenceClassification

    tokenizer = train_tokenizer(CORPUS, wordpiece=True)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(tokenizer),  # type: ignore[arg-type]
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
    )
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)  # type: ignore[attr-defined]
    return folder
