#!/usr/bin/env python3
"""compare: the dual-host run against its single-host control and the base model; the promotion report.

Usage:
    python bin/compare.py --run RUN [--tolerance 0.02] [--min-speedup 1] [--min-gain 0] [--test-batches -1]
Example (what `make compare RUN=stage1` runs):
    .venv/bin/python bin/compare.py --run stage1

Reads runs/<RUN>/ and its control (the manifest's control_run, else runs/<RUN>-control/), which must
share dataset bytes, model, seed, global batch and config. The base model and both adapters are evaluated
on the test split with mlx-lm's evaluate() over the same (fingerprinted) batches. Writes runs/<RUN>/compare/
atomically: report.md, report.json, loss_curves.png. The verdict is decide()'s. Exit 0 pass, 1 a failure
verdict, 2 not comparable or an input missing; stderr ends `see RUNBOOK.md#anchor`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, jsonl, launch, paths  # noqa: E402
from lib.config import DEFAULTS as CONFIG_DEFAULTS  # noqa: E402
from lib.config import RESUMABLE  # noqa: E402
from lib.hashing import digest_of, tree_hashes  # noqa: E402
from lib.log import FAILURES, OTHER_FAILURES, STABILITY, RunbookError, anchor_of, die, event  # noqa: E402
from lib.log import THUNDER as THUNDER_CATEGORY  # noqa: E402

FORMAT, FORMAT_VERSION = "thunder-runbook/compare-report", 1
DEFAULT_TOLERANCE, DEFAULT_MIN_SPEEDUP, DEFAULT_MIN_GAIN = 0.02, 1.0, 0.0
PASS, NOT_COMPARABLE, DUAL_FAILED = "pass", "not comparable", "dual run failed"
THUNDER = "underperforms control: Thunder path"
WORSE = OTHER_FAILURES["worse"][0]  # anchor compare-worse-than-base
EXACT_REL = 1e-5  # dual vs control step-1 loss with token-weighted gradients: float summation order only
LINK_BOUND_SHARE = 0.5  # calibrated: the gradient all-reduce takes at least half of a dual step
ANCHOR_NOT_COMPARABLE = "compare-not-comparable"
ANCHOR_MISSING = "compare-missing-run"
SPLITS = ("train.jsonl", "valid.jsonl", "test.jsonl")
# Keys the out-of-memory ladder (lib/config.py fallback_ladder) may change keeping the global batch.
LADDER_KEYS = {"batch_size", "grad_accumulation_steps", "steps_per_eval", "save_every", "steps_per_report",
               "iters"}
FEATURES = ("mask_prompt", "chat_feature", "prompt_feature", "completion_feature", "text_feature")
UNKNOWN = (None, "missing", "unknown")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="the dual run id: runs/<RUN>/")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help="relative test-loss tolerance of dual over control (default 0.02 = 2%%)")
    p.add_argument("--min-speedup", type=float, default=DEFAULT_MIN_SPEEDUP,
                   help="dual must be faster than this x the control (default 1; 0: ranks share a machine)")
    p.add_argument("--min-gain", type=float, default=DEFAULT_MIN_GAIN,
                   help="dual test loss must be below the base model's by this fraction of it (default 0)")
    p.add_argument("--test-batches", type=int, default=-1, help="test batches to score (-1: the whole split)")
    return p


def check_args(args) -> None:
    if not (0 <= args.tolerance < 1 and 0 <= args.min_gain < 1 and args.min_speedup >= 0):
        raise RunbookError(f"--tolerance {args.tolerance:g} and --min-gain {args.min_gain:g} are fractions "
                           f"of a test loss in [0, 1) (0.02: 2%); --min-speedup {args.min_speedup:g} is >= 0",
                           "compare")
    if args.test_batches == 0 or args.test_batches < -1:
        raise RunbookError(f"--test-batches {args.test_batches}: use -1 (all) or a number >= 1", "compare")


# ---- reading a run folder ----------------------------------------------------------------------
def finite(x) -> float | None:
    """A JSON-safe number: None for missing, NaN and inf."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def ppl_of(loss: float | None) -> float | None:
    return math.exp(loss) if finite(loss) is not None and loss < 700 else None


