"""Build a Hugging Face ``tokenizers`` tokenizer from GGUF tokenizer metadata.

Only byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) are
supported; the pre-tokenizer regex follows llama.cpp's ``tokenizer.ggml.pre``.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from shared.errors import ModelFormatError, UnsupportedModelError

_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp pre-tokenizer names -> (split digits one by one first?, regex)
_PRE_TOKENIZERS: dict[str, tuple[bool, str]] = {
    "default": (False, _GPT2_REGEX),
    "gpt2": (False, _GPT2_REGEX),
    "mpt": (False, _GPT2_REGEX),
    "olmo": (False, _GPT2_REGEX),
    "smollm": (True, _GPT2_REGEX),
    "starcoder": (True, _GPT2_REGEX),
    "refact": (True, _GPT2_REGEX),
    "codeshell": (True, _GPT2_REGEX),
    "llama-bpe": (False, _LLAMA3_REGEX),
    "llama3": (False, _LLAMA3_REGEX),
}

# GGUF token types (llama.cpp's llama_token_type)
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """``meta`` holds the ``tokenizer.ggml.*`` fields as Python values."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"GGUF tokenizer model {kind!r} is not supported (Baton reads byte-level BPE 'gpt2')"
        )
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if pre not in _PRE_TOKENIZERS:
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer {pre!r} is not supported; known: {sorted(_PRE_TOKENIZERS)}"
        )
    split_digits, regex = _PRE_TOKENIZERS[pre]
    if "tokenizer.ggml.tokens" not in meta:
        raise ModelFormatError("GGUF metadata lacks tokenizer.ggml.tokens")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    steps: list[Any] = []
    if split_digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps.append(pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type", []))
    specials = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(types)
        if t in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]
    tok.add_special_tokens(specials)
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos_id is not None:
        bos = tokens[int(bos_id)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
        )
    return tok
