"""The prefix cache for hybrid state: shared KV pages plus GDN state snapshots, at token granularity.

Pure structures are tested with hand-computed expectations; the scheduler on a small random model
(fp32, CPU) must give exactly the tokens (and logprobs within fp32 reduction-order noise) of a run with the cache off, for
hits at page-aligned, unaligned and message-boundary positions and from a finished request's end."""

from __future__ import annotations

import random
from pathlib import Path

import hf_oracle
import pytest
from scheduler_harness import LOGPROB_TOL, VOCAB, Run, load_model

from deltaserve.cache.kv_pages import PageAllocator
from deltaserve.cache.prefix import ROOT, PageKeys, chain, extend_page_keys, prefix_key, salted_root
from deltaserve.cache.snapshots import Snapshot, SnapshotTable
from deltaserve.engine.protocol import ResetPrefixCache
from deltaserve.engine.scheduler.prefix import PROMPT_END_MIN_GAP, cache_points
from deltaserve.sampling_params import SamplingParams

PAGE = 4  # the harness's page size


def greedy(n: int = 6, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2, **kw)


# ---- pure structures ---------------------------------------------------------------------------


def test_pages_are_shared_by_reference_and_only_unreferenced_cached_pages_are_evicted_oldest_first():
    kv = PageAllocator(num_pages=5, page_size=4)  # pages 1..4 usable
    a = kv.allocate(2)
    b = kv.allocate(2)
    assert a == [1, 2] and b == [3, 4] and kv.num_free == 0
    assert kv.register(1, b"k1") and kv.register(3, b"k3") and not kv.register(2, b"k1")
    kv.share(1)  # a second holder of page 1
    assert kv.sole_held(a) == 1 and kv.sole_held(b) == 2  # what each holder's release would hand back
    kv.free(a)  # page 1 keeps one holder; page 2 (no key) is free
    assert kv.refs(1) == 1 and kv.num_free == 1
    kv.free(b)  # page 3 is cached (it has a key), page 4 free
    assert kv.num_free == 3 and kv.lookup(b"k3") == 3
    kv.free([1])  # page 1 cached too, more recently than page 3
    got = kv.allocate(3)  # the two free pages first, then the oldest cached page (3) loses its key
    assert sorted(got[:2]) == [2, 4] and got[2] == 3
    assert kv.lookup(b"k3") is None and kv.lookup(b"k1") == 1
    kv.share(1)  # a hit takes the cached page back: it is referenced, so never evicted
    with pytest.raises(MemoryError):
        kv.allocate(1)


def test_a_page_registered_without_its_mtp_kv_says_so_until_it_loses_its_key():
    kv = PageAllocator(num_pages=4, page_size=4)
    a, b = kv.allocate(2)
    assert kv.register(a, b"ka", mtp_gaps=True) and kv.register(b, b"kb")
    assert kv.has_mtp_gaps(a) and not kv.has_mtp_gaps(b)
    assert not kv.register(a, b"other")  # registered once: the mark stays as it was
    kv.free([a, b])
    assert sorted(kv.allocate(3)[1:]) == [a, b]  # the free page, then both cached pages lose their keys
    assert not kv.has_mtp_gaps(a)
    kv.register(a, b"ka2")
    assert not kv.has_mtp_gaps(a)  # new content, registered without gaps
    kv.register(b, b"kb2", mtp_gaps=True)
    kv.forget_all()
    assert not kv.has_mtp_gaps(b)


def test_a_snapshot_being_read_is_never_evicted_and_the_least_recently_used_one_is():
    table = SnapshotTable(2)
    snaps = []
    for position in (4, 8):
        snap = Snapshot(table.allocate(), position, b"p", (), None, None)
        table.add(snap)
        snaps.append(snap)
    table.ref(snaps[0])  # a restore from the first is planned
    index = table.allocate()  # evicts the second: the first is being read
    assert index == snaps[1].index and table.candidates(b"p") == [snaps[0]]
    assert table.allocate() is None  # the only indexed snapshot is being read
    table.release(index)
    table.unref(snaps[0])
    assert table.allocate() == index  # the free place first


def test_cache_points_are_the_named_positions_and_the_prompt_end():
    assert cache_points(100, []) == [100]
    assert cache_points(100, [20, 0, 100, 150, 20]) == [20, 100]  # inside the prompt, once each
    # a named point just before the end makes the prompt-end point redundant
    assert cache_points(100, [20, 100 - PROMPT_END_MIN_GAP + 1]) == [20, 100 - PROMPT_END_MIN_GAP + 1]
    assert cache_points(1, []) == [1]


# ---- the scheduler on a model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("prefix_model")
    hf_oracle.save_text_layout(hf_oracle.build_hf_causal_lm(seed=11, layers=4, tied=True), out)
    return load_model(Path(out))


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