def throughput(mets: list[dict]) -> dict:
    """Steady-state tok/s: global tokens over step time of the `step` events, leaving out the first step
    of each launch (its compile; a launch starts where wall_s goes back)."""
    tokens = seconds = 0.0
    launches, last_wall, n = 0, None, 0
    for m in mets:
        if m.get("kind") != "step" or not (finite(m.get("tokens")) and finite(m.get("step_s"))):
            continue
        wall = finite(m.get("wall_s"))
        if last_wall is None or (wall is not None and wall < last_wall):
            launches, last_wall = launches + 1, wall
            continue
        last_wall, tokens, seconds, n = wall or last_wall, tokens + m["tokens"], seconds + m["step_s"], n + 1
    if not (n and seconds > 0):
        return {"tok_per_s": None, "method": "no step events with tokens and step_s in metrics.jsonl"}
    return {"tok_per_s": tokens / seconds, "method": f"step events: {int(tokens)} tokens / {seconds:.3f} s "
            f"over {n} steps (first step of {launches} launch(es) left out: compile)"}


def curve(mets: list[dict], kind: str) -> list[tuple[int, float]]:
    """(step, loss) of one event kind, the last event of a step winning; non-finite losses dropped."""
    return sorted({m["step"]: float(m["loss"]) for m in mets if m.get("kind") == kind
                   and isinstance(m.get("step"), int) and finite(m.get("loss")) is not None}.items())


def run_facts(role: str, run_id: str, summary_name: str) -> dict:
    """Everything compare needs from one run folder (raises RunbookError naming the fix)."""
    run_dir = paths.RUNS / paths.check_run_id(run_id)
    fix = f"run `make {'train' if role == 'dual' else 'control'} RUN={run_id.removesuffix('-control')}` first"
    man, summary = (launch.read_json(run_dir / f) for f in ("manifest.json", summary_name))
    if not (man and summary):
        bad = run_dir / ("manifest.json" if not man else summary_name)
        what = "is not a JSON object" if bad.is_file() else "not found"
        raise RunbookError(f"{paths.rel(bad)} {what}: {fix}", ANCHOR_MISSING)
    cfg = launch.read_json(run_dir / "adapters" / "adapter_config.json")  # the resolved config, written first
    try:
        mets = [m for m in launch.metrics(run_dir) if isinstance(m, dict)]
    except ValueError as e:
        raise RunbookError(f"{e}: re-run its stage", ANCHOR_MISSING) from e
    adapter = paths.ROOT / summary["adapter"] if summary.get("adapter") else run_dir / "adapters"
    has_adapter = all((adapter / f).is_file() for f in ("adapters.safetensors", "adapter_config.json"))
    hostfile = man.get("hostfile") if isinstance(man.get("hostfile"), dict) else {}
    hosts = [h.get("ssh") for h in hostfile.get("hosts", [])]
    world, tp = summary.get("world_size") or man.get("world_size") or len(hosts), throughput(mets)
    accum = cfg.get("grad_accumulation_steps") or 1
    repro = run_dir / "reproduce.sh"  # its sections by stage (lib/launch.write_reproduce)
    sections = repro.read_text(encoding="utf-8").split("\n# --- stage: ")[1:] if repro.is_file() else []
    return {
        "role": role, "run": run_id, "ok": bool(summary.get("ok")), "category": summary.get("category"),
        "why": summary.get("why") or "", "world_size": int(world) if world else None, "hosts": hosts,
        "fallback": summary.get("fallback"), "attempts": len(summary.get("attempts") or []),
        "hostfile_path": man.get("hostfile_path"), "hostfile": hostfile, "git": man.get("git") or {},
        **{k: man.get(k) for k in ("lock_sha256", "dataset", "dataset_sha256", "model", "model_sha256",
                                   "control_run")},
        "config": cfg, "seed": cfg.get("seed"), "batch_size": cfg.get("batch_size"),
        "global_batch": cfg.get("batch_size") and cfg["batch_size"] * accum,
        "adapter": paths.rel(adapter) if has_adapter else None, "best_adapter": summary.get("best_adapter"),
        "final_step": summary.get("final_step"), "stage_wall_s": finite(summary.get("wall_s")),
        "metrics": mets, "tok_per_s": finite(tp["tok_per_s"]), "tok_per_s_method": tp["method"],
        "checkpoints_written": sum(m.get("kind") == "checkpoint" for m in mets),
        "reproduce": {b.split(" ", 1)[0]: "# --- stage: " + b.strip() for b in sections},
    }


