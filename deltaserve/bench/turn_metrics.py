"""Per-turn aggregates of a multi-turn run: how TTFT and the cached-token share move as a
conversation's prompt grows. Definitions as in metrics.py (TTFT per request, numpy percentiles)."""

from __future__ import annotations

from collections import defaultdict

from deltaserve.bench.metrics import RequestRecord, TurnStats, format_share, latency_stats


def per_turn_stats(turns: list[tuple[int, RequestRecord]]) -> list[TurnStats]:
    """`turns` pairs each request with its turn index; the result is sorted by turn."""
    reported = any(r.success and r.cached_tokens is not None for _, r in turns)
    by_turn: dict[int, list[RequestRecord]] = defaultdict(list)
    for turn, record in turns:
        by_turn[turn].append(record)
    stats = []
    for turn in sorted(by_turn):
        ok = [r for r in by_turn[turn] if r.success]
        ttft = latency_stats([r.ttft for r in ok], (99.0,))
        prompt_tokens = sum(r.prompt_tokens for r in ok)
        share = None
        if reported:
            share = sum(r.cached_tokens or 0 for r in ok) / prompt_tokens if prompt_tokens else 0.0
        stats.append(
            TurnStats(
                turn=turn,
                completed=len(ok),
                failed=len(by_turn[turn]) - len(ok),
                mean_ttft_ms=ttft.mean_ms,
                median_ttft_ms=ttft.median_ms,
                p99_ttft_ms=ttft.percentiles_ms[99.0],
                mean_prompt_tokens=prompt_tokens / len(ok) if ok else 0.0,
                cached_token_share=share,
            )
        )
    return stats


def format_turn_table(stats: list[TurnStats]) -> str:
    """The per-turn block printed after the serving report."""
    lines = ["{s:{c}^{n}}".format(s=" Per-turn (multi-turn chat) ", n=78, c="=")]
    lines.append(
        f"{'turn':>4} {'ok':>6} {'failed':>6} {'TTFT mean':>10} {'median':>10} {'P99 (ms)':>10} "
        f"{'prompt tok':>11} {'cached share':>14}"
    )
    for s in stats:
        lines.append(
            f"{s.turn:>4} {s.completed:>6} {s.failed:>6} {s.mean_ttft_ms:>10.2f} {s.median_ttft_ms:>10.2f} "
            f"{s.p99_ttft_ms:>10.2f} {s.mean_prompt_tokens:>11.1f} {format_share(s.cached_token_share):>14}"
        )
    lines.append("=" * 78)
    return "\n".join(lines)
