#!/usr/bin/env python3
"""compare: the dual-host run against its single-host control and the base model; the promotion report.

Usage:
    python bin/compare.py --run RUN [--tolerance 0.02] [--min-speedup 1] [--min-gain 0] [--test-batches -1]
                          [--samples 4] [--max-tokens 128]
Example (what `make compare RUN=stage1` runs):
    .venv/bin/python bin/compare.py --run stage1

The control is runs/<RUN>-control/ (make control's run). The base model and both adapters are
scored with mlx-lm's evaluate() on the same test batches (lib/evaluate: also by record source, and
their greedy answers to a seeded draw of test prompts). Writes runs/<RUN>/compare/: report.md, report.json,
loss_curves.png. Exit 0 pass, 1 a failure verdict, 2 not comparable or an input missing.
"""

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, config, evaluate, launch, paths, tracking  # noqa: E402
from lib.dataset import split_by  # noqa: E402
from lib.hashing import digest_of, tree_hashes  # noqa: E402
from lib.log import FAILURES, STABILITY, RunbookError, anchor_of, die, event  # noqa: E402

DEFAULT_TOLERANCE, DEFAULT_MIN_SPEEDUP, DEFAULT_MIN_GAIN = 0.02, 1.0, 0.0
PASS, NOT_COMPARABLE, WORSE = "pass", "not comparable", FAILURES["worse"][0]  # WORSE: compare-worse-than-base
THUNDER, THUNDER_CATEGORY = "underperforms control: Thunder path", FAILURES["thunder"][0]
EXACT_REL = 1e-5  # dual vs control step-1 loss with token-weighted gradients: float summation order only
LINK_BOUND_SHARE = 0.5  # calibrated: the gradient all-reduce takes at least half of a dual step
ANCHOR_NOT_COMPARABLE, ANCHOR_MISSING = "compare-not-comparable", "compare-missing-run"
SPLITS, MODELS = ("train.jsonl", "valid.jsonl", "test.jsonl"), ("base", "control", "dual")
# Config keys checked on their own, or that the out-of-memory ladder changes keeping the global batch.
OWN_KEYS = {"seed", "batch_size", "grad_accumulation_steps", "steps_per_eval"} | config.RESUMABLE


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="the dual run id: runs/<RUN>/")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE, help="over the control's test loss")
    p.add_argument("--min-speedup", type=float, default=DEFAULT_MIN_SPEEDUP, help="0: the ranks share a Mac")
    p.add_argument("--min-gain", type=float, default=DEFAULT_MIN_GAIN, help="under the base model's loss")
    p.add_argument("--test-batches", type=int, default=-1, help="-1: the whole test split")
    p.add_argument("--samples", type=int, default=4, help="test prompts each model answers in the report")
    p.add_argument("--max-tokens", type=int, default=128, help="the longest sample answer, in tokens")
    return p


def finite(x) -> float | None:  # JSON-safe: None for missing, NaN and inf
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def fmt(x, spec: str = ".4f") -> str:
    return "–" if x is None else format(x, spec) if spec and isinstance(x, (int, float)) else str(x)


def throughput(mets: list[dict]) -> float | None:
    """Steady-state tok/s of the `step` events, each launch's first (compile) step left out."""
    tokens, seconds, last_wall = 0.0, 0.0, None
    for m in mets:
        if m.get("kind") != "step" or not (finite(m.get("tokens")) and finite(m.get("step_s"))):
            continue
        wall = finite(m.get("wall_s"))
        if last_wall is None or (wall is not None and wall < last_wall):  # a launch starts: wall_s goes back
            last_wall = wall
        else:
            last_wall, tokens, seconds = wall or last_wall, tokens + m["tokens"], seconds + m["step_s"]
    return tokens / seconds if seconds > 0 else None


def curve(mets: list[dict], kind: str) -> list[tuple[int, float]]:
    """(step, loss) of one event kind, the last event of a step winning; non-finite losses dropped."""
    return sorted({m["step"]: float(m["loss"]) for m in mets if m.get("kind") == kind
                   and isinstance(m.get("step"), int) and finite(m.get("loss")) is not None}.items())