# ---- comparability ------------------------------------------------------------------------------
def comparability(dual: dict, control: dict, disk_dataset: str | None, disk_model: str | None) -> dict:
    """What must be equal for the comparison to mean anything, each check with both values.
    problems: why it is not comparable, each naming its fix; warnings: worth a look."""
    run, dcfg, ccfg = dual["run"], dual["config"], control["config"]
    ds, dsha, msha = dual["dataset"], dual["dataset_sha256"], str(dual["model_sha256"])
    keys = (set(CONFIG_DEFAULTS) - RESUMABLE - LADDER_KEYS - {"seed"}) & (set(dcfg) | set(ccfg))
    differ = sorted(k for k in keys if dcfg.get(k) != ccfg.get(k))
    named = (("dataset_sha256", "DATASET", "dataset"), ("model_sha256", "MODEL", "model"),
             ("seed", "SEED", "seed"))
    checks = [(k, dual[k], control[k], f"re-run the control with the dual run's {k.split('_')[0]}: "
               f"`make control RUN={run} {var}={dual[src]}`") for k, var, src in named]
    checks += [("global_batch", dual["global_batch"], control["global_batch"], "batch_size is the global "
                f"batch: train both with the same CONFIG (the dual run's batch_size {dual['batch_size']})"),
               ("config", {k: dcfg.get(k) for k in differ}, {k: ccfg.get(k) for k in differ}, None)]
    out = {"checks": [], "problems": [], "warnings": []}
    for name, a, b, fix in checks:
        ok = a == b and (fix is None or a not in UNKNOWN)
        out["checks"].append({"name": name, "dual": a, "control": b, "ok": ok})
        if not ok:
            out["problems"].append(f"{name} differs: dual {a!r}, control {b!r}: {fix}" if fix else
                                   f"the runs' configs differ in {', '.join(differ)}: train the control with "
                                   f"the dual run's config (`make control RUN={run} CONFIG=<its CONFIG>`)")
    if disk_dataset is None:
        out["problems"].append(f"datasets/{ds}/ has no {', '.join(SPLITS)} to evaluate on: "
                               f"`make export DATASET={ds}` or `make sync` it back")
    elif dsha not in UNKNOWN and disk_dataset != dsha:
        out["problems"].append(f"datasets/{ds}/ on disk ({disk_dataset[:12]}) is not the data the runs "
                               f"trained on ({dsha[:12]}): restore that export or re-run train and control")
    if disk_model and not msha.startswith("hub:") and disk_model != msha:
        out["problems"].append(f"the model {dual['model']} on disk ({disk_model[:12]}) is not the one the "
                               f"runs trained ({msha[:12]}): restore it, or re-run train and control")
    if dual["git"].get("commit") != control["git"].get("commit"):
        out["warnings"].append("the runs ran different code commits")
    for r in (dual, control):
        fb = r.get("fallback") or {}
        out["warnings"] += [text for cond, text in (
            (r["git"].get("dirty"), f"{r['run']} ran from a dirty tree: its reproduction is not exact"),
            (fb, f"{r['run']} lost {fb.get('lost')} and finished on {fb.get('hosts')} (FALLBACK=1): "
             "not the dual-host result"),
            (r.get("attempts"), f"{r['run']} restarted {r.get('attempts')} time(s) (RESTARTS)")) if cond]
    out["ok"] = not out["problems"]
    return out


