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


def _trace(device: bool) -> dict:
    """A profiler trace.json's shape: process names, then complete events of two programs."""
    pid = 1 if device else 701
    meta = [{"ph": "M", "name": "process_name", "pid": pid,
             "args": {"name": "/device:GPU:0" if device else "/host:CPU"}}]

    def ev(ts, dur, name, module="jit_decode_program", tid=7):
        return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name,
                "args": {"hlo_module": module, "hlo_op": name}}
    evs = [ev(0, 4, "loop_fusion_1"), ev(4, 6, "sparrow_block_select_triton"),
           ev(12, 30, "sparrow_block_sparse_decode_triton__1"),
           ev(50, 5, "input_reduce_fusion_2"), ev(60, 20, "loop_fusion_1"),
           ev(100, 500, "other_program_op", module="jit_prefill_program")]
    if not device:     # XLA:CPU: a while op encloses the loop body's ops on the same thread
        evs.append(ev(0, 80, "while.3"))
    return {"traceEvents": meta + evs}


HLO = """
  %loop_fusion.1 = f32[4] fusion(%p), kind=kLoop, metadata={op_name="jit(decode_program)/while/body/block_select/or"}
  %input_reduce_fusion.2 = f32[4] fusion(%q), kind=kInput, metadata={op_name="jit(decode_program)/while/body/mlp/dot_general"}
  %while.3 = (f32[4]) while(%t), metadata={op_name="jit(decode_program)/while"}
"""


def test_breakdown_attributes_kernels_to_decode_phases_on_gpu_and_cpu():
    from sparrow_jax.bench.xplane import breakdown, format_breakdown
    for device in (True, False):
        b = breakdown(_trace(device), HLO)
        phases = {r["phase"]: (r["us"], r["launches"]) for r in b["phases"]}
        # fusion names map to the instruction (kernel '_' = instruction '.'), the selection
        # kernel to its phase by name, the attention kernel (no HLO twin) is its own row; the
        # other program and the enclosing while are not counted
        assert phases == {"block_select": (30, 3), "mlp": (5, 1),
                          "other: sparrow_block_sparse_decode_triton__1": (30, 1)}
        assert (b["span_us"], b["busy_us"], b["launches"]) == (80, 65, 5)
        assert b["plane"] == ("/device:GPU:0" if device else "/host:CPU")
        assert "busy 81%" in format_breakdown("x", b)