def run_facts(role: str, run_id: str) -> dict:
    """Everything compare needs from one run folder (raises RunbookError naming the fix)."""
    run_dir, stage = paths.RUNS / paths.check_run_id(run_id), "train" if role == "dual" else "control"
    man, summary = (paths.read_json(run_dir / f) for f in ("manifest.json", f"{stage}.json"))
    if not (man and summary):
        bad = run_dir / ("manifest.json" if not man else f"{stage}.json")
        raise RunbookError(f"{paths.rel(bad)} {'is not a JSON object' if bad.is_file() else 'not found'}: "
                           f"run `make {stage} RUN={run_id.removesuffix('-control')}` first", ANCHOR_MISSING)
    cfg = paths.read_json(run_dir / "adapters" / "adapter_config.json")  # the resolved config, written first
    try:
        mets = launch.metrics(run_dir)  # lib.jsonl.read refuses a line that is not an object
    except ValueError as e:
        raise RunbookError(f"{e}: re-run its stage", ANCHOR_MISSING) from e
    adapter = paths.ROOT / summary["adapter"] if summary.get("adapter") else run_dir / "adapters"
    hostfile = man.get("hostfile") or {}
    repro = run_dir / "reproduce.sh"  # its sections by stage (lib/launch.write_reproduce)
    sections = repro.read_text(encoding="utf-8").split("\n# --- stage: ")[1:] if repro.is_file() else []
    return {
        "role": role, "run": run_id, "ok": bool(summary.get("ok")), "why": summary.get("why") or "",
        **{k: summary.get(k) for k in ("category", "fallback", "best_adapter", "final_step", "world_size",
                                       "rank_batches", "tracking")},  # tracking: W&B's mode, id, url, folder
        **{k: man.get(k) for k in ("hostfile_path", "lock_sha256", "dataset", "dataset_sha256", "model",
                                   "model_sha256")},
        "hosts": [h.get("ssh") for h in hostfile.get("hosts", [])], "hostfile": hostfile,
        "attempts": len(summary.get("attempts") or []), "git": man.get("git") or {},
        "config": cfg, "seed": cfg.get("seed"), "batch_size": (bs := cfg.get("batch_size")),
        "global_batch": bs and bs * (cfg.get("grad_accumulation_steps") or 1),
        "chat_template_args": cfg.get("chat_template_args"),  # the chat format it trained in
        "adapter": paths.rel(adapter) if (adapter / "adapters.safetensors").is_file() else None,
        "stage_wall_s": finite(summary.get("wall_s")), "metrics": mets, "tok_per_s": finite(throughput(mets)),
        "checkpoints_written": sum(m.get("kind") == "checkpoint" for m in mets),
        **trained_on(summary),
        "reproduce": {b.split(" ", 1)[0]: "# --- stage: " + b.strip() for b in sections},
    }


def trained_on(summary: dict) -> dict:
    """What the run trained on (its train.json / control.json `data`): the batches, the targets,
    the padding, the epochs, and the train records kept and left out."""
    data = summary.get("data") or {}
    train = (data.get("splits") or {}).get("train") or {}
    left_out = {k: train[k] for k in ("lost_answers", "weight_zero") if train.get(k)}
    return {"batching": data.get("batching"), "mask_prompt": data.get("mask_prompt"),
            "record_weights": data.get("record_weights"), "weights_ignored": train.get("weights_ignored"),
            "padding_fraction": summary.get("padding_fraction"), "epochs": summary.get("epochs"),
            "train_records_trained": train.get("kept"), "train_records_left_out": left_out or None}