# ---- the verdict --------------------------------------------------------------------------------
def decide(dual: dict, control: dict, losses: dict, problems: list[str], tolerance: float,
           min_speedup: float = DEFAULT_MIN_SPEEDUP, min_gain: float = DEFAULT_MIN_GAIN,
           calibration: dict | None = None) -> dict:
    """The verdict from facts: dual/control carry ok, category, why, tok_per_s, world_size, run; losses
    the test loss of "base", "control", "dual" (None: not evaluated; no "base" key: no base check).
    The first that applies: the dual run's own failure (a NaN adapter: stability); `worse than the base
    model` (dual loss not below base x (1 - min_gain), whatever the control); `not comparable`;
    `underperforms control: Thunder path` (step-1 loss off the control's beyond float error under
    token-weighted gradients, loss above (1 + tolerance) x control's, speedup not above min_speedup;
    a slow run is called link-bound or not from `calibration`, see link_call)."""
    dt, ct = dual.get("tok_per_s"), control.get("tok_per_s")
    dl, cl, bl = (losses.get(k) for k in ("dual", "control", "base"))
    speedup = dt / ct if dt and ct else None
    world_ratio = (dual.get("world_size") or 1) / (control.get("world_size") or 1)
    v = dict(verdict=PASS, ok=True, category=None, anchor=None, reasons=[], exit_code=0, loss_ok=None,
             faster=None, beats_base=None, exact=None, link_bound=None, speedup=speedup,
             scaling_efficiency=speedup and speedup / world_ratio,
             relative_loss_diff=(dl - cl) / cl if finite(dl) is not None and (finite(cl) or 0) > 0 else None,
             base_gain=(bl - dl) / bl if finite(dl) is not None and (finite(bl) or 0) > 0 else None)

    def fail(verdict, category, reason, code=1, anchor=None):
        v.update(verdict=verdict, ok=False, category=category, anchor=anchor or anchor_of(category),
                 exit_code=code)
        v["reasons"].append(reason)
        return v

    if not dual.get("ok"):
        cat, why = dual.get("category"), dual.get("why") or "no reason recorded"
        if cat in {name for name, _, _ in FAILURES.values()}:  # DESIGN's five, out of memory, config, ...
            return fail(cat, cat, f"the dual run failed: {why}")
        return fail(DUAL_FAILED, None, f"the dual run failed without a category: {why}", 1, ANCHOR_MISSING)
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
                               f"{control.get('why') or 'no reason recorded'}): fix it and re-run "
                               "`make control`"]
    missing = [f"the {k} adapter's test loss is {losses.get(k)}" for k in ("dual", "control")
               if finite(losses.get(k)) is None]
    slow = [r["run"] for r in (dual, control) if not r.get("tok_per_s")]
    if not problems and missing:
        problems = [f"{' and '.join(missing)}: no adapters/adapters.safetensors or bad weights; "
                    "re-run its stage"]
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
        v["link_bound"], why = link_call(calibration)
        v["reasons"].append(f"the dual run was not faster: {dt:.1f} vs {ct:.1f} tok/s "
                            f"(speedup {speedup:.2f}x{need}); {why}")
    if v["reasons"]:
        return fail(THUNDER, THUNDER_CATEGORY, v["reasons"].pop())
    gain = "" if v["base_gain"] is None else f", {100 * v['base_gain']:.2f}% below the base model's {bl:.4f}"
    v["reasons"].append(f"dual test loss {dl:.4f} vs control {cl:.4f} ({100 * rel:+.2f}%, tolerance "
                        f"{100 * tolerance:g}%){gain}, speedup {speedup:.2f}x{need}")
    if rel < -tolerance:
        v["reasons"].append(f"note: the dual loss is better than the control's by more than the tolerance "
                            f"({100 * rel:+.2f}%): check both ran the same config")
    return v


def link_call(cal: dict | None) -> tuple[bool | None, str]:
    """Is a slow dual run the link's doing? From the newest calibration of these hosts and model
    (`make calibrate`): link-bound when the gradient all-reduce took LINK_BOUND_SHARE or more of a
    calibrated dual step; otherwise a host computed slower than it was calibrated at."""
    if not cal:
        return None, ("no calibration of these hosts and model tells a slow link from a slow Mac: "
                      "run `make calibrate`")
    share, e, f = cal["link_share"], cal["expected_speedup"], cal["file"]
    if share >= LINK_BOUND_SHARE:
        return True, (f"link-bound: calibrate ({f}) measured the gradient all-reduce at {100 * share:.0f}% "
                      f"of a dual step and predicted {e:.2f}x: the Thunder path is the bottleneck")
    return False, (f"not the link: calibrate ({f}) predicted {e:.2f}x with the all-reduce {100 * share:.0f}% "
                   "of a dual step, so a Mac computed slower than calibrated (or the link changed since): "
                   "`make calibrate` again")


