"""The native paged prefill kernel: bitwise what the decode kernel computes for each
token, against SDPA in float64, its invariances, and its selection."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shared.config import default_cache_dir
from shared.errors import ConfigError
from shared.hardware import cpu_flags
from shared.kernels.build import build_library
from shared.kernels.paged_decode import PagedDecodeKernel
from shared.kernels.paged_prefill import SOURCE, PagedPrefillKernel
from shared.model.attention import DecodeBatch, PrefillSegment
from shared.model.prefill_attention import NativePrefill, SdpaPrefill, select_prefill_attention
from tests.shared.kernels.compiler import avx2_only_flags, has_compiler, needs_cc
from tests.shared.kernels.pools import DEFAULT_SHAPE, Shape, layer_pools

# On an AMX host the default build's bf16 tiles are AMX products; the AVX512-BF16 form
# that hosts without AMX run is built here too, so both forms keep their promises
# (bitwise decode rows, chunking, windows) whichever host the tests run on.
WITHOUT_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")


@pytest.fixture(scope="module", params=["default", "without AMX", "AVX2 only"])
def kernel(request: pytest.FixtureRequest) -> PagedPrefillKernel:
    if not has_compiler():
        pytest.skip("no C compiler on this machine")
    kernel_dir = default_cache_dir() / "kernels"
    if request.param == "default":
        return PagedPrefillKernel.build(kernel_dir)
    if request.param == "AVX2 only":
        return PagedPrefillKernel(build_library(SOURCE, kernel_dir, avx2_only_flags()))
    if "amx_tile" not in cpu_flags():
        pytest.skip("no AMX on this CPU: the default build is the form without it")
    return PagedPrefillKernel(build_library(SOURCE, kernel_dir, WITHOUT_AMX))


@dataclass(frozen=True)
class Case:
    q: torch.Tensor  # [n, heads, head_dim]: the newest n tokens of the context
    k_pool: torch.Tensor  # one layer's [blocks, block_size, kv_heads, head_dim] view
    v_pool: torch.Tensor
    table: torch.Tensor  # int64 block ids of the context
    context_len: int

    @property
    def scale(self) -> float:
        return float(self.q.shape[2] ** -0.5)


def make_case(
    *,
    dtype: torch.dtype,
    n: int,
    context_len: int,
    shape: Shape = DEFAULT_SHAPE,
    seed: int = 0,
) -> Case:
    """The newest ``n`` of ``context_len`` tokens, the context's blocks shuffled
    through one layer's pools."""
    g = torch.Generator().manual_seed(seed)
    need = -(-context_len // shape.block_size)
    k_pool, v_pool = layer_pools(shape, need + 5, dtype, g)
    table = torch.randperm(need + 5, generator=g)[:need].contiguous()
    q = torch.randn(n, shape.heads, shape.head_dim, generator=g).to(dtype)
    return Case(q, k_pool, v_pool, table, context_len)


def sdpa(c: Case, dtype: torch.dtype | None = None, window: int | None = None) -> torch.Tensor:
    """SDPA over the gathered context, bottom-right causal (each row over its ``window``
    newest keys), in ``dtype`` (default: the case's)."""
    kv_heads, head_dim = c.k_pool.shape[2], c.k_pool.shape[3]
    keys = c.k_pool[c.table].reshape(-1, kv_heads, head_dim)[: c.context_len]
    values = c.v_pool[c.table].reshape(-1, kv_heads, head_dim)[: c.context_len]
    q = c.q
    if dtype is not None:
        q, keys, values = q.to(dtype), keys.to(dtype), values.to(dtype)
    n = q.shape[0]
    rows = torch.arange(n)[:, None] + c.context_len - n
    cols = torch.arange(c.context_len)[None, :]
    mask = cols <= rows
    if window is not None:
        mask &= cols > rows - window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=mask,
        scale=c.scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def run(kernel: PagedPrefillKernel, c: Case, window: int | None = None) -> torch.Tensor:
    out = torch.empty_like(c.q)
    kernel(c.q, c.k_pool, c.v_pool, c.table, c.context_len, c.scale, out, window=window)
    return out


def decode_rows(kernel: PagedPrefillKernel, c: Case, window: int | None = None) -> torch.Tensor:
    """What the decode kernel of ``kernel``'s build computes for each of the case's
    tokens, one row each."""
    decode = PagedDecodeKernel(kernel.library)
    prefix = c.context_len - c.q.shape[0]
    lens = [prefix + i + 1 for i in range(c.q.shape[0])]
    block_size = c.k_pool.shape[1]
    batch = DecodeBatch.build([c.table.tolist()] * len(lens), lens, block_size, "cpu")
    rows = torch.empty_like(c.q)
    decode(c.q, c.k_pool, c.v_pool, batch.tables, batch.lens, c.scale, rows, window=window)
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (32, 8, 128, 16), (4, 4, 64, 32), (12, 1, 32, 8), (24, 2, 48, 16)],
)
@pytest.mark.parametrize(("n", "context_len"), [(1, 1), (5, 5), (40, 40), (7, 50), (100, 333)])
def test_as_accurate_as_sdpa(
    kernel: PagedPrefillKernel,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    n: int,
    context_len: int,
) -> None:
    """Fresh prompts (n == context) and prompts on a cached prefix; GQA groups
    1-12 (a group of 12 spans several register blocks); block sizes other than a
    key tile. The error against float64 is within twice SDPA's own."""
    shape = Shape(heads, kv_heads, head_dim, block_size)
    c = make_case(dtype=dtype, n=n, context_len=context_len, shape=shape)
    exact = sdpa(c, torch.float64)
    ours = (run(kernel, c).double() - exact).abs().max().item()
    theirs = (sdpa(c).double() - exact).abs().max().item()
    assert ours <= max(2 * theirs, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [
        (9, 3, 64, 16),
        (32, 8, 128, 16),
        (12, 1, 32, 8),
        (10, 2, 40, 8),
        (4, 4, 64, 16),
        (8, 4, 64, 32),
        (16, 1, 64, 16),  # a group filling a 16-row tile half alone
        (40, 2, 64, 16),  # a group over 16: its heads split across tiles
    ],
)
def test_each_row_is_bitwise_what_decode_computes(
    kernel: PagedPrefillKernel,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
) -> None:
    """Token i of a prompt on a cached prefix, attended by prefill, equals the decode
    kernel's row for the same query over the same context: the KV a prefill
    recomputes for generated tokens (failover, preemption, a cached next turn) is
    the KV decode made. head_dim 40 takes the portable path in both."""
    shape = Shape(heads, kv_heads, head_dim, block_size)
    c = make_case(dtype=dtype, n=37, context_len=120, shape=shape, seed=7)
    assert torch.equal(run(kernel, c), decode_rows(kernel, c))


