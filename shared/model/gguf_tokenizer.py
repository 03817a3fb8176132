"""Build a Hugging Face ``tokenizers`` tokenizer from GGUF tokenizer metadata.

Two kinds of vocabulary (``tokenizer.ggml.model``):

- ``gpt2``: byte-level BPE with the file's merges; the pre-tokenizer regex
  follows llama.cpp's ``tokenizer.ggml.pre``.
- ``llama``: SentencePiece BPE (Llama 2, Mistral, TinyLlama, Gemma): pieces with
  ``▁`` for a space, bytes as ``<0xNN>`` pieces for what no piece spells. The
  files carry no merges, so they are recovered from the vocabulary: every split of
  a piece into two pieces is a merge, ranked by the piece's score (Gemma: by its
  place in the file, which is its merge order; its scores are not). A text gets a
  leading space where ``tokenizer.ggml.add_space_prefix`` says (default: yes;
  Gemma: never). Gemma files store pieces of several spaces as spaces: they are
  respelled with ``▁`` so that the merges built from them match.
"""

from __future__ import annotations

from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

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


SPACE = "\u2581"  # SentencePiece's spelling of a space
_WHOLE = (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """``meta`` holds the ``tokenizer.ggml.*`` fields (and ``general.architecture``) as
    Python values."""
    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise ModelFormatError("GGUF metadata lacks tokenizer.ggml.tokens")
    if kind == "gpt2":
        tok = _byte_level(meta)
    elif kind == "llama":
        tok = _sentencepiece(meta)
    else:
        raise UnsupportedModelError(
            f"GGUF tokenizer model {kind!r} is not supported (Baton reads byte-level BPE "
            "'gpt2' and SentencePiece 'llama')"
        )
    _add_specials(tok, meta)
    return tok


def _byte_level(meta: dict[str, Any]) -> Tokenizer:
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if pre not in _PRE_TOKENIZERS:
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer {pre!r} is not supported; known: {sorted(_PRE_TOKENIZERS)}"
        )
    split_digits, regex = _PRE_TOKENIZERS[pre]
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
    return tok


def _sentencepiece(meta: dict[str, Any]) -> Tokenizer:
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    gemma = str(meta.get("general.architecture", "")).startswith("gemma")
    if gemma:  # several spaces are stored as spaces, looked up as SPACE pieces
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
        # Gemma's scores do not follow its merge order; its pieces' order in the file does
        rank: dict[str, float] = (
            {t: float(-i) for i, t in enumerate(tokens)}
            if gemma
            else dict(zip(tokens, map(float, scores), strict=True))
        )
        merges = recovered_merges(vocab, rank)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and int(unk_id) < len(tokens) else None
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    steps: list[Any] = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tok.normalizer = normalizers.Replace(" ", SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    else:
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE, prepend_scheme="first" if prefix else "never", split=False
        )
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def recovered_merges(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: each way to write a piece as
    two pieces, best-ranked piece first (then longer left, then longer right halves);
    a piece's splits in the order of their halves' ids."""
    found: list[tuple[str, str, float]] = []
    for piece, score in rank.items():
        halves = [
            (piece[:i], piece[i:])
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        halves.sort(key=lambda h: (vocab[h[0]], vocab[h[1]]))
        found += [(left, right, score) for left, right in halves]
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_specials(tok: Tokenizer, meta: dict[str, Any]) -> None:
    """Control pieces (and user-defined ones) are matched whole, never split; the BOS
    piece leads every text where the file says so (a SentencePiece vocabulary that
    does not say: yes, as llama.cpp does)."""
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type", []))
    spm = meta.get("tokenizer.ggml.model") == "llama"
    if spm:  # as transformers reads these files: user-defined pieces are added, not special
        control = [tokens[i] for i, t in enumerate(types) if t == _TOKEN_CONTROL]
        # (a piece of spaces was respelled: under its stored spelling it is no piece)
        vocab = tok.get_vocab()
        user = [t for t, kind in zip(tokens, types, strict=False) if kind == _TOKEN_USER_DEFINED]
        user = [t for t in user if t in vocab]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    else:
        whole = [t for t, kind in zip(tokens, types, strict=False) if kind in _WHOLE]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in whole])
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", spm) and bos_id is not None:
        bos = tokens[int(bos_id)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
        )
