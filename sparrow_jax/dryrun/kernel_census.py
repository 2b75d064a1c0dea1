"""The kernels one decode step launches on a GPU, counted in its compiled program without the
hardware (issue 55): per dense layer, per sparse layer and outside the layers, each kernel named
by what it does (`dryrun.step_kernels` counts one compiled program's).

A GPU decode step is bound by launches and weights at small batch (the H200 profile: 504 kernels
a dense step, 816 a sparse one, the GPU idle 17-28% of it), so the count is a number to hold down.

Per layer: the same program compiled at a few depths (`layer_depths`), the differences of their
per-step censuses: one dense layer from 2 to 3 layers (the third made dense if the config has it
sparse), one sparse layer from n to n + 1 layers with layer n sparse, a sparse layer below it
(work all sparse layers share, computed once a step, is not a layer's) and n >= `SPARSE_FROM`;
outside = the rest of the deepest compile. Layers of a kind lower alike, so per step at full
depth = outside + dense layers x per dense layer + sparse layers x per sparse layer (the 1.7B
H100 chunk: exactly its 28-layer compile's count, sparse and dense mode).
"""

from __future__ import annotations

import collections
import dataclasses

from sparrow_jax.dryrun.step_kernels import TAKEN_BRANCH, Conditional, StepCensus, step_census

# The shallowest depth whose one more sparse layer stands for every further one: XLA fuses a
# value every layer reads (the RoPE table) into its readers while they are few and computes it
# once when they are many. The 1.7B H100 decode chunk at 8 rows per GPU: 33 kernels from 3 to 4
# layers, 31 from 4 to 5 and from 5 to 6, and 4 -> 5 extrapolates exactly to its 28-layer
# compile.
SPARSE_FROM = 4


@dataclasses.dataclass(frozen=True)
class Depth:
    """One compile of the decode program: at `layers` layers, layer `made_dense` (if any) dense
    though the config makes it sparse (a dense layer above the config's dense ones)."""
    layers: int
    made_dense: int | None = None

    def rollout(self, rc):
        if self.made_dense is None:
            return rc
        return dataclasses.replace(rc, dense_layers=tuple(rc.dense_layers) + (self.made_dense,))

    @property
    def order(self) -> tuple[int, int]:
        return self.layers, -1 if self.made_dense is None else self.made_dense

    def counts(self, rc) -> tuple[int, int]:
        """(dense, sparse) layers of this compile."""
        sparse = self.rollout(rc).num_sparse_layers(self.layers)
        return self.layers - sparse, sparse


def layer_depths(rc, layers: int) -> tuple[tuple[Depth, Depth] | None,
                                           tuple[Depth, Depth] | None]:
    """The compiles whose difference is one dense layer, and one sparse layer, of a `layers`-
    layer model under RolloutConfig `rc` (None where the model has no such layer or is too
    shallow). Dense: 2 -> 3 layers, the third made dense if the config has it sparse (at 1 -> 2
    a per-step copy XLA adds from 2 layers on would count as the layer's). Sparse: n -> n + 1
    layers for the first n >= SPARSE_FROM with layer n sparse and a sparse layer below it (in a
    model too shallow for that, the deepest such n)."""
    dense = None
    if layers >= 3:
        dense = (Depth(2), Depth(3, 2 if rc.sparse_layer(2) else None))
    elif layers == 2 and not rc.sparse_layer(1):
        dense = (Depth(1), Depth(2))
    below = [n for n in range(1, layers) if rc.sparse_layer(n)
             and any(rc.sparse_layer(i) for i in range(n))]
    n = next((n for n in below if n >= SPARSE_FROM), below[-1] if below else None)
    return dense, None if n is None else (Depth(n), Depth(n + 1))


