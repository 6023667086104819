"""The scheduler on its own: a real BlockManager, sequences whose steps the test runs by hand (no model)."""

from __future__ import annotations

from typing import Any, cast

from glm5_worker.engine.scheduler import ScheduledStep, Scheduler
from glm5_worker.engine.sequence import FinishReason, SamplingParams, Sequence
from glm5_worker.kv.block_manager import BlockManager

BLOCK = 4


def seq(name: str, prompt: int, first: int = 0, prompt_logprobs: bool = False) -> Sequence:
    params = SamplingParams(max_new_tokens=100, prompt_logprobs=prompt_logprobs)
    # the scheduler never detokenizes
    return Sequence(name, list(range(first, first + prompt)), params, cast(Any, None))


def run(step: ScheduledStep, blocks: BlockManager) -> None:
    """What the engine does after the model's forward: the scheduled tokens are computed, each decode and each
    finished prompt yields one new token."""
    for s in step.decodes:
        s.num_computed_tokens += 1
        s.output_ids.append(7)
    for s, n in step.prefills:
        s.num_computed_tokens += n
        if s.num_uncomputed == 0:
            s.output_ids.append(7)
    for s in [*step.decodes, *(s for s, _ in step.prefills)]:
        blocks.register_full_blocks(s)


def names(step: ScheduledStep) -> tuple[list[str], list[tuple[str, int]]]:
    return [s.request_id for s in step.decodes], [(s.request_id, n) for s, n in step.prefills]


def test_decodes_first_then_running_prefills_then_waiting_in_arrival_order() -> None:
    blocks = BlockManager(64, 0, BLOCK, l1_tokens=0)
    sched = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=8)
    a, b, c, d = seq("a", 3), seq("b", 12, 100), seq("c", 5, 200), seq("d", 2, 300)
    for s in (a, b, c, d):
        sched.add(s)
    step = sched.schedule()
    # the budget (8 tokens) takes a's whole prompt and the first 5 of b's; c and d wait
    assert names(step) == ([], [("a", 3), ("b", 5)])
    run(step, blocks)
    step = sched.schedule()
    # a decodes first (1 token), b continues its prompt with the budget left, c is admitted with the rest
    assert names(step) == (["a"], [("b", 7)])
    run(step, blocks)
    step = sched.schedule()
    assert names(step) == (["a", "b"], [("c", 5), ("d", 1)])
    assert [s.request_id for s in sched.running] == ["a", "b", "c", "d"] and not sched.waiting


def test_the_sequence_cap_keeps_the_rest_waiting() -> None:
    blocks = BlockManager(64, 0, BLOCK, l1_tokens=0)
    sched = Scheduler(blocks, max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(seq(f"s{i}", 4, 10 * i))
    step = sched.schedule()
    assert names(step) == ([], [("s0", 4), ("s1", 4)])
    assert [s.request_id for s in sched.waiting] == ["s2"]
    run(step, blocks)
    s0 = sched.running[0]
    sched.remove(s0)  # s0 finished: its place goes to s2
    step = sched.schedule()
    assert names(step) == (["s1"], [("s2", 4)])


def test_a_full_pool_preempts_the_newest_sequence_which_is_recomputed_later() -> None:
    # 4 blocks of 4 tokens: two 8-token prompts fill the pool; the next decode token needs a fifth block
    blocks = BlockManager(4, 0, BLOCK, l1_tokens=0, prefix_caching=False)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    old, new = seq("old", 8), seq("new", 8, 100)
    sched.add(old)
    sched.add(new)
    run(sched.schedule(), blocks)
    assert blocks.num_free() == 0
    step = sched.schedule()
    # old needs a block for its 9th token: new (admitted last) gives its blocks back and waits at the front
    assert names(step) == (["old"], [])
    assert sched.num_preemptions == 1
    assert [s.request_id for s in sched.waiting] == ["new"] and new.block_table == [] and new.num_computed_tokens == 0
    run(step, blocks)
    sched.remove(old)
    # new is recomputed from its tokens: the prompt and the token it had already produced
    step = sched.schedule()
    assert names(step) == ([], [("new", 9)])


def test_a_sequence_that_cannot_fit_blocks_the_queue_instead_of_being_skipped() -> None:
    blocks = BlockManager(3, 0, BLOCK, l1_tokens=0)
    sched = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64)
    big, small = seq("big", 20), seq("small", 2, 100)
    sched.add(big)
    sched.add(small)
    step = sched.schedule()
    # 20 tokens need 5 blocks, the pool has 3: nothing is admitted, small does not overtake big
    assert step.empty
    assert [s.request_id for s in sched.waiting] == ["big", "small"]


