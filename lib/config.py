"""Run configs: mlx-lm lora keys (same names, same meaning) plus the runbook's own keys.

Precedence is mlx-lm's: command line, then the YAML file, then DEFAULTS. Unlike
mlx-lm, an unknown key or a wrong type is an error that names the key, the file
and the line (nanoGPT's configurator refuses them too). PyYAML reads `1e-5` as a
string; LOADER resolves it as a float exactly the way mlx-lm's lora.py does.

    from lib import config
    cfg = config.resolve("configs/smoke.yaml", {"iters": 4})
    config.config_hash(cfg)                        # what a resume must match
    config.fallback_ladder(cfg, argv, world_size)  # out-of-memory rungs

This module imports no mlx: the orchestrator can use it on a host without it.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import yaml

from lib.log import STABILITY, RunbookError, anchor_of


class _Loader(yaml.SafeLoader):
    """SafeLoader with mlx-lm's float resolver (mlx-lm patches SafeLoader itself; we subclass)."""


# The resolver of mlx_lm/lora.py: `1e-5` and `.5` are floats, as in YAML 1.2.
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile("""^(?:
     [-+]?(?:[0-9][0-9_]*)\\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\\.[0-9_]*
    |[-+]?\\.(?:inf|Inf|INF)
    |\\.(?:nan|NaN|NAN))$""", re.X), list("-+0123456789."))
LOADER = _Loader

ANCHOR = "run-configs"
OPTIMIZERS = ("adam", "adamw", "muon", "sgd", "adafactor")
FINE_TUNE_TYPES = ("lora", "dora", "full")

# mlx-lm's CONFIG_DEFAULTS (mlx_lm/lora.py), minus what a runbook run does not use
# (an HF dataset, a separate adapter_path), plus the runbook's keys below it.
DEFAULTS: dict[str, Any] = {
    "model": None, "data": None, "train": True, "fine_tune_type": "lora", "optimizer": "adam",
    "optimizer_config": {"adam": {}, "adamw": {}, "muon": {}, "sgd": {}, "adafactor": {}},
    "seed": 0, "num_layers": 16, "batch_size": 4, "iters": 1000, "val_batches": 25,
    "learning_rate": 1e-5, "steps_per_report": 10, "steps_per_eval": 200,
    "resume_adapter_file": None, "save_every": 100, "test": False, "test_batches": 500,
    "max_seq_length": 2048, "grad_checkpoint": False, "grad_accumulation_steps": 1,
    "clear_cache_threshold": 0, "lr_schedule": None,
    "lora_parameters": {"rank": 8, "dropout": 0.0, "scale": 20.0}, "mask_prompt": False,
    "trust_remote_code": False, "chat_feature": "messages",
    "prompt_feature": "prompt", "completion_feature": "completion", "text_feature": "text",
    # ---- runbook keys ----
    "keep_last_k": 3,        # checkpoints kept besides the best-by-validation and the final one (>= 2)
    "watchdog_s": None,      # orchestrator watchdog window (s); null = max(10 x median step, 300)
    "divergence_factor": 4.0,  # a loss above this x the first step's, within the first
    "divergence_window": 50,   # divergence_window steps, stops the run (NaN/inf at any step)
    "loss": "default",         # default: mlx-lm's default_loss; chunked: lib/loss.py (one chunk of logits)
    "loss_chunk_tokens": 64,   # rows of hidden states per chunk of the chunked loss
    "grad_average": "mlx_lm",  # mlx_lm: mean of per-rank means; tokens: sum / global token count
    "max_grad_norm": None,     # clip the global gradient norm before the step (null: no clipping)
}

# mlx-lm keys that are refused with the reason (they mean something else in a runbook run).
NO_REPORTING = "no reporting service is wired in: the metrics are in runs/<RUN>/metrics.jsonl; remove the key"
REFUSED = {"hf_dataset": "Hugging Face datasets are not used: export to datasets/NAME and set data",
           "adapter_path": "the trainer writes the adapter to RUN_DIR/adapters; remove the key",
           "report_to": NO_REPORTING, "project_name": NO_REPORTING,
           "config": "a config cannot name another config"}

# Keys a resume may change; everything else is in config_hash() and must match.
RESUMABLE = {"model", "data", "iters", "steps_per_report", "save_every", "keep_last_k", "watchdog_s", "test",
             "test_batches", "clear_cache_threshold", "trust_remote_code", "resume_adapter_file"}


def _int(lo: int, *allow: int):
    want = f"an integer >= {lo}" + (f" (or {', '.join(map(str, allow))})" if allow else "")
    return lambda v: None if type(v) is int and (v >= lo or v in allow) else want


def _num(lo: float | None = None, strict: bool = False):
    want = "a finite number" + (f" {'>' if strict else '>='} {lo}" if lo is not None else "")

    def check(v):
        ok = type(v) in (int, float) and math.isfinite(v)
        return None if ok and (lo is None or (v > lo if strict else v >= lo)) else want
    return check