@dataclasses.dataclass
class LayerCensus:
    """Kernels per decode step by where they run: one dense layer, one sparse layer (its
    conditionals on `TAKEN_BRANCH`), and outside the layers - in the step loop, and per call
    outside it (`steps_per_call` steps share those)."""
    layers: int
    dense_layers: int
    sparse_layers: int
    steps_per_call: int | None
    dense_layer: collections.Counter | None
    sparse_layer: collections.Counter | None
    outside_in_loop: collections.Counter
    outside_per_call: collections.Counter
    sparse_conditionals: list[Conditional]
    per_step_at_depth: dict[Depth, float]
    flags: list[str]

    @property
    def per_dense_layer(self) -> int | None:
        return None if self.dense_layer is None else sum(self.dense_layer.values())

    @property
    def per_sparse_layer(self) -> int | None:
        return None if self.sparse_layer is None else sum(self.sparse_layer.values())

    @property
    def outside(self) -> float:
        per_call = sum(self.outside_per_call.values())
        return sum(self.outside_in_loop.values()) + (
            per_call / self.steps_per_call if self.steps_per_call else 0.0)

    @property
    def per_step(self) -> float:
        """Kernels per step at full depth, every layer of its kind."""
        return (self.outside + self.dense_layers * (self.per_dense_layer or 0)
                + self.sparse_layers * (self.per_sparse_layer or 0))

    @property
    def per_step_dense(self) -> float:
        """Kernels per step at full depth were every layer a dense one."""
        return self.outside + self.layers * (self.per_dense_layer or 0)

    def as_dict(self) -> dict:
        def names(c: collections.Counter | None) -> dict[str, int] | None:
            return None if c is None else {k: v for k, v in sorted(c.items()) if v}
        return {
            "per_dense_layer": self.per_dense_layer, "per_sparse_layer": self.per_sparse_layer,
            "outside": round(self.outside, 3),
            "outside_in_loop": sum(self.outside_in_loop.values()),
            "outside_per_call": sum(self.outside_per_call.values()),
            "steps_per_call": self.steps_per_call, "layers": self.layers,
            "dense_layers": self.dense_layers, "sparse_layers": self.sparse_layers,
            "per_step": round(self.per_step, 3), "per_step_dense": round(self.per_step_dense, 3),
            "taken_branch": TAKEN_BRANCH,
            "per_step_at_depth": {
                f"{d.layers}" + (f" (layer {d.made_dense} dense)" if d.made_dense is not None
                                 else ""): round(v, 3)
                for d, v in sorted(self.per_step_at_depth.items(), key=lambda dv: dv[0].order)},
            "dense_layer_kernels": names(self.dense_layer),
            "sparse_layer_kernels": names(self.sparse_layer),
            "outside_kernels": names(self.outside_in_loop),
            "per_call_kernels": names(self.outside_per_call),
            "sparse_layer_conditionals": [
                {"scope": c.scope, "depth": c.depth, "predicate": c.predicate,
                 "branch_kernels": [sum(b.values()) for b in c.branches],
                 "branches": [names(b) for b in c.branches]} for c in self.sparse_conditionals],
            "flags": self.flags,
        }


def _difference(a: StepCensus, b: StepCensus, what: str, flags: list[str]) -> collections.Counter:
    """The kernels per step b has beyond a (one more layer)."""
    missing = a.step - b.step
    if missing:
        flags.append(f"{what}: the deeper program lacks {sum(missing.values())} of the "
                     f"shallower one's kernels ({', '.join(sorted(missing))}); the layer's "
                     "list is the kernels it adds")
    return b.step - a.step


def layer_census(by_depth: dict[Depth, StepCensus], rc, layers: int) -> LayerCensus:
    """Per layer and outside, from censuses of the same decode program at the depths
    `layer_depths(rc, layers)` names; outside is the rest of the deepest compile of the config
    itself."""
    dense_pair, sparse_pair = layer_depths(rc, layers)
    flags: list[str] = []
    dense = sparse = None
    if dense_pair:
        dense = _difference(by_depth[dense_pair[0]], by_depth[dense_pair[1]], "dense layer", flags)
    if sparse_pair:
        sparse = _difference(by_depth[sparse_pair[0]], by_depth[sparse_pair[1]], "sparse layer",
                             flags)
    deepest = max((d for d in by_depth if d.made_dense is None), key=lambda d: d.layers)
    top = by_depth[deepest]
    # What is left of the deepest program; a negative count is a layer's kernel XLA fused into
    # work outside the layers there (the last layer's residual add into the final norm).
    outside = collections.Counter(top.step)
    for counter, n in zip((dense, sparse), deepest.counts(rc)):
        if n and counter is None:
            flags.append(f"the model is too shallow to tell its {n} layer(s) of a kind apart "
                         "from the rest: counted outside")
        for _ in range(n if counter is not None else 0):
            outside.subtract(counter)
    # One sparse layer's conditionals: the last one of the step and those nested in it.
    conds = top.conditionals
    last = max((i for i, c in enumerate(conds) if c.depth == 0), default=None)
    for c in by_depth.values():
        flags += [f for f in c.flags if f not in flags]
    n_sparse = rc.num_sparse_layers(layers)
    return LayerCensus(
        layers=layers, dense_layers=layers - n_sparse, sparse_layers=n_sparse,
        steps_per_call=top.trip_count, dense_layer=dense, sparse_layer=sparse,
        outside_in_loop=outside, outside_per_call=top.call,
        sparse_conditionals=[] if last is None or sparse is None else conds[last:],
        per_step_at_depth={d: c.per_step for d, c in by_depth.items()}, flags=flags)


