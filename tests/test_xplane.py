"""bench/xplane.py's phase times: the wall-clock union of a phase's ops over threads."""

from sparrow_jax.bench.xplane import scope_times

OPS = {"f1": "jit(p)/while/body/exact_draft/dot", "f2": "jit(p)/while/body/exact_verify/dot",
       "f3": "jit(p)/while/body/exact_verify/exp", "w": "jit(p)/while"}


def test_scope_times_count_a_multithreaded_op_once_and_skip_enclosing_events():
    lines = [
        ("main", [(0, 100, "w"), (0, 10, "f1"), (10, 20, "f2"), (40, 5, "f3"),
                  (50, 1, "not_an_op"), (60, 10, "f1"), (61, 3, "library_call_inside_f1")]),
        ("worker", [(12, 20, "f2"), (44, 4, "f3")]),   # the same ops' other threads' shares
    ]
    t = scope_times(lines, OPS, ("exact_draft", "exact_verify"))
    # verify: [10, 32) and [40, 48) = 30; thread sums would give 50. The loop "w" encloses
    # other ops, so it is not counted as "other"; f1 at 60 keeps its 10 (its sub-event is no op).
    assert t == {"exact_draft": 20, "exact_verify": 30, "other": 0}
