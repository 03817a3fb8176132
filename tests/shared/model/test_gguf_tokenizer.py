"""SentencePiece vocabularies read from GGUF (``tokenizer.ggml.model == "llama"``): the
tokenizer built from a file encodes and decodes exactly as transformers' own GGUF
reader does, for a Llama-style file (scores rank the merges, a leading space is
added) and a Gemma-style one (file order ranks them, no leading space, pieces of
spaces stored as spaces, newline pieces user-defined), on texts that need merges,
byte fallback and whole special pieces."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFWriter

from shared.model.gguf_tokenizer import SPACE, build_tokenizer, recovered_merges

TEXTS = [
    "the cat and the hat sat in the sun",
    "  two leading spaces, then   three",
    "bytes: é ü 🙂 and tabs\tend",
    "new\nline\n\nand two",
    "<s>the</s> literal pieces",
    "",
]
PIECES = [
    "a", "b", "c", "d", "e", "h", "i", "n", "s", "t", "u", "l", "w", "o", ",",
    "th", "he", "the", "an", "and", "at", "in", "un", "su", "sun", "ca", "cat", "ha", "hat",
]  # fmt: skip


def vocabulary(gemma: bool) -> tuple[list[str], list[float], list[int]]:
    """Control pieces, the 256 byte pieces, then pieces best first (and, Gemma-style,
    pieces of spaces spelled with spaces and user-defined newline pieces)."""
    tokens = ["<pad>", "</s>", "<s>", "<unk>"] if gemma else ["<unk>", "<s>", "</s>"]
    types = [3, 3, 3, 2] if gemma else [2, 3, 3]
    if gemma:
        tokens += ["\n", "\n\n"]
        types += [4, 4]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    words = [SPACE, *PIECES, *(SPACE + p for p in PIECES)]
    kinds = [1] * len(words)
    if gemma:  # as Gemma files store them: spelled with spaces, user-defined
        words += ["  ", "   "]
        kinds += [4, 4]
    tokens += words
    types += kinds
    scores = [0.0] * (len(tokens) - len(words)) + [-float(i) for i in range(len(words))]
    return tokens, scores, types


def write(path: Path, gemma: bool) -> None:
    tokens, scores, types = vocabulary(gemma)
    wr = GGUFWriter(str(path), "gemma3" if gemma else "llama")
    wr.add_tokenizer_model("llama")
    wr.add_token_list(tokens)
    wr.add_token_scores(scores)
    wr.add_token_types(types)
    wr.add_bos_token_id(tokens.index("<s>"))
    wr.add_eos_token_id(tokens.index("</s>"))
    wr.add_unk_token_id(tokens.index("<unk>"))
    wr.add_add_bos_token(True)
    if gemma:
        wr.add_add_space_prefix(False)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


def metadata(path: Path) -> dict[str, object]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {name: field.contents() for name, field in reader.fields.items()}


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_encodes_and_decodes_as_transformers_reads_the_file(tmp_path: Path, gemma: bool) -> None:
    from transformers import AutoTokenizer

    path = tmp_path / "tok.gguf"
    write(path, gemma)
    ours = build_tokenizer(metadata(path))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True
        ), text
    assert ours.encode("the").ids[0] == metadata(path)["tokenizer.ggml.bos_token_id"]


def test_merges_follow_the_rank_then_the_longer_halves() -> None:
    vocab = {"a": 0, "b": 1, "ab": 2, "abb": 3, "bb": 4}
    rank = {"a": 0.0, "b": 0.0, "ab": -1.0, "bb": -2.0, "abb": -3.0}
    assert recovered_merges(vocab, rank) == [("a", "b"), ("b", "b"), ("ab", "b"), ("a", "bb")]