def census_by_depth(shape, spec, target, known: dict[Depth, StepCensus] | None = None
                    ) -> LayerCensus:
    """Compiles the configured decode program of `shape` (a `dryrun.programs.StepShape`) for
    GPU `target` at the depths `layer_depths` names (those in `known` are not compiled again;
    each as `decode_call.decode_call(..., layers=depth)`) and counts its kernels."""
    from sparrow_jax.dryrun.decode_call import decode_call
    from sparrow_jax.dryrun.programs import compile_program
    if target.platform != "cuda":
        raise ValueError(f"the kernel census reads XLA's GPU programs; {target.name} is a "
                         f"{target.platform} target")
    rc, layers = shape.rollout, shape.model.num_hidden_layers
    wanted = {d for pair in layer_depths(rc, layers) if pair for d in pair}
    by_depth = dict(known or {})
    for depth in sorted(wanted - set(by_depth), key=lambda d: d.order):
        call = decode_call(dataclasses.replace(shape, rollout=depth.rollout(rc)), spec, target,
                           depth.layers)
        measured, _, compiled = compile_program(call.program, target.kernel_platform, call.rows)
        if compiled is None:
            raise RuntimeError(f"{call.program.name} at {depth} did not compile for "
                               f"{target.name}: {measured.error}")
        by_depth[depth] = step_census(compiled.as_text())
    if not any(d.made_dense is None for d in by_depth):     # a one-layer model
        raise ValueError(f"a {layers}-layer model has no two depths to tell its layers apart")
    return layer_census(by_depth, rc, layers)


def _listing(names: dict[str, int]) -> str:
    return "; ".join(k if n == 1 else f"{n} x {k}" for k, n in sorted(names.items()) if n)


def format_line(k: dict) -> str:
    """One line from a `LayerCensus.as_dict()`: kernels per dense / sparse layer, outside, and
    per step at full depth."""
    calls = (f"{k['outside_per_call']} per {k['steps_per_call']}-step call"
             if k["steps_per_call"] else f"{k['outside_per_call']} per call")
    branch = " (its sparse branch)" if k.get("sparse_layer_conditionals") else ""
    sparse = (f", {k['per_sparse_layer']} per sparse layer{branch}"
              if k["per_sparse_layer"] is not None else "")
    step = (f"~{k['per_step_dense']:.0f} / ~{k['per_step']:.0f} per step at {k['layers']} "
            f"layers dense / sparse ({k['sparse_layers']} sparse layers)" if k["sparse_layers"]
            else f"~{k['per_step_dense']:.0f} per step at {k['layers']} layers")
    return (f"decode step kernels: {k['per_dense_layer']} per dense layer{sparse}, "
            f"{k['outside']:.1f} outside ({k['outside_in_loop']} in the step loop + {calls}); "
            f"{step}")


def format_lists(k: dict) -> str:
    """`format_line`, then the kernels of a dense layer, a sparse layer (and each branch of
    its conditionals) and outside, by name."""
    lines = [format_line(k)]
    if k["dense_layer_kernels"] is not None:
        lines.append(f"  dense layer ({k['per_dense_layer']}): "
                     f"{_listing(k['dense_layer_kernels'])}")
    if k["sparse_layer_kernels"] is not None:
        lines.append(f"  sparse layer ({k['per_sparse_layer']}): "
                     f"{_listing(k['sparse_layer_kernels'])}")
        for c in k["sparse_layer_conditionals"]:
            for i, b in enumerate(c["branches"]):
                taken = " (taken)" if i == min(k["taken_branch"], len(c["branches"]) - 1) else ""
                lines.append(f"    {'  ' * c['depth']}conditional in {c['scope']}, branch {i}"
                             f"{taken} ({sum(b.values())}): {_listing(b)}")
    lines.append(f"  outside, in the step loop ({k['outside_in_loop']}): "
                 f"{_listing(k['outside_kernels'])}")
    lines.append(f"  outside, per call ({k['outside_per_call']}): "
                 f"{_listing(k['per_call_kernels'])}")
    lines += [f"  ! {f}" for f in k["flags"]]
    return "\n".join(lines)