def comparability(dual: dict, control: dict, disk_dataset: str | None, disk_model: str | None) -> dict:
    """What must be equal, each check with both values; problems (not comparable) name their fix."""
    run, dcfg, ccfg = dual["run"], dual["config"], control["config"]
    ds, dsha, msha = dual["dataset"], dual["dataset_sha256"], str(dual["model_sha256"])
    keys = (set(config.DEFAULTS) - OWN_KEYS) & (set(dcfg) | set(ccfg))
    differ = sorted(k for k in keys if dcfg.get(k) != ccfg.get(k))
    checks = [(k, dual[k], control[k], f"re-run the control with the dual run's {w}: "
               f"`make control RUN={run} {w.upper()}={dual[w]}`")
              for k, w in (("dataset_sha256", "dataset"), ("model_sha256", "model"), ("seed", "seed"))]
    checks += [("global_batch", dual["global_batch"], control["global_batch"], "batch_size is the global "
                f"batch: train both with the same CONFIG (the dual run's batch_size {dual['batch_size']})"),
               ("config", {k: dcfg.get(k) for k in differ}, {k: ccfg.get(k) for k in differ}, "train the "
                f"control with the dual run's config (`make control RUN={run} CONFIG=<its CONFIG>`)")]
    out = {"checks": [], "problems": []}
    for name, a, b, fix in checks:
        ok = a == b and (name == "config" or a not in (None, "missing", "unknown"))
        out["checks"].append({"name": name, "dual": a, "control": b, "ok": ok})
        event("compare-check", key=name, status="same" if ok else "DIFFERS", dual=a, control=b)
        out["problems"] += [] if ok else [f"{name} differs: dual {a!r}, control {b!r}: {fix}"]
    if disk_dataset is None:
        out["problems"].append(f"datasets/{ds}/ has no {', '.join(SPLITS)} to evaluate on: "
                               f"`make export DATASET={ds}` or `make sync` it back")
    elif dsha not in (None, "missing", "unknown") and disk_dataset != dsha:
        out["problems"].append(f"datasets/{ds}/ on disk ({disk_dataset[:12]}) is not the data the runs "
                               f"trained on ({dsha[:12]}): restore that export or re-run train and control")
    if disk_model and not msha.startswith("hub:") and disk_model != msha:
        out["problems"].append(f"the model {dual['model']} on disk ({disk_model[:12]}) is not the one the "
                               f"runs trained ({msha[:12]}): restore it, or re-run train and control")
    return {**out, "ok": not out["problems"]}