def calibration_of(dual: dict) -> dict | None:
    """The newest runs/calibration-*.json measured on the dual run's hosts with its model, or None."""
    for path, cal in paths.calibrations():
        sp = cal.get("speedup") or {}
        hosts = [h.get("ssh") for h in (cal.get("hostfile") or {}).get("hosts", [])]
        if hosts == dual["hosts"] and cal.get("model") == dual["model"] and "link_share" in sp:
            return {"file": paths.rel(path), "expected_speedup": sp["expected_speedup"],
                    "link_share": sp["link_share"]}
    return None


def exactness(dual: dict, control: dict) -> dict | None:
    """With token-weighted gradients (grad_average: tokens) on both, the dual run computes what the
    control computes up to float summation order. Step 1 starts from the same weights on the same
    global batch, so its losses may differ only by float error (EXACT_REL): a larger gap is a
    correctness failure of the Thunder path, not a slow one. Later steps are reported, not judged:
    float error compounds through the optimizer. None when either run averages as mlx-lm does."""
    if not all((r.get("config") or {}).get("grad_average") == "tokens" for r in (dual, control)):
        return None
    d, c = (dict(curve(r.get("metrics") or [], "step")) for r in (dual, control))
    common = sorted(set(d) & set(c))
    if 1 not in common:
        return {"ok": False, "why": "no step-1 loss in both runs' metrics.jsonl to prove dual = control: "
                "re-run them"}
    rel = {k: abs(d[k] - c[k]) / max(abs(c[k]), 1e-12) for k in common}
    ok = rel[1] <= EXACT_REL
    why = (f"step-1 loss dual {d[1]:.9g} vs control {c[1]:.9g}: relative {rel[1]:.2e} "
           f"{'within' if ok else 'over'} float error {EXACT_REL:g} with token-weighted gradients"
           + ("" if ok else ": the dual run does not compute what the control computes (data order, masking, "
              "token counts or the all-reduce differ)"))
    return {"ok": ok, "why": why, "step1_rel": rel[1], "max_rel": max(rel.values()), "steps": len(common)}


# ---- evaluation (mlx-lm's pieces) and the curves ----------------------------------------------------
def model_path(model: str) -> str:
    """A local model folder (relative paths are the repo's), or a Hugging Face id as is."""
    full = Path(model) if Path(model).is_absolute() else paths.ROOT / model
    return str(full) if full.exists() else model