SYSTEM = _prompt(26, 1)  # a shared "system message": its end (26) is unaligned to pages of 4
WARM = {
    "w0": (SYSTEM + _prompt(21, 2), [26]),  # a named cache point at the system message's end
    "w1": (_prompt(40, 3), [16]),  # a page-aligned named point
    "w2": (_prompt(13, 4), []),
}


def _followers(warm_out: dict[str, list[int]]) -> dict[str, tuple[list[int], int]]:
    """Prompts that hit what the warm requests left, with the hit each must report."""
    w0, w1, w2 = (WARM[k][0] for k in ("w0", "w1", "w2"))
    return {
        "same_system": (SYSTEM + _prompt(9, 5), 26),  # shares only the system message (unaligned)
        "aligned": (w1[:16] + _prompt(7, 6), 16),  # diverges right after the page-aligned point
        # the same prompt again: its snapshots lie at or past its end, and one token must be computed
        "same_prompt": (list(w2), 0),
        "extends": (w1 + _prompt(5, 7), len(w1)),  # prompt + a suffix: hit at the prompt's end
        # a continuation: prompt + output (as far as computed) + a new turn
        "continues": (w2 + warm_out["w2"] + _prompt(6, 8), len(w2) + len(warm_out["w2"]) - 1),
        "cold": (_prompt(19, 9), 0),
    }


@pytest.fixture(scope="module")
def reference(model):
    """Every prompt's outputs alone with the cache off."""
    warm = {}
    for rid, (p, _) in WARM.items():
        run = Run(model)
        run.add(rid, p, greedy())
        run.run_until_idle()
        warm[rid] = (run.tokens(rid), run.logprobs(rid))
    follow = {}
    for rid, (p, _) in _followers({k: v[0] for k, v in warm.items()}).items():
        run = Run(model)
        run.add(rid, p, greedy())
        run.run_until_idle()
        follow[rid] = (run.tokens(rid), run.logprobs(rid))
    return warm, follow


def _assert_same(run: Run, rid: str, expected: tuple[list[int], list]) -> None:
    tokens, logprobs = expected
    assert run.tokens(rid) == tokens, rid
    for ours, ref in zip(run.logprobs(rid), logprobs, strict=True):
        assert abs(ours.logprob - ref.logprob) < LOGPROB_TOL, rid


@pytest.mark.parametrize("max_num_seqs", [1, 3, 16])
@pytest.mark.parametrize("budget", [1, 7, 64, 4096])
def test_cached_prefixes_give_the_tokens_of_the_cache_off_run(model, reference, budget, max_num_seqs):
    warm_ref, follow_ref = reference
    run = Run(model, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, num_snapshots=32)
    for rid, (p, points) in WARM.items():
        run.add(rid, p, greedy(), cache_points=points)
    run.run_until_idle()
    followers = _followers({k: v[0] for k, v in warm_ref.items()})
    names = list(followers)
    run.add(names[0], followers[names[0]][0], greedy(40))  # decodes while the others arrive
    run.tick(3)
    for rid in names[1:]:
        run.add(rid, followers[rid][0], greedy())
        run.tick(1)
    run.run_until_idle()
    for rid in WARM:
        _assert_same(run, rid, warm_ref[rid])
    for rid in names[1:]:
        _assert_same(run, rid, follow_ref[rid])
        assert run.terminal(rid).num_cached_tokens == followers[rid][1], rid
    assert run.tokens(names[0])[:6] == follow_ref[names[0]][0]
    assert run.sched.load.kv_pages_used == 0 and run.sched.load.state_slots_free == max_num_seqs


def _alone(model, rid: str, prompt: list[int], params: SamplingParams, **kw) -> Run:
    run = Run(model, **kw)
    run.add(rid, prompt, params)
    run.run_until_idle()
    return run


def test_a_stop_under_decode_ahead_caches_the_state_after_the_stop_token(model):
    """With decode-ahead the step after a stop token is already running when the stop is read: it
    absorbs the stop token, so the request-end snapshot holds prompt + every output token."""
    prompt = _prompt(21, 20)
    probe = _alone(model, "p", prompt, greedy())
    stop = probe.tokens("p")[2]
    run = Run(model, eos=(stop,), num_snapshots=8)
    run.add("first", prompt, SamplingParams(temperature=0.0, max_tokens=6))
    run.run_until_idle()
    out = run.tokens("first")
    assert out == probe.tokens("p")[:3]
    turn2 = prompt + out + _prompt(5, 21)
    run.add("second", turn2, greedy())
    run.run_until_idle()
    assert run.terminal("second").num_cached_tokens == len(prompt) + len(out)
    _assert_same(
        run, "second", (lambda r: (r.tokens("s"), r.logprobs("s")))(_alone(model, "s", turn2, greedy()))
    )


