"""Run configs: mlx-lm lora keys (same names, same meaning) plus the runbook's own keys.

Precedence is mlx-lm's: command line, then the YAML file, then DEFAULTS. Unlike
mlx-lm, an unknown key or a wrong type is an error that names the key, the file
and the line (nanoGPT's configurator refuses them too). PyYAML reads `1e-5` as a
string; LOADER resolves it as a float exactly the way mlx-lm's lora.py does.

    from lib import config
    cfg = config.resolve("configs/smoke.yaml", {"iters": 4})
    config.config_hash(cfg)      # what a resume must match
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

from lib.log import CATEGORIES, RunbookError


class _Loader(yaml.SafeLoader):
    """SafeLoader with mlx-lm's float resolver (mlx-lm patches SafeLoader itself; we subclass)."""


# The resolver of mlx_lm/lora.py: `1e-5` and `.5` are floats, as in YAML 1.2.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        """^(?:
     [-+]?(?:[0-9][0-9_]*)\\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\\.[0-9_]*
    |[-+]?\\.(?:inf|Inf|INF)
    |\\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)
LOADER = _Loader

ANCHOR = "run-configs"
OPTIMIZERS = ("adam", "adamw", "muon", "sgd", "adafactor")
FINE_TUNE_TYPES = ("lora", "dora", "full")

# mlx-lm's CONFIG_DEFAULTS (mlx_lm/lora.py), minus what a runbook run does not use
# (an HF dataset, a separate adapter_path), plus the runbook's keys below it.
DEFAULTS: dict[str, Any] = {
    "model": None,
    "data": None,
    "train": True,
    "fine_tune_type": "lora",
    "optimizer": "adam",
    "optimizer_config": {"adam": {}, "adamw": {}, "muon": {}, "sgd": {}, "adafactor": {}},
    "seed": 0,
    "num_layers": 16,
    "batch_size": 4,
    "iters": 1000,
    "val_batches": 25,
    "learning_rate": 1e-5,
    "steps_per_report": 10,
    "steps_per_eval": 200,
    "resume_adapter_file": None,
    "save_every": 100,
    "test": False,
    "test_batches": 500,
    "max_seq_length": 2048,
    "grad_checkpoint": False,
    "grad_accumulation_steps": 1,
    "clear_cache_threshold": 0,
    "lr_schedule": None,
    "lora_parameters": {"rank": 8, "dropout": 0.0, "scale": 20.0},
    "mask_prompt": False,
    "report_to": None,
    "project_name": None,
    "trust_remote_code": False,
    "chat_feature": "messages",
    "prompt_feature": "prompt",
    "completion_feature": "completion",
    "text_feature": "text",
    # ---- runbook keys ----
    # checkpoints kept besides the best-by-validation and the final one (at least 2)
    "keep_last_k": 3,
    # orchestrator watchdog window in seconds; null = max(10 x median step time, 300)
    "watchdog_s": None,
    # a global step loss above divergence_factor x the first step's loss, within the
    # first divergence_window steps, stops the run (NaN/inf stops it at any step)
    "divergence_factor": 4.0,
    "divergence_window": 50,
}

# mlx-lm keys that are refused with the reason (they mean something else in a runbook run).
REFUSED = {
    "hf_dataset": "Hugging Face datasets are not used: export to datasets/NAME and set data",
    "adapter_path": "the trainer writes the adapter to RUN_DIR/adapters; remove the key",
    "config": "a config cannot name another config",
}

# Keys a resume may change; everything else is in config_hash() and must match.
RESUMABLE = {
    "model", "data", "iters", "steps_per_report", "save_every", "keep_last_k", "watchdog_s",
    "report_to", "project_name", "test", "test_batches", "clear_cache_threshold",
    "trust_remote_code", "resume_adapter_file",
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float))) and not isinstance(v, bool)