def decide(dual: dict, control: dict, losses: dict, problems: list, tolerance: float,
           min_speedup=DEFAULT_MIN_SPEEDUP, min_gain=DEFAULT_MIN_GAIN, calibration=None) -> dict:
    """The first verdict that applies: the dual run's own failure, worse than the base model (by min_gain),
    not comparable, the Thunder path (exactness, loss over the tolerance, speedup not over min_speedup)."""
    dt, ct = dual.get("tok_per_s"), control.get("tok_per_s")
    dl, cl, bl = (losses.get(k) for k in ("dual", "control", "base"))
    speedup = dt / ct if dt and ct else None
    world_ratio = (dual.get("world_size") or 1) / (control.get("world_size") or 1)
    v = dict(verdict=PASS, ok=True, category=None, anchor=None, reasons=[], exit_code=0, loss_ok=None,
             faster=None, beats_base=None, exact=None, link_bound=None, speedup=speedup,
             scaling_efficiency=speedup and speedup / world_ratio, world_size_ratio=world_ratio,
             relative_loss_diff=(dl - cl) / cl if finite(dl) is not None and (finite(cl) or 0) > 0 else None,
             base_gain=(bl - dl) / bl if finite(dl) is not None and (finite(bl) or 0) > 0 else None)

    def fail(verdict, cat, reason, code=1, anchor=None):
        v["reasons"].append(reason)
        v.update(verdict=verdict, ok=False, category=cat, anchor=anchor or anchor_of(cat), exit_code=code)
        return v

    if not dual.get("ok"):  # its category: DESIGN's five, out of memory, config, ... (lib/launch.categorize)
        cat = dual.get("category") or FAILURES["error"][0]
        return fail(cat, cat, f"the dual run failed: {dual.get('why') or 'no reason recorded'}")
    if dl is not None and finite(dl) is None:
        return fail(STABILITY, STABILITY, f"the dual adapter's test loss is {dl}: its weights are not finite")
    if "base" in losses and finite(bl) is None:
        problems = problems + [f"the base model's test loss is {bl}: check the model folder"]
    elif finite(bl) is not None and finite(dl) is not None:
        v["beats_base"] = dl < bl * (1 - min_gain)
    if v["beats_base"] is False:
        return fail(WORSE, WORSE, f"the dual adapter's test loss {dl:.4f} is not below the base model's "
                    f"{bl:.4f} by {100 * min_gain:g}% or more (the control's: {fmt(finite(cl))}): training "
                    "made the model worse; check learning_rate, iters, the data and mask_prompt")
    if not control.get("ok"):
        problems = problems + [f"the control run failed ({control.get('category') or 'no category'}: "
                               f"{control.get('why') or 'no reason'}): fix it and re-run `make control`"]
    missing = [f"the {k} adapter's test loss is {losses.get(k)}" for k in ("dual", "control")
               if finite(losses.get(k)) is None]
    slow = [r["run"] for r in (dual, control) if not r.get("tok_per_s")]
    if not problems and missing:
        problems = [f"{' and '.join(missing)}: no adapters.safetensors or bad weights; re-run its stage"]
    elif not problems and slow:
        problems = [f"no throughput in metrics.jsonl of {' and '.join(slow)}: re-run that stage"]
    if problems:
        v["reasons"] += problems[:-1]
        return fail(NOT_COMPARABLE, None, problems[-1], code=2, anchor=ANCHOR_NOT_COMPARABLE)
    v["exact"] = exactness(dual, control)
    if v["exact"] and not v["exact"]["ok"]:
        return fail(THUNDER, THUNDER_CATEGORY, v["exact"]["why"])
    rel, need = v["relative_loss_diff"], f", required > {min_speedup:g}x" if min_speedup != 1 else ""
    v["loss_ok"], v["faster"] = rel <= tolerance + 1e-12, speedup > min_speedup  # at the tolerance: within
    if not v["loss_ok"]:
        v["reasons"].append(f"the dual test loss {dl:.4f} is {100 * rel:+.2f}% against the control's "
                            f"{cl:.4f} (tolerance {100 * tolerance:g}%)")
    if not v["faster"]:
        v["link_bound"], why = link_call(calibration, dual.get("rank_batches"))
        fb = f"; FALLBACK=1: it ran on {fb['hosts']} only" if (fb := dual.get("fallback")) else ""
        v["reasons"].append(f"the dual run was not faster: {dt:.1f} vs {ct:.1f} tok/s "
                            f"(speedup {speedup:.2f}x{need}); {why}{fb}")
    if v["reasons"]:
        return fail(THUNDER, THUNDER_CATEGORY, v["reasons"].pop())
    gain = "" if v["base_gain"] is None else f", {100 * v['base_gain']:.2f}% below the base model's {bl:.4f}"
    v["reasons"].append(f"dual test loss {dl:.4f} vs control {cl:.4f} ({100 * rel:+.2f}%, tolerance "
                        f"{100 * tolerance:g}%){gain}, speedup {speedup:.2f}x{need}")
    if rel < -tolerance:
        v["reasons"].append(f"note: the dual loss is better than the control's by more than the tolerance "
                            f"({100 * rel:+.2f}%): check both ran the same config")
    return v


def link_call(cal: dict | None, batches: list[int] | None = None) -> tuple[bool | None, str]:
    """Link-bound: the all-reduce at LINK_BOUND_SHARE or more of a dual step; else a slow Mac, and its fix."""
    if not cal:
        return None, "no calibration (hosts, model) tells a slow link from a slow Mac: run `make calibrate`"
    share, e, f = cal["link_share"], cal["expected_speedup"], cal["file"]
    if share >= LINK_BOUND_SHARE:
        return True, (f"link-bound: calibrate ({f}) measured the gradient all-reduce at {100 * share:.0f}% "
                      f"of a dual step and predicted {e:.2f}x: the Thunder path is the bottleneck")
    rule = cal.get("rank_shares") or {}
    unequal = rule.get("rule") == "proportional" and len(set(batches or [0])) == 1  # yet the run split evenly
    fix = f"calibrate found the Macs unequal ({rule['why']}): set `rank_shares: auto`" if unequal else \
        "`make calibrate`"
    return False, (f"not the link: calibrate ({f}) predicted {e:.2f}x, all-reduce {100 * share:.0f}% of a "
                   f"dual step: a Mac computed slower than calibrated (or the link changed): {fix}")


def calibration_of(dual: dict) -> dict | None:
    """The newest runs/calibration-*.json measured on the dual run's hosts with its model, or None."""
    for path, cal in paths.calibrations():
        sp = cal.get("speedup") or {}
        hosts = [h.get("ssh") for h in (cal.get("hostfile") or {}).get("hosts", [])]
        if hosts == dual["hosts"] and cal.get("model") == dual["model"] and "link_share" in sp:
            return {"file": paths.rel(path), "rank_shares": cal.get("rank_shares"),
                    **{k: sp[k] for k in ("expected_speedup", "link_share")}}
    return None


