"""BlockRows: a block list's array is reused while the scheduler keeps the same list, and made
anew when the list was replaced (or, against the rule, grown in place)."""

from __future__ import annotations

import numpy as np

from superinfer.engine.worker.block_rows import BlockRows


def test_an_unchanged_list_keeps_its_array_and_a_replaced_one_gets_a_new_one():
    rows = BlockRows()
    a, b = [3, 1, 4], [1, 5]
    first = rows.array(a)
    assert first.dtype == np.int32 and first.tolist() == a
    rows.next_step()
    assert rows.array(a) is first  # the same list object, a step later
    b_array = rows.array(b)
    rows.next_step()
    a = [*a, 9]  # the scheduler's way to grow a request's blocks: a new list
    assert rows.array(a).tolist() == [3, 1, 4, 9]
    assert rows.array(b) is b_array


def test_a_list_grown_in_place_is_converted_again():
    rows = BlockRows()
    a = [3, 1]
    rows.array(a)
    a.append(7)
    assert rows.array(a).tolist() == [3, 1, 7]


def test_only_the_last_two_steps_lists_are_kept():
    rows = BlockRows()
    old = [2, 7]
    first = rows.array(old)
    rows.next_step()
    rows.next_step()  # a step without `old`, then another: it is forgotten
    assert rows.array(old) is not first and rows.array(old).tolist() == old
