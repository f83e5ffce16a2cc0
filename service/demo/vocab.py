"""The demo tokenizer: byte-level BPE trained on the task corpus, with digits kept one per token.

Pre-tokenization keeps a lower-case label together with the digit after it (``c7``), so BPE learns one token
per labelled number: finding a label's value becomes matching one token, which a small decoder learns
quickly. Every other digit stands alone (arithmetic stays digit by digit), words merge as BPE likes, and any
text still encodes (byte-level: every byte has a token).
"""

from __future__ import annotations

from pathlib import Path

from service.tokenizer import Tokenizer, build_bpe_tokenizer, write_tokenizer_files

PRETOKENIZE = r"[a-z][0-9]|[0-9]|[A-Za-z]+|\s+|[^\sA-Za-z0-9]+"


def make_tokenizer(texts: list[str], vocab_size: int, out_dir: Path) -> Tokenizer:
    """Train, save (tokenizer.json + tokenizer_config.json) and load the demo tokenizer."""
    write_tokenizer_files(build_bpe_tokenizer(texts, vocab_size, PRETOKENIZE), out_dir)
    tok = Tokenizer.from_dir(out_dir)
    if tok is None or tok.eos_token_id is None:
        raise RuntimeError("tokenizer build produced no usable tokenizer.json")
    return tok