def exactness(dual: dict, control: dict) -> dict | None:
    """With token-weighted gradients on both runs (else None), step 1 may differ by float error only."""
    if not all((r.get("config") or {}).get("grad_average") == "tokens" for r in (dual, control)):
        return None
    d, c = (dict(curve(r.get("metrics") or [], "step")) for r in (dual, control))
    common = sorted(set(d) & set(c))
    if 1 not in common:
        return {"ok": False, "why": "no step-1 loss in both runs' metrics.jsonl to compare: re-run them"}
    rel = {k: abs(d[k] - c[k]) / max(abs(c[k]), 1e-12) for k in common}
    ok = rel[1] <= EXACT_REL
    why = (f"step-1 loss dual {d[1]:.9g} vs control {c[1]:.9g}: relative {rel[1]:.2e} "
           f"{'within' if ok else 'over'} float error {EXACT_REL:g} with token-weighted gradients"
           + ("" if ok else ": the dual run does not compute what the control computes (data order, masking, "
              "token counts or the all-reduce differ)"))
    return {"ok": ok, "why": why, "step1_rel": rel[1], "max_rel": max(rel.values()), "steps": len(common)}


def plot_curves(path: Path, dual: dict, control: dict, base: float | None, verdict: str) -> None:
    """Train and validation loss of both runs; the base model's test loss a line."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 6))
    ax = fig.subplots()
    for r, style in ((control, dict(color="tab:orange", lw=4, alpha=0.55)), (dual, dict(color="tab:blue"))):
        for kind, extra in (("step", {}), ("val", {"ls": "--", "marker": "o"})):
            if pts := curve(r["metrics"], kind):
                ax.plot(*zip(*pts, strict=True), **style, **extra, label=f"{r['role']} {r['run']} {kind}")
    if base is not None:
        ax.axhline(base, color="gray", ls=":", lw=1.5, label=f"base model test loss {base:.4f}")
    ax.set(xlabel="step", ylabel="loss per token", title=f"{dual['run']} vs {control['run']}: {verdict}")
    ax.legend(fontsize=8)
    fig.savefig(path, format="png", dpi=110)


def build_report(args, dual: dict, control: dict, comp: dict, ev: dict | None, v: dict, cmd: list) -> dict:
    """report.json: the verdict, base / control / dual losses, speed, comparability, losses by source, sample
    answers and both runs' facts."""
    models, ev = (ev or {}).get("models", {}), ev or {}
    cta = json.dumps(dual["chat_template_args"] or {})
    serve = ["--model", str(dual["model"]), "--adapter-path", str(dual["adapter"])]
    rows = {name: {**(m := models.get(name, {})), "evaluated": name in models, "adapter": r and r["adapter"],
                   "loss": (x := finite(m.get("loss"))), "ppl": None if x is None else math.exp(min(x, 700))}
            for name, r in (("base", None), ("control", control), ("dual", dual))}
    return {
        "format": "thunder-runbook/compare-report", "format_version": 1, "created": time.strftime(launch.NOW),
        "run": dual["run"], "control_run": control["run"],
        **{k: v[k] for k in ("verdict", "ok", "category", "anchor", "reasons", "exit_code")},
        "tolerance": args.tolerance, "min_speedup": args.min_speedup, "min_gain": args.min_gain,
        "loss": {**{k: rows[k]["loss"] for k in rows}, "relative_diff": v["relative_loss_diff"],
                 "within_tolerance": v["loss_ok"], "base_gain": v["base_gain"], "beats_base": v["beats_base"],
                 "exact": v["exact"]},
        "throughput": {"dual_tok_per_s": dual["tok_per_s"], "control_tok_per_s": control["tok_per_s"], **{
            k: v[k] for k in ("speedup", "scaling_efficiency", "world_size_ratio", "faster", "link_bound")}},
        "comparable": comp,
        "export": {"lines": launch.export_section(dual["dataset"]) if dual["dataset"] else []},
        "dataset": split_note(dual["dataset"]),  # "warning": test shares documents with train
        "evaluation": ev and {**{k: x for k, x in ev.items() if k not in ("by_source", "samples")},
                              "models": rows, "split": f"datasets/{dual['dataset']}/test.jsonl"} or None,
        "by_source": (by := [{**r, **{m: finite(r.get(m)) for m in MODELS}}
                             for r in ev.get("by_source", [])]),
        "samples": [{**dict.fromkeys(MODELS), **x} for x in ev.get("samples", [])],
        "warnings": [f"source {r['source']}: the dual adapter's test loss {r['dual']:.4f} is over the base "
                     f"model's {r['base']:.4f} by more than the tolerance ({r['tokens']} tokens)"
                     for r in by if None not in (r["dual"], r["base"])
                     and r["dual"] > r["base"] * (1 + args.tolerance)],
        "runs": {r["role"]: {k: x for k, x in r.items() if k not in ("metrics", "config")}
                 for r in (dual, control)},
        "reproduce_compare": shlex.join(cmd),  # then mlx-lm serving the adapter in the format it trained in
        "serve": [f"# Serve the dual adapter in its training format (chat_template_args {cta}):",
                  shlex.join(["mlx_lm", "generate", *serve, "--chat-template-config", cta, "--prompt", "Hi"]),
                  shlex.join(["mlx_lm.server", *serve, "--chat-template-args", cta])],
    }