def _is(want: str, test):
    return lambda v: None if test(v) else want


_bool, _str = _is("true or false", lambda v: isinstance(v, bool)), _is("a non-empty string", lambda v: isinstance(v, str) and v != "")
_opt_str = _is("null or a non-empty string", lambda v: v is None or (isinstance(v, str) and v != ""))
_opt_pos = _is("null or a finite number > 0", lambda v: v is None or _num(0.0, strict=True)(v) is None)


def _lora(v):
    need, known = {"rank", "scale", "dropout"}, {"rank", "scale", "dropout", "keys"}
    if not isinstance(v, dict) or set(v) - known or not need <= set(v):
        extra = sorted(set(v) - known) if isinstance(v, dict) else []
        return "a mapping with rank, scale, dropout and optional keys (mlx-lm's names" + "".join(f"; not {k!r}" for k in extra) + ")"
    for k, check in (("rank", _int(1)), ("scale", _num()), ("dropout", _num(0.0))):
        if (why := check(v[k])) is not None:
            return f"a mapping whose `{k}` is {why}"
    keys = v.get("keys", [])
    ok = v["dropout"] < 1.0 and isinstance(keys, list) and all(isinstance(x, str) for x in keys)
    return None if ok else "a mapping whose `dropout` is below 1 and `keys` a list of module names"


# mlx-lm's build_schedule checks the rest when the trainer builds it (a failure there is a config error).
_schedule = _is("null or a mapping with name and a non-empty list of arguments (mlx.optimizers.schedulers)",
                lambda v: v is None or (isinstance(v, dict) and isinstance(v.get("name"), str)
                                        and isinstance(v.get("arguments"), list) and len(v["arguments"]) > 0))


CHECKS = {
    "model": _opt_str, "data": _opt_str,
    "train": _is("true (the trainer always trains)", lambda v: v is True),
    "fine_tune_type": _is(f"one of {', '.join(FINE_TUNE_TYPES)}", lambda v: v in FINE_TUNE_TYPES),
    "optimizer": _is(f"one of {', '.join(OPTIMIZERS)}", lambda v: v in OPTIMIZERS),
    "optimizer_config": _is(f"a mapping of optimizer name ({', '.join(OPTIMIZERS)}) -> mapping of keyword arguments",
                            lambda v: isinstance(v, dict) and set(v) <= set(OPTIMIZERS)
                            and all(isinstance(x, dict) for x in v.values())),
    "seed": _int(0), "num_layers": _int(1, -1), "batch_size": _int(1), "iters": _int(1),
    "val_batches": _int(0, -1), "learning_rate": None,  # checked last in validate(): its failure has a category
    "steps_per_report": _int(1), "steps_per_eval": _int(1), "resume_adapter_file": _opt_str,
    "save_every": _int(1), "test": _bool, "test_batches": _int(0, -1), "max_seq_length": _int(2),
    "grad_checkpoint": _bool, "grad_accumulation_steps": _int(1), "clear_cache_threshold": _int(0),
    "lr_schedule": _schedule, "lora_parameters": _lora, "mask_prompt": _bool,
    "trust_remote_code": _bool, "chat_feature": _str, "prompt_feature": _str,
    "completion_feature": _str, "text_feature": _str, "keep_last_k": _int(2),
    "watchdog_s": _opt_pos,
    "divergence_factor": _num(1.0, strict=True), "divergence_window": _int(0),
    "loss": _is("default or chunked", lambda v: v in ("default", "chunked")), "loss_chunk_tokens": _int(1),
    "grad_average": _is("mlx_lm or tokens", lambda v: v in ("mlx_lm", "tokens")),
    "max_grad_norm": _opt_pos,
}
assert set(CHECKS) == set(DEFAULTS)


class ConfigError(RunbookError):
    def __init__(self, message: str, category: str | None = None):
        super().__init__(message, anchor_of(category) if category else ANCHOR, category)