def evaluate_models(model: str, adapters: dict[str, str | None], data_dir: Path, cfg: dict,
                    test_batches: int) -> dict:
    """Test loss of the base model and each adapter (mlx_lm.utils.load with adapter_path: a fresh model
    each) over one tokenized test set, with the run's batch size, prompt masking and seeded batch order;
    a fingerprint of every batch (tokens, lengths) proves that all of them saw the same batches."""
    from functools import partial
    from types import SimpleNamespace

    import mlx.core as mx
    import numpy as np
    from mlx_lm.tuner.datasets import CacheDataset, create_dataset
    from mlx_lm.tuner.trainer import default_loss, evaluate, iterate_batches
    from mlx_lm.utils import load

    if not (records := list(jsonl.read(data_dir / "test.jsonl"))):
        raise RunbookError(f"{paths.rel(data_dir)}/test.jsonl is empty: re-export with a test split",
                           ANCHOR_NOT_COMPARABLE)
    max_seq, seed = int(cfg.get("max_seq_length") or CONFIG_DEFAULTS["max_seq_length"]), int(cfg["seed"])
    out = {"records": len(records), "batch_size": min(int(cfg["batch_size"]), len(records)),
           "max_seq_length": max_seq, "seed": seed, "test_batches": test_batches, "models": {}}
    test_set, tic = None, time.monotonic()
    for name, adapter in [("base", None), *((k, a) for k, a in adapters.items() if a)]:
        mdl, tokenizer = load(model_path(model), adapter_path=str(paths.ROOT / adapter) if adapter else None)
        if test_set is None:
            feats = SimpleNamespace(**{k: cfg.get(k, CONFIG_DEFAULTS[k]) for k in FEATURES})
            test_set = CacheDataset(create_dataset(records, tokenizer, feats))
            out["load_s"] = round(time.monotonic() - tic, 3)
        h, ntoks, tic = hashlib.sha256(), [], time.monotonic()

        def loss(m, batch, lengths, h=h, ntoks=ntoks):
            h.update(np.array(batch).tobytes() + np.array(lengths).tobytes())
            ntoks.append((ce_n := default_loss(m, batch, lengths))[1])
            return ce_n

        value = evaluate(model=mdl, dataset=test_set, batch_size=out["batch_size"], num_batches=test_batches,
                         max_seq_length=max_seq, loss=loss,
                         iterate_batches=partial(iterate_batches, seed=seed))
        row = out["models"][name] = {"loss": value, "batches": len(ntoks), "batches_sha256": h.hexdigest(),
                                     "tokens": int(sum(n.item() for n in ntoks)),
                                     "wall_s": round(time.monotonic() - tic, 3)}
        event("compare-eval", model=name, test_loss=value, ppl=ppl_of(value) or math.nan,
              batches=row["batches"], tokens=row["tokens"], wall_s=row["wall_s"])
    if len({m["batches_sha256"] for m in out["models"].values()}) != 1:
        raise RunbookError("the three models did not see the same test batches: a bug in compare; report it",
                           ANCHOR_NOT_COMPARABLE)
    base = out["models"]["base"]
    return {**out, "batches": base["batches"], "tokens": base["tokens"], "same_batches": True,
            "peak_mem_gb": round(mx.get_peak_memory() / 1e9, 3)}


def plot_curves(path: Path, dual: dict, control: dict, losses: dict, verdict: str) -> None:
    """Train (solid) and validation (dashed) loss of both runs, each adapter's test loss a star, the base
    model's a dotted line. The control is drawn wide and pale under the dual run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6))
    for r, style in ((control, dict(color="tab:orange", lw=4, alpha=0.55)), (dual, dict(color="tab:blue"))):
        name, mets = f"{r['role']} {r['run']} (world {r['world_size']})", r["metrics"]
        for pts, extra in ((curve(mets, "step"), {"label": f"{name}: train"}),
                           (curve(mets, "val"), {"ls": "--", "marker": "o", "label": f"{name}: validation"})):
            if pts:
                ax.plot(*zip(*pts, strict=True), **style, **extra)
        if finite(test := losses.get(r["role"])) is not None and r["final_step"] is not None:
            ax.plot([r["final_step"]], [test], color=style["color"], marker="*", ms=14, ls="none",
                    label=f"{r['role']} adapter test loss {test:.4f}")
    if finite(base := losses.get("base")) is not None:
        ax.axhline(base, color="gray", ls=":", lw=1.5, label=f"base model test loss {base:.4f}")
    ax.set(xlabel="step (the same global batch in both runs)", ylabel="loss (cross-entropy per token)",
           title=f"{dual['run']} (dual) vs {control['run']} (control): {verdict}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


# ---- the report -----------------------------------------------------------------------------------
def compare_make_cmd(args) -> list[str]:
    flags = (("TOLERANCE", args.tolerance, DEFAULT_TOLERANCE),
             ("MIN_SPEEDUP", args.min_speedup, DEFAULT_MIN_SPEEDUP),
             ("MIN_GAIN", args.min_gain, DEFAULT_MIN_GAIN), ("TEST_BATCHES", args.test_batches, -1))
    return ["make", "compare", f"RUN={args.run}"] + [f"{k}={x:g}" for k, x, default in flags if x != default]


def build_report(args, dual: dict, control: dict, comp: dict, ev: dict | None, v: dict) -> dict:
    """report.json: the verdict, base / control / dual losses, speed, comparability and both runs' facts."""
    models = (ev or {}).get("models", {})
    rows = {name: {**models.get(name, {}), "evaluated": name in models, "adapter": r and r["adapter"],
                   "loss": finite(models.get(name, {}).get("loss")),
                   "ppl": ppl_of(models.get(name, {}).get("loss"))}
            for name, r in (("base", None), ("control", control), ("dual", dual))}
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "run": dual["run"], "control_run": control["run"],
        **{k: v[k] for k in ("verdict", "ok", "category", "anchor", "reasons", "exit_code")},
        "tolerance": args.tolerance, "min_speedup": args.min_speedup, "min_gain": args.min_gain,
        "loss": {**{k: rows[k]["loss"] for k in rows}, "relative_diff": finite(v["relative_loss_diff"]),
                 "within_tolerance": v["loss_ok"], "base_gain": finite(v["base_gain"]),
                 "beats_base": v["beats_base"], "exact": v["exact"]},
        "throughput": {"dual_tok_per_s": dual["tok_per_s"], "control_tok_per_s": control["tok_per_s"],
                       "speedup": finite(v["speedup"]), "scaling_efficiency": finite(v["scaling_efficiency"]),
                       "world_size_ratio": (dual["world_size"] or 1) / (control["world_size"] or 1),
                       "faster": v["faster"], "link_bound": v["link_bound"]},
        "comparable": comp,
        "export": {"lines": launch.export_section(dual["dataset"]) if dual["dataset"] else []},
        "evaluation": ev and {**{k: x for k, x in ev.items() if k != "models"}, "models": rows,
                              "split": f"datasets/{dual['dataset']}/test.jsonl"},
        "runs": {r["role"]: {k: x for k, x in r.items() if k not in ("metrics", "config")}
                 for r in (dual, control)},
        "reproduce_compare": shlex.join(compare_make_cmd(args)),
    }