def test_kv_pressure_never_evicts_a_page_in_use(model):
    """Eight requests share a prefix on a pool too small for all of them: shared pages stay with
    their holders through preemption and eviction, and every output is the one computed alone."""
    shared = _prompt(24, 30)
    prompts = {f"r{i}": shared + _prompt(10, 31 + i) for i in range(8)}
    params = greedy(12)
    run = Run(model, num_pages=40, num_snapshots=8, max_num_batched_tokens=16)
    run.add("warm", shared + _prompt(3, 40), params, cache_points=[24])
    run.run_until_idle()
    for rid, p in prompts.items():
        run.add(rid, p, params, cache_points=[24])
    run.run_until_idle()
    for rid, p in prompts.items():
        assert run.terminal(rid).finish_reason == "length"
        _assert_same(run, rid, (lambda r: (r.tokens(rid), r.logprobs(rid)))(_alone(model, rid, p, params)))
    assert run.sched.load.kv_pages_used == 0
    assert sum(run.terminal(rid).num_cached_tokens == 24 for rid in prompts) >= 1


def test_an_evicted_snapshot_is_never_served_from_its_reused_place(model):
    params = greedy(4)
    prompts = [_prompt(18, 50 + i) for i in range(5)]
    run = Run(model, num_snapshots=2)  # each request saves 2 snapshots: each evicts the last's
    for i, p in enumerate(prompts):
        run.add(f"p{i}", p, params)
        run.run_until_idle()
    run.add("again0", prompts[0], params)  # its snapshots' places now hold another prompt's state
    run.add("again4", prompts[4] + [7, 7], params)
    run.run_until_idle()
    assert run.terminal("again0").num_cached_tokens == 0
    assert run.terminal("again4").num_cached_tokens == len(prompts[4])
    assert run.tokens("again0") == run.tokens("p0")
    assert run.tokens("again4") == _alone(model, "a", prompts[4] + [7, 7], params).tokens("a")


def test_a_request_aborted_before_its_cache_point_leaves_no_snapshot(model):
    prompt = _prompt(40, 60)
    run = Run(model, num_snapshots=8, max_num_batched_tokens=8)
    run.add("gone", prompt, greedy(), cache_points=[24])
    run.tick(2)  # two chunks of 8: the cache point (24) is not reached
    run.abort("gone")
    run.tick()
    assert run.terminal("gone").finish_reason == "abort"
    assert run.sched.load.state_snapshots_used == 0
    run.add("again", prompt, greedy())
    run.run_until_idle()
    assert run.terminal("again").num_cached_tokens == 0


def test_a_step_that_fails_leaves_no_snapshot_of_its_cache_points(model):
    prompt = _prompt(30, 70)
    run = Run(model, num_snapshots=8, max_num_batched_tokens=64)
    launch = run.sched.backend.launch

    def out_of_memory_with_a_snapshot(plan):
        if plan.copies_after:
            raise MemoryError("no room")
        return launch(plan)

    run.sched.backend.launch = out_of_memory_with_a_snapshot
    run.add("failed", prompt, greedy(), cache_points=[12])
    run.run_until_idle()
    assert run.terminal("failed").finish_reason == "error"
    assert run.sched.load.state_snapshots_used == 0 and run.sched.load.kv_pages_used == 0
    run.sched.backend.launch = launch
    run.add("again", prompt, greedy())
    run.run_until_idle()
    assert run.terminal("again").num_cached_tokens == 0


def test_resetting_the_cache_with_requests_running_changes_no_output(model):
    warm = _prompt(30, 80)
    follow = warm + _prompt(6, 81)
    expected = _alone(model, "f", follow, greedy(20))
    run = Run(model, num_snapshots=8)
    run.add("warm", warm, greedy())
    run.run_until_idle()
    run.add("f", follow, greedy(20))
    run.tick(3)  # f resumed from the warm prompt's snapshot and is decoding over shared pages
    assert run.sched.by_id["f"].num_cached_tokens == len(warm)
    run.sched.submit(ResetPrefixCache())
    run.run_until_idle()
    _assert_same(run, "f", (expected.tokens("f"), expected.logprobs("f")))
    assert run.sched.load.kv_pages_used == 0
    run.add("again", warm + [5], greedy())
    run.run_until_idle()
    assert run.terminal("again").num_cached_tokens == 0  # the warm prompt's cache was forgotten


