"""The native paged decode kernel against a plain per-head reference, and its build cache."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from shared.config import default_cache_dir
from shared.errors import ConfigError, KernelBuildError
from shared.kernels.build import build_library
from shared.kernels.paged_decode import SOURCE, PagedDecodeKernel
from shared.model.attention import DecodeBatch
from shared.model.decode_attention import GatherDecode, NativeDecode, select_decode_attention
from tests.shared.kernels.compiler import avx2_only_flags, has_compiler, needs_cc
from tests.shared.kernels.pools import DEFAULT_SHAPE, Shape, layer_pools


@pytest.fixture(scope="module", params=["default", "AVX2 only"])
def kernel(request: pytest.FixtureRequest) -> PagedDecodeKernel:
    if not has_compiler():
        pytest.skip("no C compiler on this machine")
    kernel_dir = default_cache_dir() / "kernels"
    if request.param == "AVX2 only":
        return PagedDecodeKernel(build_library(SOURCE, kernel_dir, avx2_only_flags()))
    return PagedDecodeKernel.build(kernel_dir)


@dataclass(frozen=True)
class Case:
    q: torch.Tensor  # [B, heads, head_dim]
    k_pool: torch.Tensor  # one layer's [blocks, block_size, kv_heads, head_dim] view
    v_pool: torch.Tensor
    tables: list[list[int]]
    lens: list[int]

    def rows(self, start: int, end: int) -> Case:
        return Case(self.q[start:end], self.k_pool, self.v_pool, self.tables[start:end],
                    self.lens[start:end])  # fmt: skip


def make_case(
    *,
    dtype: torch.dtype,
    lens: list[int],
    shape: Shape = DEFAULT_SHAPE,
    seed: int = 0,
) -> Case:
    """Decode rows with shuffled, non-overlapping block tables into one layer's pools."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // shape.block_size) for n in lens]
    num_blocks = sum(need) + 3
    k_pool, v_pool = layer_pools(shape, num_blocks, dtype, g)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in need:
        tables.append(order[used : used + n])
        used += n
    q = torch.randn(len(lens), shape.heads, shape.head_dim, generator=g).to(dtype)
    return Case(q, k_pool, v_pool, tables, lens)


def reference(c: Case) -> torch.Tensor:
    """Textbook attention in float64, one sequence and one query head at a time."""
    q, k_pool, v_pool = c.q, c.k_pool, c.v_pool
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // k_pool.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, (table, n) in enumerate(zip(c.tables, c.lens, strict=True)):
        keys = k_pool[table].reshape(-1, k_pool.shape[2], head_dim)[:n].double()
        values = v_pool[table].reshape(-1, v_pool.shape[2], head_dim)[:n].double()
        for h in range(heads):
            scores = keys[:, h // group] @ q[b, h].double() / math.sqrt(head_dim)
            out[b, h] = torch.softmax(scores, 0) @ values[:, h // group]
    return out


def run(kernel: PagedDecodeKernel, c: Case) -> torch.Tensor:
    batch = DecodeBatch.build(c.tables, c.lens, c.k_pool.shape[1], "cpu")
    out = torch.empty_like(c.q)
    kernel(c.q, c.k_pool, c.v_pool, batch.tables, batch.lens, c.q.shape[2] ** -0.5, out)
    return out


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # atol = rtol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [
        (9, 3, 64, 16),  # the default model: vector path, head_dim and group specialized
        (4, 4, 128, 16),
        (32, 4, 128, 16),  # the largest specialized group
        (16, 1, 64, 16),  # a group too large to specialize: one query head at a time
        (8, 2, 48, 4),  # a head_dim the vector path takes unspecialized
        (6, 1, 32, 1),
        (10, 2, 40, 8),  # head_dim not a multiple of 16: the portable path
    ],
)
def test_matches_reference(
    kernel: PagedDecodeKernel,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
) -> None:
    lens = [1, 15, 16, 17, 100, 3]  # a single token, block edges, ragged lengths
    case = make_case(dtype=dtype, lens=lens, shape=Shape(heads, kv_heads, head_dim, block_size))
    got = run(kernel, case)
    want = reference(case)
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_batch_or_threads(
    kernel: PagedDecodeKernel, dtype: torch.dtype
) -> None:
    lens = [300, 7, 129, 64]
    case = make_case(dtype=dtype, lens=lens, seed=1)
    batched = run(kernel, case)
    for b in range(len(lens)):
        alone = run(kernel, case.rows(b, b + 1))
        assert torch.equal(alone[0], batched[b])  # bitwise: greedy tokens cannot flip
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run(kernel, case)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, batched)


def test_agrees_with_the_torch_path(kernel: PagedDecodeKernel) -> None:
    lens = [40, 200, 13]
    c = make_case(dtype=torch.float32, lens=lens, seed=2)
    batch = DecodeBatch.build(c.tables, lens, 16, "cpu")
    native = NativeDecode(kernel)(c.q, c.k_pool, c.v_pool, batch, 0.125)
    gathered = GatherDecode(torch.float32, "cpu")(c.q, c.k_pool, c.v_pool, batch, 0.125)
    torch.testing.assert_close(native, gathered, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 17, 64, 500])
def test_a_sliding_window_agrees_with_the_torch_path(
    kernel: PagedDecodeKernel, window: int
) -> None:
    """Rows shorter and longer than the window, in one batch; a window changes rows
    past it only."""
    lens = [40, 200, 13, 77]
    c = make_case(dtype=torch.float32, lens=lens, seed=4)
    batch = DecodeBatch.build(c.tables, lens, 16, "cpu")
    native = NativeDecode(kernel)(c.q, c.k_pool, c.v_pool, batch, 0.125, window)
    gathered = GatherDecode(torch.float32, "cpu")(c.q, c.k_pool, c.v_pool, batch, 0.125, window)
    torch.testing.assert_close(native, gathered, atol=1e-5, rtol=1e-5)
    whole = NativeDecode(kernel)(c.q, c.k_pool, c.v_pool, batch, 0.125)
    for row, n in enumerate(lens):
        assert torch.equal(native[row], whole[row]) == (n <= window), (n, window)