WINDOW_SHAPES = [
    (4, 1, 256, 16),  # Gemma 3 270M
    (9, 3, 64, 16),
    (12, 1, 32, 8),  # a block smaller than a key vector
    (10, 2, 40, 8),  # the portable path
    (8, 4, 64, 32),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), WINDOW_SHAPES)
@pytest.mark.parametrize("window", [1, 7, 16, 50])
def test_sliding_window_rows_are_accurate_and_bitwise_decode(
    kernel: PagedPrefillKernel,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    window: int,
) -> None:
    """A sliding window (Gemma 3's local layers): each row attends to its ``window``
    newest keys, as accurate as SDPA with the same mask, and each prefill row is
    bitwise the row decode computes for that token, on a prefix longer than the
    window (so rows start at unaligned keys, inside and across blocks)."""
    shape = Shape(heads, kv_heads, head_dim, block_size)
    c = make_case(dtype=dtype, n=41, context_len=130, shape=shape, seed=9)
    got = run(kernel, c, window)
    exact = sdpa(c, torch.float64, window)
    ours = (got.double() - exact).abs().max().item()
    theirs = (sdpa(c, window=window).double() - exact).abs().max().item()
    assert ours <= max(2 * theirs, 1e-5)
    assert torch.equal(got, decode_rows(kernel, c, window))
    if window < c.context_len:  # the window changes what the rows see
        assert not torch.equal(got, run(kernel, c))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_rows_do_not_depend_on_chunking(
    kernel: PagedPrefillKernel, dtype: torch.dtype
) -> None:
    """A 300-token prompt with a 64-token window, whole or in uneven chunks: the same bits;
    NaN in the pool before every row's window is never read."""
    shape = Shape(4, 1, 256, 16)
    c = make_case(dtype=dtype, n=300, context_len=300, shape=shape, seed=4)
    whole = run(kernel, c, 64)
    pieces = []
    for start, end in ((0, 37), (37, 38), (38, 200), (200, 300)):
        table = c.table[: -(-end // 16)].contiguous()
        chunk = Case(c.q[start:end].contiguous(), c.k_pool, c.v_pool, table, end)
        pieces.append(run(kernel, chunk, 64))
    assert torch.equal(torch.cat(pieces), whole)
    tail = Case(c.q[250:].contiguous(), c.k_pool, c.v_pool, c.table, 300)
    clean = run(kernel, tail, 64)
    for pool in (c.k_pool, c.v_pool):  # tokens 0 .. 175: before token 250's window
        pool[c.table[:11]] = float("nan")
    assert torch.equal(run(kernel, tail, 64), clean)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "context_len"), [(37, 37), (36, 101), (1, 33)])
