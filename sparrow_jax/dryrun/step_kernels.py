"""The kernels one compiled GPU program launches, read from XLA's optimised HLO
(`compiled.as_text()`) without the hardware: per step of its step loop and per call, each kernel
named by what it does (issue 55; `dryrun.kernel_census` takes them apart by layer).

- What launches: every instruction outside fused computations that runs work on the device - a
  fusion (one kernel: XLA's loop/input/Triton fusions, Triton gemm fusions), a custom call (a
  Pallas Triton kernel, a cuBLAS gemm), a copy, an unfused op (sort, scatter, a collective).
  A fusion's own instructions run inside its kernel. Free: parameters, constants, tuples,
  get-tuple-element, bitcasts, the `*-done` half of an async pair.
- Loops: the decode chunk is a while loop of `chunk_steps` steps (XLA knows its trip count; the
  static engine's decode loop runs until its rows stop, trip count unknown). A kernel in the loop
  body or condition counts once per step; one outside it, once per call (1/trip count per step).
  A while loop inside a step counts its body `trip count` times, or once and flagged when the
  trip count is unknown. Each iteration also launches a kernel that sets the loop's condition
  (inside a CUDA graph; the H200 profile's "while", 64 launches for 63 decode steps).
- Conditionals (`lax.cond` / `lax.switch` -> HLO `conditional`): each one executed launches a
  kernel that sets its branch (inside a CUDA graph, as on the H200: `set_case_condition`, 2 per
  sparse layer per step in its profile; outside one, a copy of the predicate to the host), then
  its taken branch; the kernel computing the predicate is named "cond predicate". Every
  branch is counted (`Conditional`), and the step counts `TAKEN_BRANCH`.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Callable

# The decode step's conditionals are the sparse layers' `lax.cond(every row covered by its budget,
# dense, lax.cond(some row covered, mixed, sparse))` (rollout/paged.py, rollout/static.py): rows
# longer than their budget - at the shipped budgets (512-8192 tokens against 2K-34K token
# contexts) most of a long rollout - take the false branch (index 0) of both: the sparse path.
TAKEN_BRANCH = 0

_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "add-dependency", "opt-barrier", "domain", "partition-id", "replica-id"}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s")
# Named scopes of the decode step (model/qwen3.py, rollout/static.py, rollout/exact.py): a
# kernel under one is named after it, the most specific first.
_SCOPES = ("block_select", "centroid_update", "sparse_attention", "dense_attention", "kv_write",
           "qkv_proj", "o_proj", "mlp", "lm_head", "sample", "exact_draft", "exact_verify",
           "exact_accept")
# Functions whose jit name says what a kernel computes, and the word for it.
_FUNCTIONS = (("_layer_attention", "attention"), ("_decode_attention", "attention"),
              ("log_softmax", "log_softmax"), ("_gumbel", "sampling"), ("_threefry", "sampling"),
              ("sample_rows", "sampling"), ("_take", "embedding"))
# What a fused computation does, from the ops inside it: (HLO opcode, word), in this order.
_WORK = (("dot", "gemm"), ("rsqrt", "rms_norm"), ("sine", "rope"), ("cosine", "rope"),
         ("sort", "sort"), ("scatter", "scatter"), ("gather", "gather"),
         ("dynamic-update-slice", "row update"), ("exponential", "exp"), ("log", "log"),
         ("xor", "rng bits"), ("reduce", "reduce"), ("concatenate", "concat"), ("pad", "pad"),
         ("transpose", "transpose"))


@dataclasses.dataclass(frozen=True)
class Instr:
    """One HLO instruction: its name, result shape (layouts dropped), opcode and the rest of its
    line (operands and attributes)."""
    name: str
    shape: str
    opcode: str
    rest: str

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=%?([\w.\-]+)", self.rest)
        return m.group(1) if m else None

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.rest)
        return m.group(1) if m else ""

    @property
    def operands(self) -> list[str]:
        depth, out = 0, ""
        for ch in self.rest:              # the operand list: up to the call's closing paren
            if ch == "(":
                depth += 1
            elif ch == ")":
                if depth == 0:
                    break
                depth -= 1
            out += ch
        return re.findall(r"%([\w.\-]+)", out)


def parse_module(hlo: str) -> tuple[dict[str, list[Instr]], str]:
    """Optimised HLO text -> (computation name -> its instructions, the entry's name)."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        if not line.startswith((" ", "\t")):
            head = _HEADER.match(line)
            if head and line.rstrip().endswith("{"):
                current = comps.setdefault(head.group(2), [])
                entry = head.group(2) if head.group(1) else entry
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            current.append(Instr(m.group(1), re.sub(r"\{[^{}]*\}", "", m.group(2)), m.group(3),
                                 m.group(4)))
    return comps, entry


def _scope(op_name: str) -> str:
    """The named scope, known function or first path component (past the program's own) that
    an op_name sits in; "" when none."""
    for sc in _SCOPES:
        if f"/{sc}/" in f"/{op_name}/":
            return sc
    for fn, word in _FUNCTIONS:
        if fn in op_name:
            return word
    parts = [p for p in re.sub(r"^.*?/while/(body|cond)/", "", op_name).split("/")[:-1]
             if p not in ("closed_call", "shard_map", "cond", "vmap()")
             and not re.fullmatch(r"branch_\d+_fun|jit\(\w+_program\)|while", p)]
    return re.sub(r"^(?:vmap\(|jit\()+(.*?)\)*$", r"\1", parts[0]) if parts else ""


def _kernel_scope(ins: Instr, inner: list[Instr]) -> str:
    """Where a kernel belongs: its (root's) op_name; an op_name without a path (an instruction
    XLA made) is placed by the first of the fused ops' op_names that says; "step" otherwise."""
    if "/" in ins.op_name:
        return _scope(ins.op_name) or "step"
    return next((sc for sc in map(_scope, (i.op_name for i in inner)) if sc), "step")


def _fused_ops(comps: dict[str, list[Instr]], name: str | None, seen=None) -> list[Instr]:
    """The instructions of a fused computation and of the computations it calls."""
    seen = set() if seen is None else seen
    if not name or name in seen or name not in comps:
        return []
    seen.add(name)
    out = []
    for ins in comps[name]:
        out.append(ins)
        for key in ("calls", "to_apply"):
            out += _fused_ops(comps, ins.attr(key), seen)
    return out


def _short_shape(shape: str) -> str:
    if shape.startswith("("):                 # a multi-output fusion: its first output
        first = shape[1:].split(", ")[0].rstrip(")")
        return f"({first}, ...)"
    return shape


def kernel_name(ins: Instr, comps: dict[str, list[Instr]]) -> str:
    """What one launching instruction is: scope, work, output shape, e.g. "qkv_proj gemm
    (triton) f32[4,8,4096]", "attention pallas sparrow_block_sparse_decode_triton"."""
    if ins.opcode == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', ins.rest)
        target = target.group(1) if target else "?"
        pallas = re.search(r"/([\w]+)/pallas_call", ins.op_name)
        if pallas:
            return f"pallas {pallas.group(1)}"
        work = ("gemm (cuBLAS)" if "cublas" in target and "gemm" in target
                else f"custom-call {target}")
        return f"{_kernel_scope(ins, [])} {work} {_short_shape(ins.shape)}"
    if ins.opcode != "fusion":
        return f"{_kernel_scope(ins, [])} {ins.opcode} {_short_shape(ins.shape)}"
    inner = _fused_ops(comps, ins.attr("calls"))
    ops = {i.opcode for i in inner}
    words = list(dict.fromkeys(w for op, w in _WORK if op in ops))
    if "gemm" not in words and ins.op_name.endswith("/dot_general"):
        words = ["dot"] + [w for w in words if w != "reduce"]      # a dot XLA made a reduce
    if "rms_norm" in words or "gemm" in words:
        words = [w for w in words if w not in ("reduce", "concat")]
    if any("jit(silu)" in i.op_name for i in inner):
        words = ["silu"] + [w for w in words if w != "exp"]
    if not words:                         # the fused computation's root op says it
        body = comps.get(ins.attr("calls") or "", [])
        root = body[-1] if body else None
        if root is not None and root.opcode == "tuple":       # a multi-output fusion: its roots
            by_name = {i.name: i.opcode for i in body}
            words = sorted({by_name.get(o, "?") for o in root.operands})
        else:
            words = [root.opcode if root else "fusion"]
    kind = re.search(r'"kind":"(\w+)"', ins.rest)
    backend = " (triton)" if kind and kind.group(1).startswith("__triton") else ""
    scope = _kernel_scope(ins, inner)
    return f"{scope} {' + '.join(words[:3])}{backend} {_short_shape(ins.shape)}"


@dataclasses.dataclass
class Conditional:
    """One conditional of the step: its predicate's kernel, and each branch's kernels (nested
    conditionals on their `TAKEN_BRANCH`), branch 0 first (a `lax.cond`'s false branch)."""
    scope: str
    predicate: str
    branches: list[collections.Counter]
    depth: int                          # 0 for a conditional of the step itself


@dataclasses.dataclass
class StepCensus:
    """The kernels of one compiled decode program: per step (conditionals on `TAKEN_BRANCH`),
    and per call outside the step loop."""
    trip_count: int | None              # steps per call; None: decided at run time
    step: collections.Counter
    call: collections.Counter
    conditionals: list[Conditional]
    flags: list[str]

    @property
    def per_step(self) -> float:
        outside = sum(self.call.values()) / self.trip_count if self.trip_count else 0.0
        return sum(self.step.values()) + outside


def _trip_count(ins: Instr) -> int | None:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.rest)
    return int(m.group(1)) if m else None


