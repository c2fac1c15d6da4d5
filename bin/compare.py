#!/usr/bin/env python3
"""compare: the dual-host run against its single-host control, and the promotion report.

Usage:
    python bin/compare.py --run RUN [--control-run RUN-control] [--tolerance 0.02]
                          [--min-speedup 1.0] [--test-batches N] [--batch-size N]

Example (what `make compare RUN=stage1 TOLERANCE=0.02` runs):
    .venv/bin/python bin/compare.py --run stage1 --tolerance 0.02

Reads runs/<RUN>/ (the dual run) and runs/<RUN>-control/ (its control): manifest.json,
train.json / control.json, metrics.jsonl, adapters/, checkpoints/, reproduce.sh. Checks
that both trained on the same dataset bytes, model, seed and global batch (else: not
comparable, nothing evaluated). Then evaluates the base model, the control adapter and the
dual adapter on the test split with mlx-lm's own pieces (mlx_lm.utils.load, create_dataset +
CacheDataset, trainer.evaluate / iterate_batches / default_loss) over the SAME batches: same
batch size, same seeded order, and a fingerprint of every batch proves it. Writes, as one
atomic folder, runs/<RUN>/compare/:
    report.md        the promotion report: run ids, dataset and its sha256, model and hash,
                     code commit, hostfile, metrics table, verdict, reproduction commands
    report.json      the same, machine-readable (format thunder-runbook/compare-report v1)
    loss_curves.png  train and validation loss of both runs on one axis, tok/s below

Verdict: `pass` when the dual test loss is at most (1 + tolerance) x the control's and the
dual run is faster (steady-state tok/s: speedup > --min-speedup, default 1.0; ranks sharing
one machine, as on hostfile.local.json, cannot be faster: the demo passes 0 and the report
still shows the speedup); else `underperforms control: Thunder path`; or,
when the dual run itself failed (train.json), that run's failure category.
Exit codes: 0 pass; 1 any other verdict (the category and `see RUNBOOK.md#anchor` on
stderr); 2 not comparable or an input missing (the fix on stderr, report still written
when the run folders exist).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, jsonl, launch, paths  # noqa: E402
from lib.config import DEFAULTS as CONFIG_DEFAULTS  # noqa: E402
from lib.config import RESUMABLE, ConfigError, load_config  # noqa: E402
from lib.hashing import digest_of, tree_hashes  # noqa: E402
from lib.log import CATEGORIES, RunbookError, die, event  # noqa: E402

FORMAT = "thunder-runbook/compare-report"
FORMAT_VERSION = 1
DEFAULT_TOLERANCE = 0.02
DEFAULT_MIN_SPEEDUP = 1.0
PASS = "pass"
THUNDER = "underperforms control: Thunder path"
THUNDER_CATEGORY = "the Thunder path itself"
NOT_COMPARABLE = "not comparable"
DUAL_FAILED = "dual run failed"
STABILITY = "learning rate or quantized LoRA stability"
ANCHOR_NOT_COMPARABLE = "compare-not-comparable"
ANCHOR_MISSING = "compare-missing-run"
SPLITS = ("train.jsonl", "valid.jsonl", "test.jsonl")
# Keys the out-of-memory fallback ladder may change while keeping the global batch
# (lib/config.py fallback_ladder): they may differ between the runs.
LADDER_KEYS = {"batch_size", "grad_accumulation_steps", "steps_per_eval", "save_every", "steps_per_report", "iters"}
CKPT_RE = re.compile(r"^step-(\d{7,})$")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="the dual run id: runs/<RUN>/")
    p.add_argument("--control-run", default=None,
                   help="the control run id (default: the dual manifest's control_run, else <RUN>-control)")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help="relative test-loss tolerance of dual over control (default 0.02 = 2%%)")
    p.add_argument("--min-speedup", type=float, default=DEFAULT_MIN_SPEEDUP,
                   help="the dual run must be faster than this x the control (default 1.0: faster at all; "
                        "0 accepts any speed, for ranks that share one machine)")
    p.add_argument("--test-batches", type=int, default=-1,
                   help="test batches to evaluate (-1, the default: the whole test split)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="evaluation batch (default: the runs' global batch_size, at most the test records)")
    return p


# ---- reading a run folder ----------------------------------------------------------------------
def read_json(path: Path, fix: str, anchor: str = ANCHOR_MISSING) -> dict:
    if not path.is_file():
        raise RunbookError(f"{paths.rel(path)} not found: {fix}", anchor)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RunbookError(f"{paths.rel(path)} is not readable JSON ({e}): {fix}", anchor) from e
    if not isinstance(data, dict):
        raise RunbookError(f"{paths.rel(path)} is not a JSON object: {fix}", anchor)
    return data


def run_config(run_dir: Path, manifest: dict) -> tuple[dict, str]:
    """The run's resolved config and where it came from: the adapter_config.json the trainer
    writes first (mlx-lm's lora args), else the newest checkpoint's state, else the CONFIG
    file the manifest names with its SEED (a weaker source: the file may have changed)."""
    ac = run_dir / "adapters" / "adapter_config.json"
    if ac.is_file():
        cfg = json.loads(ac.read_text(encoding="utf-8"))
        if "seed" in cfg and "batch_size" in cfg:
            return cfg, paths.rel(ac)
    ckroot = run_dir / "checkpoints"
    if ckroot.is_dir():
        for p in sorted((p for p in ckroot.iterdir() if CKPT_RE.match(p.name)), reverse=True):
            state = p / "state.json"
            if state.is_file():
                cfg = json.loads(state.read_text(encoding="utf-8")).get("config")
                if isinstance(cfg, dict):
                    return cfg, paths.rel(state)
    var = manifest.get("variables", {})
    if var.get("CONFIG"):
        cfg = load_config(paths.ROOT / var["CONFIG"])
        if var.get("SEED"):
            cfg["seed"] = int(var["SEED"])
        return cfg, f"{var['CONFIG']} (no resolved config in the run folder)"
    raise RunbookError(f"{paths.rel(run_dir)}: no adapters/adapter_config.json, no checkpoint state and no CONFIG "
                       "in manifest.json: the run folder is incomplete; re-run its stage", ANCHOR_MISSING)


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    try:
        return [m for m in jsonl.read(path) if isinstance(m, dict)]
    except ValueError as e:
        raise RunbookError(f"{e}: the metrics file is damaged; re-run the stage", ANCHOR_MISSING) from e


def reproduce_commands(run_dir: Path) -> dict[str, dict]:
    """{stage: {"make": line, "ran": [lines]}} from reproduce.sh (lib/launch.write_reproduce)."""
    path = run_dir / "reproduce.sh"
    out: dict[str, dict] = {}
    if not path.is_file():
        return out
    for block in path.read_text(encoding="utf-8").split("\n# --- stage: ")[1:]:
        lines = block.splitlines()
        stage = lines[0].split(" ", 1)[0].strip()
        make_line, ran, under = None, [], False
        for line in lines[1:]:
            if line.startswith("# What it ran underneath"):
                under = True
            elif under and line.startswith("# "):
                ran.append(line[2:])
            elif not line.startswith("#") and line.strip() and make_line is None:
                make_line = line.strip()
        out[stage] = {"make": make_line, "ran": ran}
    return out


def finite(x) -> float | None:
    """A JSON-safe number: None for missing, NaN and inf."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


def ppl_of(loss: float | None) -> float | None:
    if loss is None or not math.isfinite(loss):
        return None
    return math.exp(loss) if loss < 700 else None


def throughput(mets: list[dict]) -> dict:
    """Steady-state tok/s: global tokens over step time of every `step` event except the first
    of each launch (its compile). A launch starts where wall_s goes back (a resume). Falls back
    to `train` events (tokens / train_s), then to the median of their tok_per_s."""
    steps = [m for m in mets if m.get("kind") == "step" and finite(m.get("tokens")) and finite(m.get("step_s"))]
    tokens = seconds = 0.0
    first_skipped, last_wall, n = 0, None, 0
    for m in steps:
        wall = finite(m.get("wall_s"))
        if last_wall is None or (wall is not None and wall < last_wall):
            first_skipped += 1
            last_wall = wall
            continue
        last_wall = wall if wall is not None else last_wall
        tokens += m["tokens"]
        seconds += m["step_s"]
        n += 1
    if n and seconds > 0:
        return {"tok_per_s": tokens / seconds, "method": f"step events: {int(tokens)} tokens / {seconds:.3f} s "
                f"over {n} steps (first step of {first_skipped} launch(es) left out: compile)"}
    trains = [m for m in mets if m.get("kind") == "train"]
    t_tok = sum(m["tokens"] for m in trains if finite(m.get("tokens")) and finite(m.get("train_s")))
    t_s = sum(m["train_s"] for m in trains if finite(m.get("tokens")) and finite(m.get("train_s")))
    if t_s > 0:
        return {"tok_per_s": t_tok / t_s, "method": f"train events: {int(t_tok)} tokens / {t_s:.3f} s"}
    rates = [m["tok_per_s"] for m in trains if finite(m.get("tok_per_s"))]
    if rates:
        return {"tok_per_s": statistics.median(rates), "method": f"median tok_per_s of {len(rates)} train events"}
    return {"tok_per_s": None, "method": "no step or train events with tokens in metrics.jsonl"}


def curve(mets: list[dict], kind: str) -> list[tuple[int, float]]:
    """(step, loss) of one kind, by step, the last event of a step winning; non-finite dropped."""
    by_step = {}
    for m in mets:
        if m.get("kind") == kind and isinstance(m.get("step"), int) and finite(m.get("loss")) is not None:
            by_step[m["step"]] = float(m["loss"])
    return sorted(by_step.items())


def run_facts(role: str, run_id: str, summary_name: str) -> dict:
    """Everything compare needs from one run folder (raises RunbookError naming the fix)."""
    run_dir = paths.RUNS / paths.check_run_id(run_id)
    fix = (f"run `make train RUN={run_id}` first" if role == "dual"
           else f"run `make control RUN={run_id.removesuffix('-control')}` first")
    if not run_dir.is_dir():
        raise RunbookError(f"run folder {paths.rel(run_dir)} not found: {fix}", ANCHOR_MISSING)
    manifest = read_json(run_dir / "manifest.json", fix)
    summary = read_json(run_dir / summary_name, fix)
    try:
        cfg, cfg_source = run_config(run_dir, manifest)
    except ConfigError as e:
        raise RunbookError(f"{paths.rel(run_dir)}: cannot read its config: {e.args[0]}", ANCHOR_MISSING) from e
    mets = read_metrics(run_dir)
    adapter = summary.get("adapter")
    adapter_dir = paths.ROOT / adapter if adapter else run_dir / "adapters"
    has_adapter = (adapter_dir / "adapters.safetensors").is_file() and (adapter_dir / "adapter_config.json").is_file()
    ck_dir = run_dir / "checkpoints"
    kept = sorted(p.name for p in ck_dir.iterdir() if CKPT_RE.match(p.name)) if ck_dir.is_dir() else []
    trains = [m for m in mets if m.get("kind") == "train"]
    done = [m for m in mets if m.get("kind") == "done"]
    peak = [m["peak_mem_gb"] for m in mets if finite(m.get("peak_mem_gb")) is not None]
    tests = [m for m in mets if m.get("kind") == "test"]
    tp = throughput(mets)
    hostfile = manifest.get("hostfile") or {}
    hosts = [h.get("ssh") for h in hostfile.get("hosts", [])] if isinstance(hostfile, dict) else []
    world = summary.get("world_size") or manifest.get("world_size") or len(hosts) or None
    accum = int(cfg.get("grad_accumulation_steps") or 1)
    return {
        "role": role,
        "run": run_id,
        "dir": paths.rel(run_dir),
        "stage": summary_name.removesuffix(".json"),
        "ok": bool(summary.get("ok")),
        "category": summary.get("category"),
        "why": summary.get("why") or "",
        "world_size": int(world) if world else None,
        "hosts": hosts,
        "hostfile_path": manifest.get("hostfile_path"),
        "hostfile": hostfile,
        "git": manifest.get("git") or {},
        "lock_sha256": manifest.get("lock_sha256"),
        "dataset": manifest.get("dataset"),
        "dataset_sha256": manifest.get("dataset_sha256"),
        "model": manifest.get("model"),
        "model_sha256": manifest.get("model_sha256"),
        "control_of": manifest.get("control_of"),
        "config": cfg,
        "config_source": cfg_source,
        "seed": cfg.get("seed"),
        "batch_size": cfg.get("batch_size"),
        "grad_accumulation_steps": accum,
        "global_batch": int(cfg["batch_size"]) * accum if cfg.get("batch_size") else None,
        "adapter": paths.rel(adapter_dir) if has_adapter else None,
        "metrics": mets,
        "tok_per_s": finite(tp["tok_per_s"]),
        "tok_per_s_method": tp["method"],
        "final_step": summary.get("final_step") if summary.get("final_step") is not None
        else (trains[-1]["step"] if trains else None),
        "trained_tokens": trains[-1].get("trained_tokens") if trains else None,
        "peak_mem_gb": max(peak) if peak else None,
        "stage_wall_s": finite(summary.get("wall_s")),
        "total_wall_s": finite(summary.get("total_wall_s")),
        "train_wall_s": finite(done[-1].get("train_wall_s")) if done else None,
        "checkpoints_written": sum(1 for m in mets if m.get("kind") == "checkpoint"),
        "checkpoints_kept": kept,
        "trainer_test_loss": finite(summary.get("test_loss")) if summary.get("test_loss") is not None
        else (finite(tests[-1].get("loss")) if tests else None),
        "reproduce": reproduce_commands(run_dir),
    }


# ---- comparability --------------------------------------------------------------------------------
def disk_dataset_sha256(dataset: str | None) -> str | None:
    """dataset_sha256 of the split files on disk now (export's rule: digest_of their sha256)."""
    if not dataset:
        return None
    d = paths.DATASETS / dataset
    if not all((d / s).is_file() for s in SPLITS):
        return None
    return digest_of(tree_hashes(d, list(SPLITS)))


def comparability(dual: dict, control: dict, disk_dataset: str | None, disk_model: str | None) -> dict:
    """What must be equal for the comparison to mean anything, each check with both values.
    problems: the reasons it is not comparable, each naming its fix; warnings: worth a look."""
    checks, problems, warnings = [], [], []
    run = dual["run"]

    def check(name, a, b, fix):
        ok = a is not None and a == b and a not in ("missing", "unknown")
        checks.append({"name": name, "dual": a, "control": b, "ok": ok})
        if not ok:
            problems.append(f"{name} differs: dual {a!r}, control {b!r}: {fix}")

    ds_fix = (f"re-run the control on the dual run's dataset: `make control RUN={run} DATASET={dual['dataset']}`")
    check("dataset_sha256", dual["dataset_sha256"], control["dataset_sha256"], ds_fix)
    check("model_sha256", dual["model_sha256"], control["model_sha256"],
          f"re-run the control with the dual run's model: `make control RUN={run} MODEL={dual['model']}`")
    check("seed", dual["seed"], control["seed"],
          f"re-run the control with the dual run's seed: `make control RUN={run} SEED={dual['seed']}`")
    check("global_batch", dual["global_batch"], control["global_batch"],
          f"batch_size is the global batch: train both with the same CONFIG (`make control RUN={run} "
          f"CONFIG=...` with the dual run's batch_size {dual['batch_size']})")
    dcfg, ccfg = dual["config"], control["config"]
    keys = (set(CONFIG_DEFAULTS) - RESUMABLE - LADDER_KEYS - {"seed"}) & (set(dcfg) | set(ccfg))
    differ = sorted(k for k in keys if dcfg.get(k) != ccfg.get(k))
    checks.append({"name": "config", "dual": {k: dcfg.get(k) for k in differ},
                   "control": {k: ccfg.get(k) for k in differ}, "ok": not differ})
    if differ:
        problems.append(f"the runs' configs differ in {', '.join(differ)}: train the control with the dual run's "
                        f"config (`make control RUN={run} CONFIG=<the dual run's CONFIG>`)")
    if disk_dataset is None:
        problems.append(f"datasets/{dual['dataset']}/ has no {', '.join(SPLITS)} to evaluate on: "
                        f"`make export DATASET={dual['dataset']}` or `make sync` it back")
    elif dual["dataset_sha256"] not in (None, "missing", "unknown") and disk_dataset != dual["dataset_sha256"]:
        problems.append(f"datasets/{dual['dataset']}/ on disk (sha256 {disk_dataset[:12]}) is not the data the runs "
                        f"trained on ({str(dual['dataset_sha256'])[:12]}): restore that export or re-run train and "
                        "control on the current one")
    if disk_model is not None and dual["model_sha256"] and not str(dual["model_sha256"]).startswith("hub:") \
            and disk_model != dual["model_sha256"]:
        problems.append(f"the model {dual['model']} on disk (sha256 {disk_model[:12]}) is not the one the runs "
                        f"trained ({str(dual['model_sha256'])[:12]}): restore it, or re-run train and control")
    if control["control_of"] not in (None, run):
        warnings.append(f"{control['run']} is the control of {control['control_of']!r}, not of {run!r}")
    if (control["world_size"] or 1) != 1:
        warnings.append(f"the control ran with world size {control['world_size']}, not 1")
    for role in (dual, control):
        if "no resolved config" in role["config_source"]:
            warnings.append(f"{role['run']}: seed and batch read from {role['config_source']}")
    if dual["git"].get("commit") != control["git"].get("commit"):
        warnings.append(f"different code: dual at {str(dual['git'].get('commit'))[:12]}, control at "
                        f"{str(control['git'].get('commit'))[:12]}")
    for role in (dual, control):
        if role["git"].get("dirty"):
            warnings.append(f"{role['run']} ran from a dirty tree (uncommitted changes at "
                            f"{str(role['git'].get('commit'))[:12]}): its reproduction is not exact")
    same = same_data_order(dual["metrics"], control["metrics"])
    if same is not None and not same[0]:
        warnings.append(f"the runs did not see the same tokens per step ({same[1]}): not the same data order")
    return {"ok": not problems, "checks": checks, "problems": problems, "warnings": warnings}


def same_data_order(a: list[dict], b: list[dict]) -> tuple[bool, str] | None:
    """Same global batch, seed and data: every step has the same global token count."""
    ta = {m["step"]: m["tokens"] for m in a if m.get("kind") == "step" and isinstance(m.get("tokens"), int)}
    tb = {m["step"]: m["tokens"] for m in b if m.get("kind") == "step" and isinstance(m.get("tokens"), int)}
    common = sorted(set(ta) & set(tb))
    if not common:
        return None
    bad = [s for s in common if ta[s] != tb[s]]
    if bad:
        s = bad[0]
        return False, f"{len(bad)} of {len(common)} steps differ, first at step {s}: {ta[s]} vs {tb[s]} tokens"
    return True, f"{len(common)} steps with identical token counts"


# ---- the verdict --------------------------------------------------------------------------------
def decide(dual: dict, control: dict, losses: dict, problems: list[str], tolerance: float,
           min_speedup: float = DEFAULT_MIN_SPEEDUP) -> dict:
    """The verdict from facts only (no files): dual/control carry ok, category, why,
    tok_per_s, world_size; losses carry the test loss of "dual" and "control" (None when not
    evaluated, NaN when not finite). Order: the dual run's own failure, then comparability,
    then loss, then speed."""
    v = {"verdict": PASS, "ok": True, "category": None, "anchor": None, "reasons": [], "exit_code": 0,
         "loss_ok": None, "faster": None, "relative_loss_diff": None, "speedup": None, "scaling_efficiency": None}
    dt, ct = dual.get("tok_per_s"), control.get("tok_per_s")
    if dt and ct:
        v["speedup"] = dt / ct
        ratio = (dual.get("world_size") or 1) / (control.get("world_size") or 1)
        v["scaling_efficiency"] = v["speedup"] / ratio if ratio else None
    dl, cl = losses.get("dual"), losses.get("control")
    if dl is not None and cl is not None and math.isfinite(dl) and math.isfinite(cl) and cl > 0:
        v["relative_loss_diff"] = (dl - cl) / cl

    def fail(verdict, category, anchor, reason, code=1):
        v.update(verdict=verdict, ok=False, category=category, anchor=anchor, exit_code=code)
        v["reasons"].append(reason)
        return v

    if not dual.get("ok"):
        cat = dual.get("category")
        why = dual.get("why") or "no reason recorded"
        if cat in CATEGORIES:
            return fail(cat, cat, CATEGORIES[cat], f"the dual run failed: {why}")
        return fail(DUAL_FAILED, None, ANCHOR_MISSING, f"the dual run failed without a category: {why}")
    if not control.get("ok"):
        problems = problems + [f"the control run failed ({control.get('category') or 'no category'}: "
                               f"{control.get('why') or 'no reason recorded'}): fix it and re-run `make control`"]
    if dl is not None and not math.isfinite(dl):
        return fail(STABILITY, STABILITY, CATEGORIES[STABILITY],
                    f"the dual adapter's test loss is {dl}: the adapter weights are not finite")
    missing = [k for k in ("dual", "control") if losses.get(k) is None]
    if not problems and missing:
        problems = problems + [f"no test loss for the {' and '.join(missing)} adapter: its run folder has no "
                               "adapters/adapters.safetensors; re-run its stage"]
    if not problems and cl is not None and not math.isfinite(cl):
        problems = problems + [f"the control adapter's test loss is {cl}: re-run `make control`"]
    if not problems and (not dt or not ct):
        problems = problems + ["no throughput in metrics.jsonl of "
                               + " and ".join(r["run"] for r in (dual, control) if not r.get("tok_per_s"))
                               + ": re-run that stage with this trainer"]
    if problems:
        v.update(verdict=NOT_COMPARABLE, ok=False, anchor=ANCHOR_NOT_COMPARABLE, exit_code=2)
        v["reasons"] += problems
        return v
    rel = v["relative_loss_diff"]
    v["loss_ok"] = rel <= tolerance + 1e-12  # at the tolerance exactly is within it (float rounding)
    v["faster"] = v["speedup"] > min_speedup
    if not v["loss_ok"]:
        v["reasons"].append(f"the dual test loss {dl:.4f} is {100 * rel:+.2f}% against the control's {cl:.4f} "
                            f"(tolerance {100 * tolerance:g}%)")
    if not v["faster"]:
        v["reasons"].append(f"the dual run was not faster: {dt:.1f} vs {ct:.1f} tok/s (speedup {v['speedup']:.2f}x"
                            + (f", required > {min_speedup:g}x)" if min_speedup != 1.0 else ")"))
    if v["reasons"]:
        v.update(verdict=THUNDER, ok=False, category=THUNDER_CATEGORY, anchor=CATEGORIES[THUNDER_CATEGORY],
                 exit_code=1)
        return v
    v["reasons"].append(f"dual test loss {dl:.4f} vs control {cl:.4f} ({100 * rel:+.2f}%, tolerance "
                        f"{100 * tolerance:g}%), speedup {v['speedup']:.2f}x"
                        + (f" (required > {min_speedup:g}x)" if min_speedup != 1.0 else ""))
    if rel < -tolerance:
        v["reasons"].append(f"note: the dual loss is better than the control's by more than the tolerance "
                            f"({100 * rel:+.2f}%): check both ran the same config")
    return v


# ---- evaluation (mlx-lm's pieces) ---------------------------------------------------------------
def model_path(model: str) -> str:
    """A local model folder (relative paths are the repo's), or a Hugging Face id as is."""
    p = Path(model)
    full = p if p.is_absolute() else paths.ROOT / p
    return str(full) if full.exists() else model


def evaluate_models(model: str, adapters: dict[str, str | None], data_dir: Path, cfg: dict,
                    batch_size: int, test_batches: int, seed: int) -> dict:
    """Test loss of the base model and each adapter over the same batches.

    The model is loaded once; the first adapter converts it to LoRA (mlx_lm.tuner.utils
    load_adapters); a further adapter with the same adapter config swaps in its weights
    (every adapter tensor replaced, checked), one with another config reloads the model.
    A fingerprint of every batch (tokens and lengths) shows all models saw the same batches.
    """
    from functools import partial
    from types import SimpleNamespace

    import mlx.core as mx
    import numpy as np
    from mlx_lm.tuner.datasets import CacheDataset, create_dataset
    from mlx_lm.tuner.trainer import default_loss, evaluate, iterate_batches
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load

    records = list(jsonl.read(data_dir / "test.jsonl"))
    if not records:
        raise RunbookError(f"{paths.rel(data_dir / 'test.jsonl')} is empty: nothing to evaluate on; "
                           "re-export with a test split", ANCHOR_NOT_COMPARABLE)
    bs = min(batch_size, len(records))
    feats = {k: cfg.get(k, CONFIG_DEFAULTS[k]) for k in
             ("mask_prompt", "chat_feature", "prompt_feature", "completion_feature", "text_feature")}
    max_seq = int(cfg.get("max_seq_length") or CONFIG_DEFAULTS["max_seq_length"])
    t0 = time.monotonic()
    mdl, tokenizer = load(model_path(model))
    load_s = time.monotonic() - t0
    test_set = CacheDataset(create_dataset(records, tokenizer, SimpleNamespace(**feats)))
    batches = partial(iterate_batches, seed=seed)
    out = {"records": len(records), "batch_size": bs, "max_seq_length": max_seq, "seed": seed,
           "test_batches": test_batches, "load_s": round(load_s, 3), "models": {}}

    def run_eval(name: str) -> None:
        seen = {"tokens": [], "h": hashlib.sha256(), "batches": 0}

        def loss(m, batch, lengths):
            seen["h"].update(np.array(batch).tobytes())
            seen["h"].update(np.array(lengths).tobytes())
            seen["batches"] += 1
            ce, ntoks = default_loss(m, batch, lengths)
            seen["tokens"].append(ntoks)
            return ce, ntoks

        tic = time.monotonic()
        value = evaluate(model=mdl, dataset=test_set, batch_size=bs, num_batches=test_batches,
                         max_seq_length=max_seq, loss=loss, iterate_batches=batches)
        ntok = int(sum(int(t.item()) for t in seen["tokens"]))
        out["models"][name] = {"loss": value, "batches": seen["batches"], "tokens": ntok,
                               "batches_sha256": seen["h"].hexdigest(), "wall_s": round(time.monotonic() - tic, 3)}
        event("compare-eval", model=name, test_loss=value, ppl=ppl_of(value) or float("nan"),
              batches=seen["batches"], tokens=ntok, wall_s=out["models"][name]["wall_s"])

    run_eval("base")
    applied = None  # (adapter config, weight names) of the LoRA layers in mdl
    for name, path in adapters.items():
        if path is None:
            continue
        adir = paths.ROOT / path
        acfg = json.loads((adir / "adapter_config.json").read_text(encoding="utf-8"))
        shape = (acfg.get("fine_tune_type", "lora"), acfg.get("num_layers"), acfg.get("lora_parameters"))
        weights = mx.load(str(adir / "adapters.safetensors"))
        if applied is not None and applied[0] == shape and applied[1] == set(weights):
            mdl.load_weights(list(weights.items()), strict=False)
        else:
            if applied is not None:
                mdl, tokenizer = load(model_path(model))
            load_adapters(mdl, str(adir))
            applied = (shape, set(weights))
        mx.eval(mdl.parameters())
        run_eval(name)
    out["peak_mem_gb"] = round(mx.get_peak_memory() / 1e9, 3)
    shas = {m["batches_sha256"] for m in out["models"].values()}
    out["same_batches"] = len(shas) == 1
    base = out["models"]["base"]
    out["batches"], out["tokens"] = base["batches"], base["tokens"]
    return out


# ---- the picture ------------------------------------------------------------------------------------
def plot_curves(dual: dict, control: dict, losses: dict, verdict: str) -> bytes:
    """Train and validation loss of both runs on one axis (test losses marked), tok/s below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.2]})
    # Data parallel with the same global batch follows the control's curve closely: the control
    # is drawn first, wide and pale, the dual run on top of it, thin, so both stay visible.
    styles = {"control": dict(color="tab:orange", lw=4.0, alpha=0.55, marker="s", ms=7),
              "dual": dict(color="tab:blue", lw=1.6, alpha=1.0, marker="o", ms=4)}
    for r in (control, dual):
        st = styles[r["role"]]
        c = st["color"]
        label = f"{r['role']} {r['run']} (world {r['world_size']})"
        tr = curve(r["metrics"], "train")
        if len(tr) < 5 and len(curve(r["metrics"], "step")) > len(tr):
            tr = curve(r["metrics"], "step")  # a short run: every step rather than a few reports
        va = curve(r["metrics"], "val")
        if tr:
            ax.plot(*zip(*tr, strict=True), color=c, lw=st["lw"], alpha=st["alpha"], label=f"{label}: train")
        if va:
            ax.plot(*zip(*va, strict=True), color=c, lw=st["lw"] * 0.6, alpha=st["alpha"], ls="--",
                    marker=st["marker"], ms=st["ms"], label=f"{label}: validation")
        test = losses.get(r["role"])
        if test is not None and math.isfinite(test) and r["final_step"] is not None:
            ax.plot([r["final_step"]], [test], color=c, marker="*", ms=14, ls="none",
                    label=f"{r['role']} adapter test loss {test:.4f}")
        steps = [(m["step"], m["tok_per_s"]) for m in r["metrics"]
                 if m.get("kind") == "step" and isinstance(m.get("step"), int) and finite(m.get("tok_per_s"))]
        if not steps:
            steps = [(m["step"], m["tok_per_s"]) for m in r["metrics"]
                     if m.get("kind") == "train" and isinstance(m.get("step"), int) and finite(m.get("tok_per_s"))]
        if steps:
            ax2.plot(*zip(*steps, strict=True), color=c, lw=1, marker=".", ms=3, alpha=st["alpha"],
                     label=f"{r['role']} tok/s")
        if r["tok_per_s"]:
            ax2.axhline(r["tok_per_s"], color=c, ls=":", lw=1.2, label=f"{r['role']} steady {r['tok_per_s']:.0f} tok/s")
    base = losses.get("base")
    if base is not None and math.isfinite(base):
        ax.axhline(base, color="gray", ls=":", lw=1.5, label=f"base model test loss {base:.4f}")
    ax.set_ylabel("loss (cross-entropy per token)")
    ax.set_title(f"{dual['run']} (dual) vs {control['run']} (control): verdict {verdict}", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best", framealpha=0.85)
    ax2.set_xlabel("step (optimizer iteration, same global batch in both runs)")
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_ylabel("tok/s (whole group)")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7, loc="lower right", ncol=2)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


# ---- calibration (issue #9 defines the file; read it only when it says what we need) ----------------
def calibration_hosts(path: Path) -> list | None:
    try:
        hf = json.loads(path.read_text(encoding="utf-8")).get("hostfile", {})
        return [h.get("ssh") for h in hf.get("hosts", [])] if isinstance(hf, dict) else None
    except (OSError, ValueError, AttributeError):
        return None


def calibration_note(speedup: float | None, world_ratio: float, runs_dir: Path | None = None,
                     hosts: list | None = None) -> dict | None:
    """The newest runs/calibration-*.json (names sort by time) of the dual run's hosts (when
    given). `expected_speedup` is the speedup the measured link and per-host throughput allow;
    the calibration's own `link_bound` says whether the link (not shared compute) is what holds
    it below ideal (without it: expected well below ideal). The run's speedup is link-bound
    when the calibration says so and the run reached what it expects."""
    files = sorted((runs_dir or paths.RUNS).glob("calibration-*.json"))
    if hosts is not None:
        files = [f for f in files if calibration_hosts(f) in (None, hosts)]
    if not files:
        return None
    path = files[-1]
    out = {"file": paths.rel(path), "expected_speedup": None, "link_bound": None, "note": ""}
    try:
        cal = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        out["note"] = f"unreadable: {e}"
        return out
    exp = finite(cal.get("expected_speedup")) if isinstance(cal, dict) else None
    if exp is None:
        out["note"] = "has no expected_speedup: cannot say whether the speedup is link-bound"
        return out
    out["expected_speedup"] = exp
    if speedup is None:
        out["note"] = f"calibration expects {exp:.2f}x; no measured speedup"
    elif (cal["link_bound"] if isinstance(cal.get("link_bound"), bool) else exp < 0.9 * world_ratio) \
            and speedup >= 0.9 * exp:
        out["link_bound"] = True
        out["note"] = (f"link-bound: calibration expects {exp:.2f}x of an ideal {world_ratio:g}x "
                       f"(all-reduce over the link), the run reached {speedup:.2f}x")
    else:
        out["link_bound"] = False
        out["note"] = (f"not link-bound: calibration expects {exp:.2f}x, the run reached {speedup:.2f}x"
                       + (" (below what the link allows: look at compute or input)" if speedup < 0.9 * exp else ""))
    return out


# ---- the report ---------------------------------------------------------------------------------------
RUN_FIELDS = ("run", "dir", "stage", "ok", "category", "why", "world_size", "hosts", "hostfile_path", "git",
              "lock_sha256", "dataset", "dataset_sha256", "model", "model_sha256", "config_source", "seed", "batch_size", "grad_accumulation_steps", "global_batch",
              "adapter", "tok_per_s", "tok_per_s_method", "final_step", "trained_tokens", "peak_mem_gb",
              "stage_wall_s", "total_wall_s", "train_wall_s", "checkpoints_written", "checkpoints_kept",
              "trainer_test_loss", "reproduce")


def build_report(args, dual: dict, control: dict, comp: dict, ev: dict | None, verdict: dict,
                 out_rel: str) -> dict:
    models = (ev or {}).get("models", {})

    def row(name):
        m = models.get(name)
        if m is None:
            return {"evaluated": False, "loss": None, "ppl": None, "adapter": None}
        return {"evaluated": True, "loss": finite(m["loss"]), "ppl": finite(ppl_of(m["loss"])),
                "finite": m["loss"] is not None and math.isfinite(m["loss"]), "batches": m["batches"],
                "tokens": m["tokens"], "batches_sha256": m["batches_sha256"], "wall_s": m["wall_s"]}

    evaluation = None
    if ev is not None:
        evaluation = {k: ev[k] for k in ("records", "batch_size", "max_seq_length", "seed", "test_batches",
                                         "batches", "tokens", "same_batches", "load_s", "peak_mem_gb")}
        evaluation["split"] = f"datasets/{dual['dataset']}/test.jsonl"
        evaluation["models"] = {"base": {**row("base"), "adapter": None},
                                "control": {**row("control"), "adapter": control["adapter"]},
                                "dual": {**row("dual"), "adapter": dual["adapter"]}}
    ratio = (dual["world_size"] or 1) / (control["world_size"] or 1)
    runs = {}
    for r in (dual, control):
        runs[r["role"]] = {k: r[k] for k in RUN_FIELDS}
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "run": dual["run"],
        "control_run": control["run"],
        "verdict": verdict["verdict"],
        "ok": verdict["ok"],
        "category": verdict["category"],
        "anchor": verdict["anchor"],
        "reasons": verdict["reasons"],
        "exit_code": verdict["exit_code"],
        "tolerance": args.tolerance,
        "min_speedup": args.min_speedup,
        "loss": {"dual": verdict_loss(models, "dual"), "control": verdict_loss(models, "control"),
                 "base": verdict_loss(models, "base"), "relative_diff": finite(verdict["relative_loss_diff"]),
                 "within_tolerance": verdict["loss_ok"]},
        "throughput": {"dual_tok_per_s": dual["tok_per_s"], "control_tok_per_s": control["tok_per_s"],
                       "speedup": finite(verdict["speedup"]), "world_size_ratio": ratio,
                       "scaling_efficiency": finite(verdict["scaling_efficiency"]), "faster": verdict["faster"]},
        "comparable": comp,
        "provenance": {
            "dataset": dual["dataset"], "dataset_sha256": dual["dataset_sha256"],
            "model": dual["model"], "model_sha256": dual["model_sha256"],
            "git": {"dual": dual["git"], "control": control["git"]},
            "lock_sha256": {"dual": dual["lock_sha256"], "control": control["lock_sha256"]},
            "hostfile": {"dual": {"path": dual["hostfile_path"], "hosts": dual["hostfile"]},
                         "control": {"path": control["hostfile_path"], "hosts": control["hostfile"]}},
        },
        "evaluation": evaluation,
        "runs": runs,
        "calibration": calibration_note(finite(verdict["speedup"]), ratio, hosts=dual.get("hosts")),
        "reproduce_compare": shlex.join(compare_make_cmd(args)),
        "artifacts": {"report_md": f"{out_rel}/report.md", "report_json": f"{out_rel}/report.json",
                      "loss_curves_png": f"{out_rel}/loss_curves.png"},
    }


def verdict_loss(models: dict, name: str) -> float | None:
    m = models.get(name)
    return finite(m["loss"]) if m else None


def compare_make_cmd(args) -> list[str]:
    cmd = ["make", "compare", f"RUN={args.run}"]
    if args.tolerance != DEFAULT_TOLERANCE:
        cmd.append(f"TOLERANCE={args.tolerance:g}")
    if args.min_speedup != DEFAULT_MIN_SPEEDUP:
        cmd.append(f"MIN_SPEEDUP={args.min_speedup:g}")
    if args.test_batches != -1:
        cmd.append(f"TEST_BATCHES={args.test_batches}")
    return cmd


def fmt(x, spec: str = ".4f", none: str = "–") -> str:
    return none if x is None else format(x, spec)


def render_md(rep: dict) -> str:
    """The promotion report: what was compared, how, the verdict, and how to reproduce it."""
    d, c = rep["runs"]["dual"], rep["runs"]["control"]
    tp, lo = rep["throughput"], rep["loss"]
    ev = rep["evaluation"]
    L = [f"# Promotion report: `{rep['run']}` vs control `{rep['control_run']}`", ""]
    head = f"**Verdict: {rep['verdict']}**"
    if rep["category"]:
        head += f" (category: {rep['category']}; see RUNBOOK.md#{rep['anchor']})"
    elif rep["anchor"]:
        head += f" (see RUNBOOK.md#{rep['anchor']})"
    L += [head, ""] + [f"- {r}" for r in rep["reasons"]] + [""]

    def hosts(r):
        return ", ".join(f"{h} (rank {i})" for i, h in enumerate(r["hosts"])) or "?"

    def git(r):
        g = r["git"]
        return f"`{g.get('commit', '?')}`" + (" (dirty tree)" if g.get("dirty") else " (clean)")

    L += ["| | dual | control |", "| --- | --- | --- |",
          f"| run | `{d['run']}` | `{c['run']}` |",
          f"| world size / hosts | {d['world_size']}: {hosts(d)} | {c['world_size']}: {hosts(c)} |",
          f"| hostfile | `{d['hostfile_path']}` | `{c['hostfile_path']}` |",
          f"| dataset | `{d['dataset']}` | `{c['dataset']}` |",
          f"| dataset_sha256 | `{d['dataset_sha256']}` | `{c['dataset_sha256']}` |",
          f"| model | `{d['model']}` | `{c['model']}` |",
          f"| model_sha256 | `{d['model_sha256']}` | `{c['model_sha256']}` |",
          f"| code commit | {git(d)} | {git(c)} |",
          f"| requirements.lock sha256 | `{str(d['lock_sha256'])[:16]}…` | `{str(c['lock_sha256'])[:16]}…` |",
          f"| seed / global batch | {d['seed']} / {d['global_batch']} | {c['seed']} / {c['global_batch']} |",
          f"| resolved config | `{d['config_source']}` | `{c['config_source']}` |", ""]

    L += ["## Metrics", ""]
    if ev:
        L += [f"Test split `{ev['split']}`: {ev['records']} records, {ev['batches']} batches of {ev['batch_size']}, "
              f"{ev['tokens']} target tokens, seed {ev['seed']}; the same batches for all three models: "
              f"{'yes' if ev['same_batches'] else 'NO'} (fingerprints of every batch).", ""]
    else:
        L += ["Not evaluated (see the verdict).", ""]
    m = (ev or {}).get("models", {})

    def mrow(name, r):
        x = m.get(name, {})
        tok = fmt(r["tok_per_s"], ".1f") if r else "–"
        wall = fmt(r["stage_wall_s"], ".1f") if r else "–"
        return (f"| {name} | {fmt(x.get('loss'))} | {fmt(x.get('ppl'), '.2f')} | {tok} | {wall} | "
                f"{('`' + x['adapter'] + '`') if x.get('adapter') else '–'} |")

    L += ["| model | test loss | test ppl | train tok/s | stage wall (s) | adapter |",
          "| --- | --- | --- | --- | --- | --- |", mrow("base", None), mrow("control", c), mrow("dual", d), ""]
    L += [f"- Speedup (dual / control steady-state tok/s): **{fmt(tp['speedup'], '.2f')}x** (required > "
          f"{rep['min_speedup']:g}x); scaling efficiency (speedup / {tp['world_size_ratio']:g}): "
          f"**{fmt(tp['scaling_efficiency'], '.2f')}**.",
          f"- Dual vs control test loss: {fmt(None if lo['relative_diff'] is None else 100 * lo['relative_diff'], '+.2f')}% "
          f"(tolerance {100 * rep['tolerance']:g}%); base model {fmt(lo['base'])}."]
    if rep["calibration"]:
        L.append(f"- Calibration `{rep['calibration']['file']}`: {rep['calibration']['note']}.")
    L += ["", "| | dual | control |", "| --- | --- | --- |"]
    for label, key, spec in (("stage ok", "ok", None), ("final step", "final_step", None),
                             ("trained tokens", "trained_tokens", None), ("tok/s measured as", "tok_per_s_method", None),
                             ("train loop wall (s)", "train_wall_s", ".1f"), ("stage wall (s)", "stage_wall_s", ".1f"),
                             ("stage + fetch wall (s)", "total_wall_s", ".1f"), ("peak memory (GB)", "peak_mem_gb", ".3f"),
                             ("checkpoints written", "checkpoints_written", None),
                             ("trainer's own test loss", "trainer_test_loss", ".4f")):
        cells = [fmt(r[key], spec) if spec else ("–" if r[key] is None else str(r[key])) for r in (d, c)]
        L.append(f"| {label} | {cells[0]} | {cells[1]} |")
    L.append(f"| checkpoints kept | {', '.join(d['checkpoints_kept']) or '–'} | {', '.join(c['checkpoints_kept']) or '–'} |")
    L += ["", "## Comparability", ""]
    for ch in rep["comparable"]["checks"]:
        L.append(f"- {ch['name']}: {'same' if ch['ok'] else 'DIFFERS'} (dual `{ch['dual']}`, control `{ch['control']}`)")
    for p in rep["comparable"]["problems"]:
        L.append(f"- problem: {p}")
    for w in rep["comparable"]["warnings"]:
        L.append(f"- warning: {w}")
    L += ["", "## Curves", "", "![train and validation loss of both runs](loss_curves.png)", ""]
    L += ["## Reproduce", "", "From the repo root on the orchestrator (each run's `reproduce.sh` holds the same).", ""]
    for r in (d, c):
        L += [f"### {'dual' if r is d else 'control'} `{r['run']}`", ""]
        if not r["reproduce"]:
            L += [f"No `{r['dir']}/reproduce.sh`.", ""]
            continue
        L += ["```bash"] + [cmds["make"] for cmds in r["reproduce"].values() if cmds["make"]] + ["```", ""]
        ran = [line for cmds in r["reproduce"].values() for line in cmds["ran"]]
        if ran:
            L += ["What those ran underneath:", "", "```bash"] + ran + ["```", ""]
    L += ["### this report", "", "```bash", rep["reproduce_compare"], "```", ""]
    return "\n".join(L)



# ---- main ------------------------------------------------------------------------------------------------
def python_rel() -> str:
    exe = Path(sys.executable)
    try:
        return str(exe.relative_to(paths.ROOT))
    except ValueError:
        return str(exe)


def main() -> int:
    args = build_parser().parse_args()
    t0 = time.monotonic()
    if not 0 <= args.tolerance < 1:
        return die(RunbookError(f"--tolerance {args.tolerance:g} is a relative loss tolerance: use a number in "
                                "[0, 1), e.g. 0.02 for 2%", "compare"), 2)
    if not args.min_speedup >= 0:
        return die(RunbookError(f"--min-speedup {args.min_speedup:g}: use a number >= 0 (1.0: faster at all)",
                                "compare"), 2)
    if args.test_batches == 0 or args.test_batches < -1 or (args.batch_size is not None and args.batch_size < 1):
        return die(RunbookError("--test-batches is -1 (all) or >= 1 and --batch-size >= 1", "compare"), 2)
    try:
        paths.check_run_id(args.run)
        dual = run_facts("dual", args.run, "train.json")
        man = json.loads((paths.RUNS / args.run / "manifest.json").read_text(encoding="utf-8"))
        control_run = args.control_run or man.get("control_run") or f"{args.run}-control"
        control = run_facts("control", control_run, "control.json")
    except (RunbookError, ValueError) as e:
        return die(e, 2)

    for r in (dual, control):
        event("compare-run", role=r["role"], run=r["run"], ok=r["ok"], world_size=r["world_size"],
              tok_per_s=r["tok_per_s"] or float("nan"), final_step=r["final_step"],
              stage_wall_s=r["stage_wall_s"] or float("nan"), checkpoints=r["checkpoints_written"],
              adapter=r["adapter"] or "-")
    model_is_local = Path(model_path(dual["model"] or "")).is_dir()
    disk_model = launch.model_hash(dual["model"]) if model_is_local else None
    comp = comparability(dual, control, disk_dataset_sha256(dual["dataset"]), disk_model)
    for ch in comp["checks"]:
        event("compare-check", key=ch["name"], status="same" if ch["ok"] else "DIFFERS",
              dual=json.dumps(ch["dual"]), control=json.dumps(ch["control"]))
    for w in comp["warnings"]:
        print(f"warning: {w}", flush=True)

    ev = None
    if comp["ok"]:
        try:
            ev = evaluate_models(dual["model"], {"control": control["adapter"], "dual": dual["adapter"]},
                                 paths.DATASETS / dual["dataset"], dual["config"],
                                 args.batch_size or int(dual["batch_size"]), args.test_batches, int(dual["seed"]))
        except RunbookError as e:
            return die(e, 2)
        if not ev["same_batches"]:
            comp["problems"].append("the three models did not see the same test batches (fingerprints differ): "
                                    "a bug in compare; report it")
            comp["ok"] = False
        for r in (dual, control):
            mine = ev["models"].get(r["role"], {}).get("loss")
            theirs = r["trainer_test_loss"]
            if mine is not None and theirs is not None and math.isfinite(mine) and \
                    abs(mine - theirs) > 1e-3 * max(abs(theirs), 1e-9):
                comp["warnings"].append(f"{r['run']}: compare's test loss {mine:.5f} differs from the trainer's own "
                                        f"{theirs:.5f} (test_batches or batch size differ?)")
    losses = {k: m["loss"] for k, m in (ev or {}).get("models", {}).items()}
    verdict = decide(dual, control, losses, comp["problems"], args.tolerance, args.min_speedup)

    out_dir = paths.RUNS / args.run / "compare"
    out_rel = paths.rel(out_dir)
    rep = build_report(args, dual, control, comp, ev, verdict, out_rel)
    rep["wall_s"] = round(time.monotonic() - t0, 3)
    png = plot_curves(dual, control, losses, verdict["verdict"])
    with atomic.atomic_dir(out_dir) as tmp:
        atomic.write_json(tmp / "report.json", rep)
        atomic.write_text(tmp / "report.md", render_md(rep))
        atomic.write_bytes(tmp / "loss_curves.png", png)
    run_dir = paths.RUNS / args.run
    launch.write_reproduce(run_dir, "compare", compare_make_cmd(args),
                           [[python_rel(), "bin/compare.py", *sys.argv[1:]]])
    launch.finish_manifest(run_dir, "compare", {"ok": verdict["ok"], "category": verdict["category"]})

    lo, tp = rep["loss"], rep["throughput"]
    event("compare", run=args.run, control=control["run"], verdict=json.dumps(verdict["verdict"]),
          base_loss=lo["base"] if lo["base"] is not None else float("nan"),
          control_loss=lo["control"] if lo["control"] is not None else float("nan"),
          dual_loss=lo["dual"] if lo["dual"] is not None else float("nan"),
          rel_loss_pct=100 * lo["relative_diff"] if lo["relative_diff"] is not None else float("nan"),
          speedup=tp["speedup"] if tp["speedup"] is not None else float("nan"),
          efficiency=tp["scaling_efficiency"] if tp["scaling_efficiency"] is not None else float("nan"),
          report=f"{out_rel}/report.md")
    if verdict["ok"]:
        return 0
    reason = "; ".join(verdict["reasons"])
    if verdict["category"] in CATEGORIES:
        launch.print_category(verdict["category"], reason)
        return verdict["exit_code"]
    return die(RunbookError(f"{verdict['verdict']}: {reason}", verdict["anchor"] or "compare"), verdict["exit_code"])


if __name__ == "__main__":
    sys.exit(main())