def _int(lo: int | None = None, allow: tuple = ()):
    extra = f" (or {', '.join(map(str, allow))})" if allow else ""
    want = f"an integer >= {lo}{extra}" if lo is not None else "an integer"

    def check(v):
        if not _is_int(v):
            return want
        if v in allow:
            return None
        if lo is not None and v < lo:
            return want
        return None

    return check


def _num(lo: float | None = None, strict: bool = False):
    def check(v):
        if not _is_num(v) or not math.isfinite(v):
            return "a finite number"
        if lo is not None and (v <= lo if strict else v < lo):
            return f"a number {'>' if strict else '>='} {lo}"
        return None

    return check


def _bool(v):
    return None if isinstance(v, bool) else "true or false"


def _str(v):
    return None if isinstance(v, str) and v else "a non-empty string"


def _opt(check):
    return lambda v: None if v is None else check(v)


def _choice(*names):
    return lambda v: None if v in names else f"one of {', '.join(names)}"


def _lora(v):
    if not isinstance(v, dict):
        return "a mapping with rank, scale, dropout (and optional keys)"
    known = {"rank": _int(1), "scale": _num(), "dropout": _num(0.0), "keys": None}
    for k, x in v.items():
        if k not in known:
            return f"a mapping whose keys are rank, scale, dropout, keys (not {k!r})"
        if k == "keys":
            if not (isinstance(x, list) and all(isinstance(s, str) for s in x)):
                return "a mapping whose `keys` is a list of module names"
        elif (why := known[k](x)) is not None:
            return f"a mapping whose `{k}` is {why}"
    for k in ("rank", "scale", "dropout"):
        if k not in v:
            return f"a mapping with `{k}` (mlx-lm uses rank, scale, dropout; `scale` not `alpha`)"
    if v["dropout"] >= 1.0:
        return "a mapping whose `dropout` is below 1"
    return None


def _schedule(v):
    if v is None:
        return None
    if not isinstance(v, dict) or not isinstance(v.get("name"), str):
        return "null or a mapping with name and arguments (mlx.optimizers.schedulers)"
    if not isinstance(v.get("arguments"), list) or not v["arguments"]:
        return "a mapping whose `arguments` is a non-empty list"
    extra = set(v) - {"name", "arguments", "warmup", "warmup_init"}
    if extra:
        return f"a mapping of name, arguments, warmup, warmup_init (not {sorted(extra)})"
    if "warmup" in v and _int(0)(v["warmup"]) is not None:
        return "a mapping whose `warmup` is an integer >= 0"
    if "warmup_init" in v and _num()(v["warmup_init"]) is not None:
        return "a mapping whose `warmup_init` is a number"
    return None


def _opt_config(v):
    if not isinstance(v, dict) or not all(isinstance(x, dict) for x in v.values()):
        return "a mapping of optimizer name -> mapping of keyword arguments"
    bad = set(v) - set(OPTIMIZERS)
    if bad:
        return f"a mapping whose keys are among {', '.join(OPTIMIZERS)} (not {sorted(bad)})"
    return None


def _report_to(v):
    if v is None or v == "wandb":
        return None
    return "null or wandb (the only reporting service this trainer supports)"


CHECKS = {
    "model": _opt(_str),
    "data": _opt(_str),
    "train": lambda v: None if v is True else "true (the trainer always trains)",
    "fine_tune_type": _choice(*FINE_TUNE_TYPES),
    "optimizer": _choice(*OPTIMIZERS),
    "optimizer_config": _opt_config,
    "seed": _int(0),
    "num_layers": _int(1, allow=(-1,)),
    "batch_size": _int(1),
    "iters": _int(1),
    "val_batches": _int(0, allow=(-1,)),
    "learning_rate": None,  # see _check_lr: its failure has a category
    "steps_per_report": _int(1),
    "steps_per_eval": _int(1),
    "resume_adapter_file": _opt(_str),
    "save_every": _int(1),
    "test": _bool,
    "test_batches": _int(0, allow=(-1,)),
    "max_seq_length": _int(2),
    "grad_checkpoint": _bool,
    "grad_accumulation_steps": _int(1),
    "clear_cache_threshold": _int(0),
    "lr_schedule": _schedule,
    "lora_parameters": _lora,
    "mask_prompt": _bool,
    "report_to": _report_to,
    "project_name": _opt(_str),
    "trust_remote_code": _bool,
    "chat_feature": _str,
    "prompt_feature": _str,
    "completion_feature": _str,
    "text_feature": _str,
    "keep_last_k": _int(2),
    "watchdog_s": _opt(_num(0.0, strict=True)),
    "divergence_factor": _num(1.0, strict=True),
    "divergence_window": _int(0),
}
assert set(CHECKS) == set(DEFAULTS)


