"""`sparrow dryrun`'s text report: one RL step's programs, memory, pool and verdict (from the
report dict `sparrow_jax.dryrun.run.run_dryrun` returns)."""

from __future__ import annotations

from sparrow_jax.dryrun import kernel_census, selection_cost
from sparrow_jax.dryrun.programs import gib


def format_report(r: dict) -> str:
    s = r["shape"]
    lines = [
        f"target   {r['target_description']}; compiled with {r['toolchain']}; {r['depth']}",
        f"model    {r['model_params'] / 1e9:.2f}B params, compute {s['compute_dtype']}, master "
        f"{s['master_dtype']}, learner remat {s['remat']}; rollout {s['rollout_mode']} "
        f"on the {s.get('rollout_engine', 'static')} engine "
        f"(kernels: {s['backend']})",
        f"mesh     {r['mesh']}; {s['rows_step']} rollouts/step in {s['rollout_calls']} call(s) of "
        f"{s['rows_call']} rows ({s['rows_call_per_device']:g}/device); PPO mini-batch "
        f"{s['ppo_mini_batch']}, micro-batch {s['micro_batch']} rows; prompt {s['prompt_len']} + "
        f"{s['max_new_tokens']} new tokens",
        "persistent per device (GiB): " + ", ".join(f"{k} {gib(v)}" for k, v in
                                                    r["persistent"].items())
        + f"; step data {gib(r['step_data'])}",
        f"{'program (GiB per device)':30s}{'args':>7s}{'out':>7s}{'alias':>7s}{'temp':>7s}"
        f"{'code':>6s}{'peak':>7s}{'trans.':>7s}{'TFLOP':>8s}{'GB moved':>9s}{'compile':>8s}"]
    for p in r["programs"]:
        tf = "-" if p["flops"] is None else f"{p['flops'] / 1e12:.2f}"
        gb = "-" if p["bytes_accessed"] is None else f"{p['bytes_accessed'] / 1e9:.1f}"
        lines.append(f"{p['name']:30s}" + "".join(f"{gib(p[k]):>{w}s}" for k, w in (
            ("argument", 7), ("output", 7), ("alias", 7), ("temp", 7), ("code", 6), ("peak", 7),
            ("transient", 7))) + f"{tf:>8s}{gb:>9s}{p['compile_s']:7.1f}s")
        if p["error"]:
            lines.append(f"  ! {p['error']}")
    lines += [f"  largest in {p['name']}: " + "; ".join(p["largest"]) for p in r["programs"]]
    pp = r.get("paged_pool")
    if pp:
        lines.append(
            f"paged KV pool per device: {pp['pages_per_pool']} pages = {pp['tokens_per_pool']} "
            f"tokens, {gib(pp['bytes_per_device'])} GiB ({pp['source']}); "
            f"{pp['slots_per_device']} slots; a sample holds at most "
            f"{pp['max_tokens_per_sample']} tokens; decode chunks of {pp['chunk_steps']} steps")
    c = r["cost_check"]
    if c["compiled_bytes"] is not None:
        lines.append(
            f"decode step bytes per device ({c['rows_per_device']:g} rows, context {c['context']}): "
            f"compiled {c['compiled_bytes'] / 1e9:.2f} GB vs cost_model {c['model_sparse_bytes'] / 1e9:.2f}"
            f" GB sparse at budget {c['budget']} / {c['model_dense_bytes'] / 1e9:.2f} GB dense "
            "(the compiler counts whole operands of a kernel call, e.g. all of the KV cache)")
    sel = r.get("decode_step_bytes")
    if sel:
        lines.append(selection_cost.format_line(sel["rows_per_device"], sel["blocks_per_row"],
                                                sel))
    if r.get("decode_kernels"):
        lines.append(kernel_census.format_line(r["decode_kernels"]))
    mb = r.get("max_batches") or {}
    if mb:
        lines.append(f"largest that fits: rollout {mb.get('rollout_rows_per_device')} rows/device "
                     f"(TrainConfig.rollout_batch_prompts <= {mb.get('rollout_batch_prompts')}), "
                     f"learner micro-batch {mb.get('micro_rows_per_device')} rows/device "
                     f"(LearnerConfig.micro_batch_size <= {mb.get('micro_batch_size')})")
    peak, hbm = r["peak_bytes"], r["hbm_bytes"]
    head = "unknown" if peak is None else f"{gib(peak)} GiB ({1 - peak / hbm:.0%} of HBM free)"
    lines.append(f"{'FITS' if r['fits'] else 'DOES NOT FIT'}: {r['target']} peak {head} per "
                 f"device; HBM {gib(hbm)} GiB, limit {gib(r['limit_bytes'])} GiB with "
                 f"{r['headroom']:.0%} headroom ({r['compile_s']:.0f}s)")
    return "\n".join(lines)