def test_a_request_that_scores_its_prompt_is_never_resumed_from_the_cache(model):
    prompt = _prompt(25, 90)
    scored = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    expected = _alone(model, "s", prompt, scored)
    run = Run(model, num_snapshots=8)
    run.add("warm", prompt, greedy(), cache_points=[20])  # a snapshot at 20 could serve the prompt below
    run.run_until_idle()
    run.add("s", prompt, scored)
    run.run_until_idle()
    assert run.terminal("s").num_cached_tokens == 0
    ours = [u.prompt_logprobs for u in run.updates["s"] if u.prompt_logprobs][0]
    ref = [u.prompt_logprobs for u in expected.updates["s"] if u.prompt_logprobs][0]
    assert len(ours) == len(prompt) and ours[0] is None
    for a, b in zip(ours[1:], ref[1:], strict=True):
        assert abs(a.logprob - b.logprob) < LOGPROB_TOL and a.rank == b.rank


# ---- cache_salt -------------------------------------------------------------------------------------


def test_a_cache_salt_roots_a_key_chain_of_its_own():
    tokens = list(range(12))
    keys = {}
    for salt in (None, "tenant-a", "tenant-b"):
        keys[salt] = PageKeys(salted_root(salt))
        extend_page_keys(keys[salt], tokens, 4)
    assert keys[None].root == ROOT  # without a salt, the keys are the unsalted chain's
    for a, b in (("tenant-a", None), ("tenant-a", "tenant-b"), (None, "tenant-b")):
        assert keys[a].root != keys[b].root and not set(keys[a]) & set(keys[b])
    again = PageKeys(salted_root("tenant-a"))
    extend_page_keys(again, tokens, 4)
    assert list(again) == list(keys["tenant-a"]) and prefix_key(again, 0) == again.root


def test_requests_share_cached_prefixes_only_with_the_same_salt(model):
    """Pages and snapshots (a whole-page one, and a sub-page one keyed at the root) serve a request only
    when its cache_salt is the warm request's; outputs are those computed alone either way."""
    long, short = _prompt(22, 40), _prompt(3, 41)  # pages of 4: the short prompt's snapshot has no full page
    run = Run(model, num_snapshots=16)
    run.add("warm_long", long, greedy(2), cache_points=[20], cache_salt="a")
    run.add("warm_short", short, greedy(2), cache_salt="a")
    run.run_until_idle()
    cases = {"a": 20, "b": 0, None: 0}
    for i, (salt, hit) in enumerate(cases.items()):
        for rid, prompt, expect in (
            (f"long{i}", long[:20] + _prompt(5, 50 + i), hit),
            (f"short{i}", short + [7, 8], min(hit, 3)),
        ):
            run.add(rid, prompt, greedy(), cache_salt=salt)
            run.run_until_idle()
            assert run.terminal(rid).num_cached_tokens == expect, (rid, salt)
            _assert_same(
                run,
                rid,
                (lambda r, q=rid: (r.tokens(q), r.logprobs(q)))(_alone(model, rid, prompt, greedy())),
            )


def test_admission_counts_as_returned_only_the_pages_a_finishing_request_holds_alone(model):
    """a and b share a 40-token cached prefix (10 pages of 4); a is near its end when z arrives. Of a's
    pages only its own come back when it finishes: the shared ones stay with b. Counting all of them as
    returned (24 pages, a 64-token reserve) admits z on pages that never come back, and b or z is
    preempted; counting a's own keeps everyone running, with the tokens of an ample pool."""
    prefix = _prompt(40, 50)
    requests = [
        ("a", prefix + [60], greedy(6), [40]),
        ("b", prefix + [61], greedy(40), []),
        ("z", [9] * 8, greedy(24), []),
    ]
    ample = Run(model, max_num_seqs=4, num_pages=4096, num_snapshots=4)
    tight = Run(model, max_num_seqs=4, num_pages=24, num_snapshots=4, kv_reserve_tokens=64)
    for run in (ample, tight):
        for (rid, prompt, params, points), ticks in zip(requests, (4, 2, 0), strict=True):
            run.add(rid, prompt, params, cache_points=points)
            run.tick(ticks)
        run.run_until_idle()
    assert tight.sched.num_preemptions == 0
    for rid, *_ in requests:
        assert tight.terminal(rid).finish_reason == "length"
        assert tight.tokens(rid) == ample.tokens(rid)


def test_page_keys_extended_in_pieces_are_the_chain_of_each_page_on_its_parent():
    tokens = [(i * 7919) % 248_320 for i in range(70)]
    keys = PageKeys()
    for known in (0, 3, 9, 9, 41, 70):  # partial pages, a repeat, several pages at once
        extend_page_keys(keys, tokens[:known], 4)
    expected, parent = [], ROOT
    for page in range(70 // 4):
        parent = chain(parent, tokens[page * 4 : page * 4 + 4])
        expected.append(parent)
    assert list(keys) == expected