class ConfigError(RunbookError):
    def __init__(self, message: str, category: str | None = None):
        anchor = CATEGORIES[category] if category else ANCHOR
        super().__init__(message, anchor, category)


def _where(source: str, lines: dict[str, int], key: str) -> str:
    line = lines.get(key)
    return f"{source}:{line}" if line else source


def load_yaml(path: os.PathLike | str) -> tuple[dict, dict[str, int]]:
    """The YAML mapping of a config file and the line of each top-level key."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from e
    try:
        node = yaml.compose(text, Loader=LOADER)
        data = yaml.load(text, Loader=LOADER)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: invalid YAML: {getattr(e, 'problem', e)}") from e
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config is a mapping of key: value, not {type(data).__name__}")
    lines = {}
    for k, _ in node.value:
        lines[k.value] = k.start_mark.line + 1
    return data, lines


def _check_lr(cfg: dict, where: str) -> None:
    lr = cfg["learning_rate"]
    if not _is_num(lr):
        raise ConfigError(f"{where}: learning_rate must be a number, got {lr!r}")
    if not math.isfinite(lr) or lr <= 0:
        raise ConfigError(
            f"{where}: learning_rate is {lr!r}: it must be a finite number > 0 "
            "(LoRA on this model is stable around 1e-5 to 1e-4)",
            category="learning rate or quantized LoRA stability",
        )


def validate(cfg: dict, source: str = "config", lines: dict[str, int] | None = None) -> dict:
    """Refuse unknown keys, wrong types and inconsistent values; returns cfg."""
    lines = lines or {}
    for key in cfg:
        if key in REFUSED:
            raise ConfigError(f"{_where(source, lines, key)}: key {key!r} is not supported: {REFUSED[key]}")
        if key not in DEFAULTS:
            near = difflib.get_close_matches(str(key), DEFAULTS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(
                f"{_where(source, lines, key)}: unknown config key {key!r}{hint}; "
                "keys are mlx-lm lora's plus the runbook's (lib/config.py DEFAULTS)"
            )
    for key, check in CHECKS.items():
        if check is None or key not in cfg:
            continue
        why = check(cfg[key])
        if why is not None:
            raise ConfigError(f"{_where(source, lines, key)}: {key} must be {why}, got {cfg[key]!r}")
    if "learning_rate" in cfg:
        _check_lr(cfg, _where(source, lines, "learning_rate"))
    return cfg


def load_config(path: os.PathLike | str) -> dict:
    """DEFAULTS <- YAML file, validated; model and data may still be unset (the
    orchestrator passes them to the trainer on its command line)."""
    cfg = copy.deepcopy(DEFAULTS)
    data, lines = load_yaml(path)
    validate(data, str(path), lines)
    cfg.update(copy.deepcopy(data))
    return cfg


def resolve(path: os.PathLike | str | None, overrides: dict | None = None) -> dict:
    """DEFAULTS <- YAML file <- overrides (command line; None values are ignored)."""
    cfg = copy.deepcopy(DEFAULTS)
    if path is not None:
        data, lines = load_yaml(path)
        validate(data, str(path), lines)
        cfg.update(copy.deepcopy(data))
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    validate(given, "command line")
    cfg.update(given)
    validate(cfg, str(path) if path else "config")
    for key in ("model", "data"):
        if not cfg[key]:
            raise ConfigError(f"no {key} given: set `{key}:` in the config or pass --{key}")
    accum = cfg["grad_accumulation_steps"]
    for key in ("save_every", "iters"):
        if cfg[key] % accum:
            raise ConfigError(
                f"{key} ({cfg[key]}) must be a multiple of grad_accumulation_steps ({accum}): "
                "a checkpoint or the end of the run must fall on an optimizer update"
            )
    return cfg


def config_hash(cfg: dict) -> str:
    """sha256 over the keys that change the maths (not the RESUMABLE ones)."""
    core = {k: v for k, v in cfg.items() if k not in RESUMABLE}
    return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()


def diff_keys(a: dict, b: dict) -> list[str]:
    """Keys outside RESUMABLE whose values differ between two resolved configs."""
    keys = (set(a) | set(b)) - RESUMABLE
    return sorted(k for k in keys if a.get(k) != b.get(k))


def check_world(cfg: dict, world_size: int) -> None:
    """batch_size is the global batch (mlx-lm's meaning): every rank takes batch_size / world."""
    if cfg["batch_size"] % world_size:
        lo = cfg["batch_size"] - cfg["batch_size"] % world_size
        hint = f"{lo} or {lo + world_size}" if lo else str(world_size)
        raise ConfigError(
            f"batch_size {cfg['batch_size']} is the global batch and must be divisible by the "
            f"world size {world_size} (each rank takes batch_size / {world_size}): use {hint}"
        )


# ---- out of memory -------------------------------------------------------------------
# Error texts of an MLX allocation failure or a Metal GPU fault, as MLX prints them.
OOM_RE = re.compile(
    r"Insufficient Memory|OutOfMemory|out of memory|Unable to allocate|"
    r"\[metal::malloc\]|\[malloc\]|greater than the maximum allowed buffer size|"
    r"kIOGPUCommandBufferCallbackError(?:OutOfMemory|Timeout|ImpactingInteractivity)|"
    r"std::bad_alloc",
    re.I,
)


def set_flag(argv: list[str], flag: str, value: Any) -> list[str]:
    out = list(argv)
    for i, a in enumerate(out):
        if a == flag and i + 1 < len(out):
            out[i + 1] = str(value)
            return out
        if a.startswith(flag + "="):
            out[i] = f"{flag}={value}"
            return out
    return out + [flag, str(value)]


def fallback_ladder(cfg: dict, argv: list[str], world_size: int) -> list[tuple[str, list[str]]]:
    """The out-of-memory rungs as trainer argument lists, each keeping the global batch.

    1. per-rank batch 1, gradient accumulation making up the global batch (iters and
       the step cadences scale with it, since an mlx-lm iteration is one micro-batch);
    2. the same with half the max sequence length.
    """
    per_rank = cfg["batch_size"] // max(world_size, 1)
    factor = max(per_rank, 1)
    accum = cfg["grad_accumulation_steps"] * factor
    rung1 = list(argv)
    for flag, value in (
        ("--batch-size", world_size),
        ("--grad-accumulation-steps", accum),
        ("--iters", cfg["iters"] * factor),
        ("--save-every", cfg["save_every"] * factor),
        ("--steps-per-eval", cfg["steps_per_eval"] * factor),
        ("--steps-per-report", cfg["steps_per_report"] * factor),
    ):
        rung1 = set_flag(rung1, flag, value)
    rung2 = set_flag(rung1, "--max-seq-length", max(cfg["max_seq_length"] // 2, 2))
    rungs = []
    if per_rank > 1:
        rungs.append((f"per-rank batch 1, grad accumulation {accum}, global batch {cfg['batch_size']}", rung1))
    rungs.append((f"as above and max_seq_length {max(cfg['max_seq_length'] // 2, 2)}", rung2))
    return rungs
