from __future__ import annotations

import subprocess
import sys

import pytest

from shared.kv.block_hash import BlockHasher, sha256_128, xxh3_128

H = BlockHasher(namespace="model@sha256:abc|v1:L30:H3:D64:B4:float32", block_size=4)


def test_only_full_blocks_get_keys() -> None:
    assert len(H.keys(list(range(11)))) == 2
    assert H.keys([1, 2, 3]) == []


def test_chain_depends_on_every_earlier_token() -> None:
    a = H.keys([1, 2, 3, 4, 5, 6, 7, 8])
    b = H.keys([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[1] != b[1]  # same second block, different parent
    assert H.keys([1, 2, 3, 4, 5, 6, 7, 8, 9]) == a  # a tail does not change full blocks


def test_extra_keys_separate_namespaces() -> None:
    toks = list(range(8))
    assert H.keys(toks, cache_salt="a") != H.keys(toks, cache_salt="b")
    assert H.keys(toks, cache_salt="") != H.keys(toks)
    other_dtype = BlockHasher(namespace=H.namespace.replace("float32", "bfloat16"), block_size=4)
    assert other_dtype.keys(toks) != H.keys(toks)


def test_extending_as_tokens_arrive_equals_one_shot() -> None:
    toks = list(range(20))
    keys = H.keys(toks[:9])
    assert len(keys) == 2
    added = H.extend(keys, toks[:15])
    assert len(added) == 1 and len(keys) == 3
    assert H.extend(keys, toks) == H.keys(toks)[3:]
    assert keys == H.keys(toks)
    assert H.extend(keys, toks) == []  # nothing new


def test_hash_function_is_pluggable() -> None:
    fast = BlockHasher(namespace=H.namespace, block_size=4, hash_fn=xxh3_128)
    assert fast.keys(list(range(8))) != H.keys(list(range(8)))
    assert all(len(h) == 16 for h in fast.keys(list(range(8))))
    assert len(sha256_128(b"x")) == 16


def test_ids_are_stable_across_processes() -> None:
    code = (
        "from shared.kv.block_hash import BlockHasher;"
        f"print(BlockHasher(namespace={H.namespace!r}, block_size=4)"
        ".keys(list(range(12)), cache_salt='t')[-1].hex())"
    )
    env_runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert env_runs == {H.keys(list(range(12)), cache_salt="t")[-1].hex()}


def test_wrong_block_length_is_rejected() -> None:
    with pytest.raises(ValueError):
        H.chain(H.root(), [1, 2, 3])