def fmt(x, spec: str = ".4f") -> str:
    return "–" if x is None else format(x, spec) if spec and isinstance(x, (int, float)) else str(x)


def render_md(rep: dict) -> str:
    """The promotion report: verdict, how to reproduce it (data first), base / control / dual, the runs."""
    runs, tp, ev, base = rep["runs"], rep["throughput"], rep["evaluation"], rep["loss"]["base"]
    cat = f"category: {rep['category']}; " if rep["category"] else ""
    see = f" ({cat}see RUNBOOK.md#{rep['anchor']})" if rep["anchor"] else ""
    stages = dict.fromkeys(text for r in runs.values() for st, text in r["reproduce"].items()
                           if st not in ("export", "compare"))
    L = [f"# Promotion report: `{rep['run']}` vs control `{rep['control_run']}`", "",
         f"**Verdict: {rep['verdict']}**{see}", "", *[f"- {r}" for r in rep["reasons"]],
         *[f"- warning: {w}" for w in rep["comparable"]["warnings"]], "", "## Reproduce", "",
         "From the repo root on Mac1: the export that made the dataset, then each stage.", "",
         "```bash", *rep["export"]["lines"], *stages, rep["reproduce_compare"], "```", "", "## Metrics", "",
         f"`{ev['split']}`: {ev['records']} records, {ev['batches']} batches of {ev['batch_size']}, "
         f"{ev['tokens']} target tokens, seed {ev['seed']}, the same batches for all three models."
         if ev else "Not evaluated (see the verdict).", "",
         "| model | test loss | test ppl | vs base | train tok/s | adapter |", "|---|---|---|---|---|---|"]
    for name in ("base", "control", "dual"):
        m = (ev or {}).get("models", {}).get(name, {})
        gain = 100 * (m["loss"] - base) / base if m.get("loss") is not None and base else None
        L.append(f"| {name} | {fmt(m.get('loss'))} | {fmt(m.get('ppl'), '.2f')} | {fmt(gain, '+.2f')}% | "
                 f"{fmt(runs.get(name, {}).get('tok_per_s'), '.1f')} | {fmt(m.get('adapter'), '')} |")
    L += ["", f"Speedup (steady-state tok/s): **{fmt(tp['speedup'], '.2f')}x** (required > "
          f"{rep['min_speedup']:g}x); scaling efficiency (speedup / {tp['world_size_ratio']:g}): "
          f"**{fmt(tp['scaling_efficiency'], '.2f')}**.", "", "## Runs", "",
          "| | dual | control |", "|---|---|---|"]
    for key in ("run", "ok", "world_size", "hosts", "hostfile_path", "git", "lock_sha256", "dataset",
                "dataset_sha256", "model", "model_sha256", "final_step", "stage_wall_s",
                "checkpoints_written", "best_adapter", "attempts", "fallback"):
        cells = [f"{r['git'].get('commit')}{' (dirty)' if r['git'].get('dirty') else ''}" if key == "git"
                 else fmt(r[key], "") for r in (runs["dual"], runs["control"])]
        L.append(f"| {key} | {cells[0]} | {cells[1]} |")
    return "\n".join(L + ["", "![train and validation loss of both runs](loss_curves.png)", ""])