class _Walker:
    """Counts the kernels of computations of one module, collecting its conditionals (each with
    every branch's kernels) and what it could not count exactly (flags) as it goes."""

    def __init__(self, comps: dict[str, list[Instr]]):
        self.comps, self.conditionals, self.flags = comps, [], []

    def iteration(self, loop: Instr, depth: int = 0) -> collections.Counter:
        """The kernels of one iteration of a while loop: its body, its condition, and the
        kernel that sets the loop's condition on the device (the H200 profile's "while", one per
        step of the decode loop)."""
        return (self.count(loop.attr("body"), depth) + self.count(loop.attr("condition"), depth)
                + collections.Counter({f"{_kernel_scope(loop, [])} while (sets the loop "
                                       "condition)": 1}))

    def count(self, comp: str, depth: int = 0, skip: Callable[[Instr], bool] = lambda i: False
              ) -> collections.Counter:
        """The kernels one run of computation `comp` launches."""
        out: collections.Counter = collections.Counter()
        instrs = self.comps.get(comp, [])
        by_name = {i.name: i for i in instrs}
        predicates = {}                   # conditional -> the instruction computing its predicate
        for ins in instrs:
            if ins.opcode == "conditional" and ins.operands:
                src = by_name.get(ins.operands[0])
                while src is not None and src.opcode in ("get-tuple-element", "bitcast", "copy"):
                    src = by_name.get(src.operands[0]) if src.operands else None
                if src is not None:
                    predicates[ins.name] = src
        predicate_kernels = {i.name for i in predicates.values()}
        for ins in instrs:
            if skip(ins) or ins.opcode in _FREE or ins.opcode.endswith("-done"):
                continue
            if ins.opcode == "while":
                body = self.iteration(ins, depth)
                n = _trip_count(ins)
                if n is None:
                    self.flags.append(f"a while loop inside the step ({ins.op_name or ins.name}) "
                                      "has no known trip count: its kernels counted once")
                for k, v in body.items():
                    out[k] += v * (n or 1)
            elif ins.opcode == "conditional":
                names = ([ins.attr("false_computation"), ins.attr("true_computation")]
                         if ins.attr("true_computation") else re.findall(
                             r"%([\w.\-]+)", re.search(r"branch_computations=\{([^}]*)\}",
                                                       ins.rest).group(1)))
                scope = _kernel_scope(ins, [])
                src = predicates.get(ins.name)
                cond = Conditional(scope, kernel_name(src, self.comps) if src else "", [], depth)
                self.conditionals.append(cond)
                cond.branches = [self.count(b, depth + 1) for b in names]
                out[f"{scope} conditional (sets the branch)"] += 1
                out += cond.branches[min(TAKEN_BRANCH, len(names) - 1)]
            elif ins.opcode in ("call", "async-start"):
                out += self.count(ins.attr("to_apply") or ins.attr("calls"), depth)
            else:
                name = kernel_name(ins, self.comps)
                out["cond predicate: " + name if ins.name in predicate_kernels else name] += 1
        return out


def step_census(hlo: str) -> StepCensus:
    """The per-step kernel census of a compiled decode program (optimised GPU HLO text)."""
    comps, entry = parse_module(hlo)
    walker = _Walker(comps)
    loops = [i for i in comps[entry] if i.opcode == "while"]
    if not loops:                         # no loop left: the program is one step
        return StepCensus(1, walker.count(entry), collections.Counter(), walker.conditionals,
                          walker.flags)
    sizes = {i.name: len(_fused_ops(comps, i.attr("body"))) for i in loops}
    step_loop = max(loops, key=lambda i: sizes[i.name])
    step = walker.iteration(step_loop)
    conditionals = list(walker.conditionals)
    call = walker.count(entry, skip=lambda i: i.name == step_loop.name)
    if len(loops) > 1:
        walker.flags.append(f"{len(loops) - 1} more while loop(s) outside the step loop, counted "
                            "per call")
    return StepCensus(_trip_count(step_loop), step, call, conditionals, walker.flags)