def test_admission_reuses_cached_prefixes_except_for_prompt_logprobs() -> None:
    blocks = BlockManager(64, 0, BLOCK, l1_tokens=0)
    sched = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64)
    first = seq("first", 10)
    sched.add(first)
    run(sched.schedule(), blocks)
    sched.remove(first)  # its full blocks stay in the prefix cache
    again, logprobs = seq("again", 10), seq("logprobs", 10, prompt_logprobs=True)
    sched.add(again)
    sched.add(logprobs)
    step = sched.schedule()
    # two full blocks (8 tokens) found cached: 2 left to compute; prompt logprobs need every prompt token
    assert names(step) == ([], [("again", 2), ("logprobs", 10)])
    assert again.num_cached_prompt_tokens == 8 and logprobs.num_cached_prompt_tokens == 0


def test_a_prefix_another_sequence_is_computing_is_waited_for_then_found_cached() -> None:
    blocks = BlockManager(64, 0, BLOCK, l1_tokens=0)
    sched = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64)
    shared = list(range(500, 512))  # three full blocks
    leader = Sequence("leader", [*shared, 1, 2], SamplingParams(max_new_tokens=9), cast(Any, None))
    follower = Sequence("follower", [*shared, 3, 4], SamplingParams(max_new_tokens=9), cast(Any, None))
    other = seq("other", 6, 900)
    logprobs = Sequence("logprobs", [*shared, 5], SamplingParams(max_new_tokens=9, prompt_logprobs=True),
                        cast(Any, None))  # fmt: skip
    for s in (leader, follower, other, logprobs):
        sched.add(s)
    step = sched.schedule()
    # the follower's first block is the leader's, not computed yet: it waits, and the sequences behind it
    # (one that shares nothing, one that may not use the cache) are admitted meanwhile
    assert names(step) == ([], [("leader", 14), ("other", 6), ("logprobs", 13)])
    assert [s.request_id for s in sched.waiting] == ["follower"] and sched.num_deferred == 1
    run(step, blocks)
    step = sched.schedule()
    assert names(step) == (["leader", "other", "logprobs"], [("follower", 2)])
    assert follower.num_cached_prompt_tokens == 12
    # the put-off query counted once: leader 14 tokens, 0 found; other 6, 0; follower 14, 12
    assert (blocks.prefix_queries, blocks.prefix_hits) == (34, 12)


def test_a_chunked_prefix_is_waited_for_block_by_block_and_the_follower_never_recomputes_it() -> None:
    blocks = BlockManager(64, 0, BLOCK, l1_tokens=0)
    sched = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=8)
    prompt = list(range(700, 721))  # five full blocks and one token
    leader = Sequence("leader", prompt, SamplingParams(max_new_tokens=9), cast(Any, None))
    follower = Sequence("follower", [*prompt[:20], 9, 9], SamplingParams(max_new_tokens=9), cast(Any, None))
    sched.add(leader)
    sched.add(follower)
    computed_by_follower = 0
    for _ in range(6):
        step = sched.schedule()
        computed_by_follower += sum(n for s, n in step.prefills if s is follower)
        run(step, blocks)
    assert follower.output_ids and follower.num_cached_prompt_tokens == 20
    assert computed_by_follower == 2


def test_abort_all_finishes_every_sequence_and_frees_the_pool() -> None:
    blocks = BlockManager(8, 0, BLOCK, l1_tokens=0, prefix_caching=False)
    sched = Scheduler(blocks, max_num_seqs=1, max_num_batched_tokens=64)
    running, waiting = seq("running", 6), seq("waiting", 6, 100)
    sched.add(running)
    sched.add(waiting)
    run(sched.schedule(), blocks)
    aborted = sched.abort_all()
    assert {s.request_id for s in aborted} == {"running", "waiting"}
    assert all(s.finish_reason == FinishReason.ABORT for s in aborted)
    assert not sched.has_work and blocks.num_free() == 8


def test_preempted_sequences_waiting_on_each_other_do_not_hold_the_pool() -> None:
    """Three sequences that outgrow a 9-block pool together: each preemption puts the victim at the front of the
    queue, where it matches its own cached prefix. A waiting sequence that cannot be admitted gives those blocks
    back; when the matches were kept, the three held the pool between them with nothing running, for good."""
    blocks = BlockManager(9, 0, BLOCK * 4, l1_tokens=0)  # prefix caching on
    sched = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [seq(f"s{i}", 20, 100 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_work:
        steps += 1
        assert steps < 1000, (sched.num_preemptions, [len(s.output_ids) for s in seqs], len(sched.waiting))
        step = sched.schedule()
        assert not step.empty or not sched.has_work
        run(step, blocks)
        for s in [*sched.running]:
            if len(s.output_ids) >= 100:
                sched.remove(s)
    assert sched.num_preemptions > 0 and all(len(s.output_ids) >= 100 for s in seqs)
    # what waits holds nothing: every block is free or only cached
    assert blocks.num_free() == 9