def split_note(dataset: str | None) -> dict:
    """How the dataset's splits were drawn (its manifest); a warning when test shares documents."""
    man = paths.read_json(paths.DATASETS / dataset / "manifest.json") if dataset else {}
    by = split_by(man)
    corpus = " ".join(str(x.get("path")) for x in man.get("sources") or []) or "<files>"
    warning = None
    if by == "record":
        warning = (f"the test split shares documents with train (datasets/{dataset} was split "
                   "by record), so the test loss measures recall of seen documents. Fix: export "
                   f"it again with split_by: source (make export CORPUS='{corpus}' "
                   f"DATASET={dataset} REPLACE=1), then train, control and compare again")
    return {"name": dataset, "split_by": by, "warning": warning}


def cell(text) -> str:
    """A text as one markdown table cell: its lines kept as <br>, its pipes and tags (<bos>) escaped."""
    text = "–" if text is None else str(text).replace("|", "\\|").replace("<", "&lt;")
    return "<br>".join(text.splitlines()) or "(empty)"


def render_md(rep: dict) -> str:
    """The promotion report: verdict, how to reproduce it (data first), base / control / dual, the runs."""
    runs, tp, lo = rep["runs"], rep["throughput"], rep["loss"]
    see = f" (see RUNBOOK.md#{rep['anchor']})" if rep["anchor"] else ""
    stages = dict.fromkeys(text for r in runs.values() for st, text in r["reproduce"].items()
                           if st not in ("export", "compare"))
    L = [f"# Promotion report: `{rep['run']}` vs control `{rep['control_run']}`", "",
         f"**Verdict: {rep['verdict']}**{see}", "", *[f"- {r}" for r in rep["reasons"]], "",
         "## Reproduce", "", "```bash", *rep["export"]["lines"], *stages, rep["reproduce_compare"],
         *rep["serve"], "```", "",
         "## Metrics", "", f"Speedup {fmt(tp['speedup'], '.2f')}x, "
         f"scaling efficiency {fmt(tp['scaling_efficiency'], '.2f')}.", "",
         "| model | test loss | train tok/s | adapter |", "|---|---|---|---|"]
    if warning := rep["dataset"]["warning"]:  # the first thing read, before the verdict
        L[2:2] = [f"**Warning: {warning}.**", ""]
    for name in MODELS:
        r = runs.get(name, {})
        L.append(f"| {name} | {fmt(lo[name])} | {fmt(r.get('tok_per_s'), '.1f')} | {fmt(r.get('adapter'))} |")
    warn = [f"- warning: {w}" for w in rep["warnings"]]
    L += ["", "## Test loss by source", "", *warn, *[""][:len(warn)],
          "| source | tokens | base | control | dual |", "|---|---|---|---|---|"]
    L += [f"| {r['source']} | {r['tokens']} | " + " | ".join(fmt(r[m]) for m in MODELS) + " |"
          for r in rep["by_source"]]
    most = (rep["evaluation"] or {}).get("sampling", {}).get("max_tokens")
    L += ["", "## Sample answers", "", f"Greedy, up to {most} tokens, in the chat format the adapters "
          "trained in." if rep["samples"] else "No sample answers."]
    for i, x in enumerate(rep["samples"], 1):  # the answers side by side, the reference first
        L += ["", f"**Sample {i}.** {cell(x['prompt'])}", "", "| reference | base | control | dual |",
              "|---|---|---|---|", "| " + " | ".join(cell(x.get(k)) for k in ("reference", *MODELS)) + " |"]
    L += ["", "## Runs", "", "| | dual | control |", "|---|---|---|"]
    for key in (k for k in runs["dual"] if k not in ("role", "hostfile", "reproduce")):
        a, b = (runs[r].get(key) for r in ("dual", "control"))
        a, b = map(tracking.describe, (a, b)) if key == "tracking" else (a, b)
        L.append(f"| {key} | {fmt(a, '')} | {fmt(b, '')} |")
    return "\n".join(L + ["", "![train and validation loss of both runs](loss_curves.png)", ""])