def test_pool_slots_past_the_context_are_never_read(
    kernel: PagedPrefillKernel, dtype: torch.dtype, n: int, context_len: int
) -> None:
    """NaN in the unwritten slots of the context's last block (and in every block
    outside the table) changes nothing: odd lengths end a key pair there."""
    c = make_case(dtype=dtype, n=n, context_len=context_len, seed=11)
    clean = run(kernel, c)
    last = int(c.table[-1])
    used = c.context_len - (len(c.table) - 1) * c.k_pool.shape[1]
    outside = torch.ones(c.k_pool.shape[0], dtype=torch.bool)
    outside[c.table] = False
    for pool in (c.k_pool, c.v_pool):
        pool[last, used:] = float("nan")
        pool[outside] = float("nan")
    poisoned = run(kernel, c)
    assert not poisoned.isnan().any()
    assert torch.equal(poisoned, clean)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_chunking_or_threads(
    kernel: PagedPrefillKernel, dtype: torch.dtype
) -> None:
    """A prompt attended in one call, in uneven chunks (each on top of the
    previous ones' K/V), and on 1 or 2 threads gives bitwise the same rows."""
    c = make_case(dtype=dtype, n=300, context_len=300, seed=3)
    whole = run(kernel, c)
    pieces = []
    for start, end in ((0, 37), (37, 38), (38, 200), (200, 300)):
        table = c.table[: -(-end // 16)].contiguous()
        pieces.append(
            run(kernel, Case(c.q[start:end].contiguous(), c.k_pool, c.v_pool, table, end))
        )
    assert torch.equal(torch.cat(pieces), whole)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(run(kernel, c), whole)
    finally:
        torch.set_num_threads(threads)


def test_native_and_sdpa_prefill_agree(kernel: PagedPrefillKernel) -> None:
    """The two implementations of the boundary, on a segment over a cached prefix."""
    c = make_case(dtype=torch.float32, n=20, context_len=70, seed=5)
    seg = PrefillSegment(start=0, end=20, block_table=c.table, context_len=70)
    kv_new = torch.empty(20, 3, 64)  # SDPA reads the pools when a prefix is cached
    native = NativePrefill(kernel)(c.q, kv_new, kv_new, c.k_pool, c.v_pool, seg, c.scale)
    plain = SdpaPrefill()(c.q, kv_new, kv_new, c.k_pool, c.v_pool, seg, c.scale)
    torch.testing.assert_close(native, plain, atol=1e-5, rtol=1e-5)


def test_rejects_arguments_it_would_misread(kernel: PagedPrefillKernel) -> None:
    c = make_case(dtype=torch.float32, n=10, context_len=40)
    out = torch.empty_like(c.q)
    bad = [
        ("table length", lambda: kernel(c.q, c.k_pool, c.v_pool, c.table[:2].contiguous(), 40,
                                        0.1, out)),
        ("table outside the pool", lambda: kernel(c.q, c.k_pool, c.v_pool,
                                                  torch.tensor([0, 1, 999]), 40, 0.1, out)),
        ("query rows outside the context", lambda: kernel(c.q, c.k_pool, c.v_pool,
                                                          c.table[:1].contiguous(), 5, 0.1, out)),
        ("must be contiguous", lambda: kernel(c.q.transpose(1, 2).contiguous().transpose(1, 2),
                                              c.k_pool, c.v_pool, c.table, 40, 0.1, out)),
        ("dtypes", lambda: kernel(c.q.double(), c.k_pool, c.v_pool, c.table, 40, 0.1, out)),
        ("table must be int64", lambda: kernel(c.q, c.k_pool, c.v_pool, c.table.int(), 40, 0.1,
                                               out)),
    ]  # fmt: skip
    for match, call in bad:
        with pytest.raises(ValueError, match=match):
            call()


def test_selection(kernel: PagedPrefillKernel, tmp_path: Path) -> None:
    """auto: native on CPU (any head_dim), SDPA elsewhere; native where it cannot
    run is a clear error."""
    kdir = default_cache_dir() / "kernels"
    assert isinstance(
        select_prefill_attention("auto", torch.float32, 64, "cpu", kdir), NativePrefill
    )
    assert isinstance(
        select_prefill_attention("torch", torch.float32, 64, "cpu", kdir), SdpaPrefill
    )
    assert isinstance(
        select_prefill_attention("auto", torch.float32, 40, "cpu", kdir), NativePrefill
    )
    assert isinstance(
        select_prefill_attention("auto", torch.float32, 64, "cuda", kdir), SdpaPrefill
    )
    with pytest.raises(ConfigError, match="not cuda"):
        select_prefill_attention("native", torch.float32, 64, "cuda", kdir)


@needs_cc
def test_a_header_change_rebuilds(tmp_path: Path) -> None:
    """The build key covers the headers the source includes, not only the source."""
    src = tmp_path / "src"
    src.mkdir()
    for f in SOURCE.parent.glob("*.h"):
        shutil.copy(f, src / f.name)
    source = shutil.copy(SOURCE, src / SOURCE.name)
    first = build_library(Path(source), tmp_path / "out")
    header = src / "vector_math.h"
    header.write_text(header.read_text() + "\n/* changed */\n")
    second = build_library(Path(source), tmp_path / "out")
    assert second != first and second.exists()
