"""The streaming runtime's schedule (``runtime/loop/schedule.py``): each block's kind and its
uses of the prefetch window, in the order the per-layer loop walks them."""

from hetjax.runtime.loop.schedule import Schedule


def test_recompute_blocks_use_the_window_forward_then_backward():
    s = Schedule.of(["block0", "block1", "block2"], [0, 0, 0])
    assert s.uses == ("block0", "block1", "block2", "block2", "block1", "block0")
    assert [b.kind for b in s.blocks] == ["recompute"] * 3
    assert [(b.forward_use, b.backward_use) for b in s.blocks] == [(0, 5), (1, 4), (2, 3)]
    # the first block backward reaches comes back before backward; each next one while
    # the block after it computes
    assert s.restore_first == 2
    assert [b.restore_ahead for b in s.blocks] == [None, 0, 1]
    assert s.forward_uses == ("block0", "block1", "block2")
    assert [b.index for b in s.backward] == [2, 1, 0]


def test_kept_and_swapped_blocks_in_a_mix():
    names = [f"block{i}" for i in range(5)]
    s = Schedule.of(names, [0] * 5, keep_blocks=2, swap_blocks=1, routed=frozenset({"block0"}))
    assert [b.kind for b in s.blocks] == ["routed", "recompute", "swap", "keep", "keep"]
    # kept blocks: forward only; the streamed ones again in backward, in reverse
    assert s.uses == (*names, "block2", "block1", "block0")
    assert [b.backward_use for b in s.blocks] == [7, 6, 5, None, None]
    assert [b.swap_slot for b in s.blocks] == [None, None, 0, None, None]
    assert s.restore_first == 2  # the swapped block's activations, before backward
    assert [b.restore_ahead for b in s.blocks] == [None, 0, 1, None, None]
    # every use of the window is one block's, each position once
    positions = [b.forward_use for b in s.blocks]
    positions += [b.backward_use for b in s.blocks if b.backward_use is not None]
    assert sorted(positions) == list(range(len(s.uses)))
    assert all(s.uses[b.forward_use] == b.name for b in s.blocks)


def test_every_block_kept_uses_the_window_once():
    s = Schedule.of(["block0", "block1"], [0, 0], keep_blocks=2)
    assert s.uses == ("block0", "block1")
    assert s.restore_first is None
    assert all(b.backward_use is None and b.restore_ahead is None for b in s.blocks)


def test_two_stage_groups_t5():
    names = ["encoder0", "encoder1", "decoder0", "decoder1"]
    s = Schedule.of(names, [0, 0, 1, 1], keep_blocks=1)
    assert [b.group for b in s.blocks] == [0, 0, 1, 1]
    # a group's input runs before its first block (forward) and after it (backward); its
    # context's gradient starts at its last block's backward
    assert [b.group_first for b in s.blocks] == [True, False, True, False]
    assert [b.group_last for b in s.blocks] == [False, True, False, True]
    assert s.uses == (*names, "decoder0", "encoder1", "encoder0")
    assert [b.kind for b in s.blocks] == ["recompute"] * 3 + ["keep"]
    # the encoder's last boundary comes back while the decoder's first block computes
    assert s.restore_first == 2
    assert [b.restore_ahead for b in s.blocks] == [None, 0, 1, None]
