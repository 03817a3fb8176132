"""A hand-made profile (not measured): round numbers the tests can reason about."""

from __future__ import annotations

from shared.capacity.profile import DecodePoint, PrefillPoint, Profile


def linear_profile(
    prefill_s_per_token: float = 0.001,
    decode_base_s: float = 0.01,
    decode_per_seq_s: float = 0.001,
    transfer_bytes_s: float = 1e12,
) -> Profile:
    """Prefill costs ``prefill_s_per_token`` per token on 1 thread (half on 2); a decode
    step ``decode_base_s + decode_per_seq_s * batch`` (context free); transfers ~free."""
    prefill = tuple(
        PrefillPoint(t, n, n * prefill_s_per_token / t) for t in (1, 2) for n in (64, 512, 2048)
    )
    decode = tuple(
        DecodePoint(t, b, b * ctx, (decode_base_s + decode_per_seq_s * b) / t)
        for t in (1, 2)
        for b in (1, 8, 32)
        for ctx in (128, 1024)
    )
    return Profile(
        model="fake",
        dtype="bfloat16",
        cpu="none",
        block_size=16,
        kv_bytes_per_token=1000,
        transfer_bytes_s=transfer_bytes_s,
        prefill=prefill,
        decode=decode,
    )