def test_rejects_arguments_it_would_misread(kernel: PagedDecodeKernel) -> None:
    lens = [20, 5]
    c = make_case(dtype=torch.float32, lens=lens)
    q, k_pool, v_pool = c.q, c.k_pool, c.v_pool
    batch = DecodeBatch.build(c.tables, lens, 16, "cpu")
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="int64"):
        kernel(q, k_pool, v_pool, batch.tables.int(), batch.lens, 1.0, out)
    with pytest.raises(ValueError, match="lens exceed"):
        kernel(q, k_pool, v_pool, batch.tables, batch.lens + 100, 1.0, out)
    with pytest.raises(ValueError, match="dtypes"):
        kernel(q.double(), k_pool, v_pool, batch.tables, batch.lens, 1.0, out.double())
    with pytest.raises(ValueError, match="pool inner layout"):
        kernel(
            q, k_pool.transpose(1, 2), v_pool.transpose(1, 2), batch.tables, batch.lens, 1.0, out
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_stores_what_an_indexed_write_stores(
    kernel: PagedDecodeKernel, dtype: torch.dtype
) -> None:
    c = make_case(dtype=dtype, lens=[40, 40, 40, 40], seed=3)
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(4, 15 * 64, generator=g).to(dtype)  # rows strided, as the model's are
    k = qkv[:, 9 * 64 : 12 * 64].view(4, 3, 64)
    v = qkv[:, 12 * 64 :].view(4, 3, 64)
    blocks = torch.tensor([t[1] for t in c.tables], dtype=torch.int64)
    offsets = torch.tensor([0, 5, 15, 7], dtype=torch.int64)
    want_k, want_v = c.k_pool.clone(), c.v_pool.clone()
    want_k[blocks, offsets] = k
    want_v[blocks, offsets] = v
    kernel.write(k, v, c.k_pool, c.v_pool, blocks, offsets)
    assert torch.equal(c.k_pool, want_k) and torch.equal(c.v_pool, want_v)  # nothing else moved
    NativeDecode(kernel).write(c.k_pool, c.v_pool, v, k, blocks, offsets)
    assert torch.equal(c.k_pool[blocks, offsets], v) and torch.equal(c.v_pool[blocks, offsets], k)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_prompts_rows_are_written_as_an_indexed_write_on_any_thread_count(
    kernel: PagedDecodeKernel, threads: int
) -> None:
    """A prompt's hundreds of rows (split over the threads) land where an indexed write
    puts them, token after token through its blocks."""
    c = make_case(dtype=torch.bfloat16, lens=[300], seed=5)
    n, bs = 300, c.k_pool.shape[1]
    qkv = torch.randn(n, 15 * 64, generator=torch.Generator().manual_seed(6)).bfloat16()
    k, v = qkv[:, 9 * 64 : 12 * 64].view(n, 3, 64), qkv[:, 12 * 64 :].view(n, 3, 64)
    table = torch.tensor(c.tables[0], dtype=torch.int64)
    blocks, offsets = table[torch.arange(n) // bs], torch.arange(n) % bs
    want_k, want_v = c.k_pool.clone(), c.v_pool.clone()
    want_k[blocks, offsets] = k
    want_v[blocks, offsets] = v
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernel.write(k, v, c.k_pool, c.v_pool, blocks, offsets)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(c.k_pool, want_k) and torch.equal(c.v_pool, want_v)


def test_write_refuses_indexes_outside_the_pool(kernel: PagedDecodeKernel) -> None:
    c = make_case(dtype=torch.float32, lens=[16])
    k = torch.ones(2, 3, 64)
    before = c.k_pool.clone()
    for blocks, offsets in (([0, c.k_pool.shape[0]], [0, 0]), ([0, 0], [0, 16]), ([-1, 0], [0, 0])):
        with pytest.raises(IndexError, match="outside the pool"):
            kernel.write(k, k, c.k_pool, c.v_pool, torch.tensor(blocks), torch.tensor(offsets))
    assert torch.equal(c.k_pool, before)  # checked before anything is written
    with pytest.raises(ValueError, match="one block and offset per row"):
        kernel.write(k, k, c.k_pool, c.v_pool, torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="dtypes"):
        kernel.write(k.double(), k.double(), c.k_pool, c.v_pool, torch.tensor([0, 1]),
                     torch.tensor([0, 1]))  # fmt: skip


@needs_cc
def test_library_is_built_once_per_machine(tmp_path: Path) -> None:
    first = build_library(SOURCE, tmp_path)
    stamp = first.stat().st_mtime_ns
    again = build_library(SOURCE, tmp_path)
    assert again == first and again.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.glob("*.so")] == [first.name]  # no temporary left behind


def test_a_failing_compiler_is_a_clear_error_and_auto_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiler = tmp_path / "broken-cc"
    compiler.write_text("#!/bin/sh\necho 'error: no such thing' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    with pytest.raises(KernelBuildError, match="no such thing"):
        build_library(SOURCE, tmp_path / "k")
    auto = select_decode_attention("auto", torch.float32, "cpu", tmp_path / "k")
    assert isinstance(auto, GatherDecode)
    with pytest.raises(ConfigError, match="native decode attention kernel is unavailable"):
        select_decode_attention("native", torch.float32, "cpu", tmp_path / "k")
    assert isinstance(
        select_decode_attention("torch", torch.float32, "cpu", tmp_path), GatherDecode
    )
