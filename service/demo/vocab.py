"""The demo tokenizer: byte-level BPE trained on the task corpus, with digits kept one per token.

Pre-tokenization keeps a lower-case label together with the digit after it (``c7``), so BPE learns one token
per labelled number: finding a label's value becomes matching one token, which a small decoder learns
quickly. Every other digit stands alone (arithmetic stays digit by digit), words merge as BPE likes, and any
text still encodes (byte-level: every byte has a token).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from service.tokenizer import SPECIAL_TOKENS, Tokenizer, write_tokenizer_files

PRETOKENIZE = r"[a-z][0-9]|[0-9]|[A-Za-z]+|\s+|[^\sA-Za-z0-9]+"


def train_tokenizer(texts: list[str], vocab_size: int) -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != expected_id:
            raise RuntimeError(f"special token {token!r} did not get id {expected_id}")
    return tok


def make_tokenizer(texts: list[str], vocab_size: int, out_dir: Path) -> Tokenizer:
    """Train, save (tokenizer.json + tokenizer_config.json) and load the demo tokenizer."""
    write_tokenizer_files(train_tokenizer(texts, vocab_size), out_dir)
    tok = Tokenizer.from_dir(out_dir)
    if tok is None or tok.eos_token_id is None:
        raise RuntimeError("tokenizer build produced no usable tokenizer.json")
    return tok