def load_yaml(path: os.PathLike | str) -> tuple[dict, dict[str, int]]:
    """The YAML mapping of a config file and the line of each top-level key."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        node, data = yaml.compose(text, Loader=LOADER), yaml.load(text, Loader=LOADER)
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise ConfigError(f"{path}{f':{mark.line + 1}' if mark else ''}: invalid YAML: {getattr(e, 'problem', e)}") from e
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config is a mapping of key: value, not {type(data).__name__}")
    return data, {k.value: k.start_mark.line + 1 for k, _ in node.value}


def validate(cfg: dict, source: str = "config", lines: dict[str, int] | None = None) -> dict:
    """Refuse unknown keys, wrong types and inconsistent values; returns cfg."""
    def where(key):
        return f"{source}:{lines[key]}" if lines and key in lines else source

    for key in cfg:
        if key in REFUSED:
            raise ConfigError(f"{where(key)}: key {key!r} is not supported: {REFUSED[key]}")
        if key not in DEFAULTS:
            near = difflib.get_close_matches(str(key), DEFAULTS, n=1)
            raise ConfigError(f"{where(key)}: unknown config key {key!r}{f' (did you mean {near[0]!r}?)' if near else ''}; "
                              "keys are mlx-lm lora's plus the runbook's (lib/config.py DEFAULTS)")
    for key, check in CHECKS.items():
        if check is not None and key in cfg and (why := check(cfg[key])) is not None:
            raise ConfigError(f"{where(key)}: {key} must be {why}, got {cfg[key]!r}")
    lr = cfg.get("learning_rate", 1.0)
    if type(lr) not in (int, float):
        raise ConfigError(f"{where('learning_rate')}: learning_rate must be a number, got {lr!r}")
    if not math.isfinite(lr) or lr <= 0:
        raise ConfigError(f"{where('learning_rate')}: learning_rate is {lr!r}: it must be a finite number > 0 "
                          "(LoRA on this model is stable around 1e-5 to 1e-4)", category=STABILITY)
    return cfg


def load_config(path: os.PathLike | str) -> dict:
    """DEFAULTS <- YAML file, validated; model and data may still be unset (the
    orchestrator passes them to the trainer on its command line)."""
    cfg = copy.deepcopy(DEFAULTS)
    data, lines = load_yaml(path)
    data = {k: v for k, v in data.items() if not (k in REFUSED and v is None)}  # mlx-lm writes `report_to: null`
    cfg.update(copy.deepcopy(validate(data, str(path), lines)))
    return cfg


def resolve(path: os.PathLike | str | None, overrides: dict | None = None) -> dict:
    """DEFAULTS <- YAML file <- overrides (command line; None values are ignored)."""
    cfg = load_config(path) if path is not None else copy.deepcopy(DEFAULTS)
    cfg.update(validate({k: v for k, v in (overrides or {}).items() if v is not None}, "command line"))
    validate(cfg, str(path) if path else "config")
    for key in ("model", "data"):
        if not cfg[key]:
            raise ConfigError(f"no {key} given: set `{key}:` in the config or pass --{key}")
    for key in ("save_every", "iters"):
        if cfg[key] % cfg["grad_accumulation_steps"]:
            raise ConfigError(f"{key} ({cfg[key]}) must be a multiple of grad_accumulation_steps "
                              f"({cfg['grad_accumulation_steps']}): a checkpoint or the end of the run must "
                              "fall on an optimizer update")
    return cfg


def config_hash(cfg: dict) -> str:
    """sha256 over the keys that change the maths (not the RESUMABLE ones)."""
    core = {k: v for k, v in cfg.items() if k not in RESUMABLE}
    return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()


def diff_keys(a: dict, b: dict) -> list[str]:
    """Keys outside RESUMABLE whose values differ between two resolved configs."""
    return sorted(k for k in (set(a) | set(b)) - RESUMABLE if a.get(k) != b.get(k))


def check_world(cfg: dict, world_size: int) -> None:
    """batch_size is the global batch (mlx-lm's meaning): every rank takes batch_size / world."""
    if cfg["batch_size"] % world_size:
        lo = cfg["batch_size"] - cfg["batch_size"] % world_size
        raise ConfigError(f"batch_size {cfg['batch_size']} is the global batch and must be divisible by the "
                          f"world size {world_size} (each rank takes batch_size / {world_size}): use "
                          f"{f'{lo} or {lo + world_size}' if lo else world_size}")


# ---- out of memory -------------------------------------------------------------------
def set_flag(argv: list[str], flag: str, value: Any) -> list[str]:
    out = list(argv)
    for i, a in enumerate(out):
        if (a == flag and i + 1 < len(out)) or a.startswith(flag + "="):
            out[i:i + 2] = [flag, str(value)] if a == flag else [f"{flag}={value}", *out[i + 1:i + 2]]
            return out
    return out + [flag, str(value)]


def fallback_ladder(cfg: dict, argv: list[str], world_size: int) -> list[tuple[str, list[str]]]:
    """The out-of-memory rungs as trainer argument lists, each keeping the global batch:
    1. per-rank batch 1, gradient accumulation making up the global batch (iters and the
       step cadences scale with it, since an mlx-lm iteration is one micro-batch);
    2. the same with half the max sequence length."""
    factor = max(cfg["batch_size"] // max(world_size, 1), 1)
    accum = cfg["grad_accumulation_steps"] * factor
    rung1 = list(argv)
    for flag, value in (("--batch-size", world_size), ("--grad-accumulation-steps", accum),
                        ("--iters", cfg["iters"] * factor), ("--save-every", cfg["save_every"] * factor),
                        ("--steps-per-eval", cfg["steps_per_eval"] * factor),
                        ("--steps-per-report", cfg["steps_per_report"] * factor)):
        rung1 = set_flag(rung1, flag, value)
    half = max(cfg["max_seq_length"] // 2, 2)
    rungs = [(f"per-rank batch 1, grad accumulation {accum}, global batch {cfg['batch_size']}", rung1)] if factor > 1 else []
    return rungs + [(f"as above and max_seq_length {half}", set_flag(rung1, "--max-seq-length", half))]