# ---- main ------------------------------------------------------------------------------------------------
def main() -> int:
    args, t0 = build_parser().parse_args(), time.monotonic()
    try:
        check_args(args)
        dual = run_facts("dual", args.run, "train.json")
        control = run_facts("control", dual["control_run"] or f"{args.run}-control", "control.json")
    except (RunbookError, ValueError) as e:
        return die(e, 2)
    # What is on disk now must be what the runs trained on (export's rule for dataset_sha256).
    data = paths.DATASETS / str(dual["dataset"])
    disk_dataset = digest_of(tree_hashes(data, SPLITS)) if all((data / s).is_file() for s in SPLITS) else None
    disk_model = launch.model_hash(dual["model"]) if Path(model_path(dual["model"] or "")).is_dir() else None
    comp = comparability(dual, control, disk_dataset, disk_model)
    for ch in comp["checks"]:
        event("compare-check", key=ch["name"], status="same" if ch["ok"] else "DIFFERS",
              dual=json.dumps(ch["dual"]), control=json.dumps(ch["control"]))
    ev = None
    if comp["ok"]:
        try:
            ev = evaluate_models(dual["model"], {"control": control["adapter"], "dual": dual["adapter"]},
                                 paths.DATASETS / dual["dataset"], dual["config"], args.test_batches)
        except RunbookError as e:
            return die(e, 2)
    losses = {k: m["loss"] for k, m in (ev or {}).get("models", {}).items()}
    v = decide(dual, control, losses, comp["problems"], args.tolerance, args.min_speedup, args.min_gain,
               calibration_of(dual))
    rep = {**build_report(args, dual, control, comp, ev, v), "wall_s": round(time.monotonic() - t0, 3)}
    run_dir = paths.RUNS / args.run
    with atomic.atomic_dir(run_dir / "compare") as tmp:
        atomic.write_json(tmp / "report.json", rep)
        atomic.write_text(tmp / "report.md", render_md(rep))
        plot_curves(tmp / "loss_curves.png", dual, control, losses, v["verdict"])
    argv = [sys.executable, "bin/compare.py", *sys.argv[1:]]
    launch.write_reproduce(run_dir, "compare", compare_make_cmd(args), [argv])
    launch.finish_manifest(run_dir, "compare", v)
    lo = rep["loss"]
    event("compare", run=args.run, control=control["run"], verdict=json.dumps(v["verdict"]),
          **{f"{k}_loss": math.nan if lo[k] is None else lo[k] for k in ("base", "control", "dual")},
          rel_loss_pct=math.nan if lo["relative_diff"] is None else 100 * lo["relative_diff"],
          speedup=v["speedup"] or math.nan, efficiency=v["scaling_efficiency"] or math.nan,
          report=f"runs/{args.run}/compare/report.md")
    for w in comp["warnings"]:
        print(f"warning: {w}", flush=True)
    if v["ok"]:
        return 0
    if v["category"]:
        launch.print_category(v["category"], "; ".join(v["reasons"]))
        return v["exit_code"]
    return die(RunbookError(f"{v['verdict']}: {'; '.join(v['reasons'])}", v["anchor"]), v["exit_code"])


if __name__ == "__main__":
    sys.exit(main())