def main() -> int:
    parser = build_parser()
    args, t0 = parser.parse_args(), time.monotonic()
    cmd = ["make", "compare", f"RUN={args.run}"] + [f"{k.upper()}={x:g}" for k, x in vars(args).items()
                                                    if k != "run" and x != parser.get_default(k)]
    try:
        if not (0 <= args.tolerance < 1 and 0 <= args.min_gain < 1 and args.min_speedup >= 0 and
                (args.test_batches == -1 or args.test_batches >= 1) and args.samples >= 0 < args.max_tokens):
            raise RunbookError("--tolerance and --min-gain are fractions in [0, 1) (0.02: 2%), --min-speedup "
                               ">= 0, --test-batches -1 (all) or >= 1, --samples >= 0, --max-tokens >= 1",
                               "compare")
        dual = run_facts("dual", args.run)
        control = run_facts("control", f"{args.run}-control")
        data = paths.DATASETS / str(dual["dataset"])  # on disk now, it must be what the runs trained on
        on_disk = digest_of(tree_hashes(data, SPLITS)) if all((data / s).is_file() for s in SPLITS) else None
        comp = comparability(dual, control, on_disk, dual["model"] and launch.model_hash(dual["model"]))
        adapters = {"control": control["adapter"], "dual": dual["adapter"]}
        ev = evaluate.models(dual["model"], adapters, data, dual["config"], args.test_batches, args.samples,
                             args.max_tokens) if comp["ok"] else None
    except (RunbookError, ValueError) as e:
        return die(e, 2)
    losses = {k: m["loss"] for k, m in (ev or {}).get("models", {}).items()}
    v = decide(dual, control, losses, comp["problems"], args.tolerance, args.min_speedup, args.min_gain,
               calibration_of(dual))
    rep = {**build_report(args, dual, control, comp, ev, v, cmd), "wall_s": round(time.monotonic() - t0, 3)}
    run_dir = paths.RUNS / args.run
    with atomic.atomic_dir(run_dir / "compare") as tmp:
        atomic.write_json(tmp / "report.json", rep)
        atomic.write_text(tmp / "report.md", render_md(rep))
        plot_curves(tmp / "loss_curves.png", dual, control, rep["loss"]["base"], v["verdict"])
    launch.write_reproduce(run_dir, "compare", cmd, [[sys.executable, "bin/compare.py", *sys.argv[1:]]])
    launch.finish_manifest(run_dir, "compare", v)
    event("compare", run=args.run, control=control["run"], verdict=json.dumps(v["verdict"]),
          **{f"{k}_loss": rep["loss"][k] for k in ("base", "control", "dual")}, speedup=v["speedup"],
          efficiency=v["scaling_efficiency"], report=f"runs/{args.run}/compare/report.md")
    if not v["ok"] and v["category"]:
        launch.print_category(v["category"], "; ".join(v["reasons"]))
    elif not v["ok"]:
        die(RunbookError(f"{v['verdict']}: {'; '.join(v['reasons'])}", v["anchor"]), v["exit_code"])
    return v["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
