"""Run configs: mlx-lm lora keys (same names, same meaning) plus the runbook's own; no mlx imported.

Precedence is mlx-lm's: command line, then the YAML file, then DEFAULTS. Unlike mlx-lm, an unknown key or
a wrong type is an error naming the key, the file and the line. `1e-5` is a float, as in mlx-lm's lora.py.

    from lib import config
    cfg = config.resolve("configs/smoke.yaml", {"model": "models/tiny-gemma4", "data": "datasets/d"})
    config.config_hash(cfg)               # what a resume must match
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import math
import re
from pathlib import Path

import yaml

from lib import paths
from lib.log import STABILITY, RunbookError, anchor_of, event

# SafeLoader with mlx_lm/lora.py's float resolver: `1e-5` and `.5` are floats, as in YAML 1.2.
_Loader = type("_Loader", (yaml.SafeLoader,), {})
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile("""^(?:
     [-+]?(?:[0-9][0-9_]*)\\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\\.[0-9_]*
    |[-+]?\\.(?:inf|Inf|INF)
    |\\.(?:nan|NaN|NAN))$""", re.X), list("-+0123456789."))

ANCHOR = "run-configs"
OPTIMIZERS = ("adam", "adamw", "muon", "sgd", "adafactor")

# mlx-lm keys refused with the reason (they mean something else in a runbook run).
REFUSED = {"hf_dataset": "Hugging Face datasets are not used: export to datasets/NAME and set data",
           "adapter_path": "the trainer writes the adapter to RUN_DIR/adapters; remove the key",
           "config": "a config cannot name another config"}

# Keys a resume may change; everything else is in config_hash() and must match.
RESUMABLE = {"model", "data", "iters", "steps_per_report", "save_every", "keep_last_k", "watchdog_s", "test",
             "test_batches", "clear_cache_threshold", "trust_remote_code", "resume_adapter_file", "report_to",
             "project_name", "rank_shares"}  # shares: token-weighted, every split is the same global batch


def _is(want: str, test):
    return lambda v: None if test(v) else want


def _in(*choices: str):
    return _is(f"one of {', '.join(choices)}", lambda v: v in choices)


def _int(lo: int, *allow: int):
    want = f"an integer >= {lo}" + (f" (or {', '.join(map(str, allow))})" if allow else "")
    return _is(want, lambda v: type(v) is int and (v >= lo or v in allow))


def _num(above: float | None = None):
    want = "a finite number" + (f" > {above:g}" if above is not None else "")
    return _is(want, lambda v: type(v) in (int, float) and math.isfinite(v) and (above is None or v > above))


def _lora(v):
    d = v if isinstance(v, dict) else {}
    extra = "".join(f"; not {k!r}" for k in sorted(set(d) - {"rank", "scale", "dropout", "keys"}))
    ok = (not extra and {"rank", "scale", "dropout"} <= set(d) and _int(1)(d["rank"]) is None
          and _num()(d["scale"]) is None and _num()(d["dropout"]) is None and 0 <= d["dropout"] < 1
          and isinstance(keys := d.get("keys", []), list) and all(isinstance(x, str) for x in keys))
    return None if ok else ("mlx-lm's mapping of rank (an integer >= 1), scale (a finite number), dropout "
                            f"(>= 0, < 1) and optional keys (a list of module names){extra}")


_bool = _is("true or false", lambda v: isinstance(v, bool))
_str = _is("a non-empty string", lambda v: isinstance(v, str) and v != "")
_opt_str = _is("null or a non-empty string", lambda v: v is None or _str(v) is None)
_opt_pos = _is("null or a finite number > 0", lambda v: v is None or _num(0)(v) is None)

# key: (default, check): mlx-lm's CONFIG_DEFAULTS (mlx_lm/lora.py) minus the refused keys, then the runbook's.
KEYS = {
    "model": (None, _opt_str), "data": (None, _opt_str),
    "train": (True, _is("true (the trainer always trains)", lambda v: v is True)),
    "fine_tune_type": ("lora", _in("lora", "dora", "full")), "optimizer": ("adam", _in(*OPTIMIZERS)),
    # the trainer refuses (as a config error) what mlx-lm's optimizers and build_schedule do not take
    "optimizer_config": ({k: {} for k in OPTIMIZERS}, _is(
        f"a mapping of optimizer name ({', '.join(OPTIMIZERS)}) -> mapping of keyword arguments",
        lambda v: isinstance(v, dict) and set(v) <= set(OPTIMIZERS)
        and all(isinstance(x, dict) for x in v.values()))),
    "lr_schedule": (None, _is(
        "null or a mapping with name and a non-empty list of arguments (mlx.optimizers.schedulers)",
        lambda v: v is None or (isinstance(v, dict) and isinstance(v.get("name"), str)
                                and isinstance(v.get("arguments"), list) and len(v["arguments"]) > 0))),
    "seed": (0, _int(0)),
    "num_layers": (16, _int(1, -1)), "batch_size": (4, _int(1)), "iters": (1000, _int(1)),
    "val_batches": (25, _int(0, -1)),
    "learning_rate": (1e-5, _is("a number", lambda v: type(v) in (int, float))),
    "steps_per_report": (10, _int(1)), "steps_per_eval": (200, _int(1)), "save_every": (100, _int(1)),
    "resume_adapter_file": (None, _opt_str), "test": (False, _bool), "test_batches": (500, _int(0, -1)),
    "max_seq_length": (2048, _int(2)), "grad_checkpoint": (False, _bool),
    "grad_accumulation_steps": (1, _int(1)), "clear_cache_threshold": (0, _int(0)),
    "lora_parameters": ({"rank": 8, "dropout": 0.0, "scale": 20.0}, _lora),
    # W&B from rank 0 (lib/tracking.py); mlx-lm's swanlab is not wired in
    "report_to": (None, _is("null or wandb (swanlab is not wired in)", lambda v: v in (None, "wandb"))),
    "project_name": (None, _opt_str),  # W&B's project (null: thunder-runbook)
    # true: every assistant turn is a target; last: the last one only (mlx-lm's true); false: all tokens
    "mask_prompt": (False, _is("true, false or last", lambda v: v in (True, False, "last"))),
    "trust_remote_code": (False, _bool), "chat_feature": ("messages", _str),
    "prompt_feature": ("prompt", _str), "completion_feature": ("completion", _str),
    "text_feature": ("text", _str),
    "keep_last_k": (3, _int(2)),  # checkpoints kept besides the best-by-validation and the final one
    "watchdog_s": (None, _opt_pos),  # orchestrator watchdog window (s); null = max(10 x median step, 300)
    "divergence_factor": (4.0, _num(1)),  # a loss above this x the first step's within the
    "divergence_window": (50, _int(0)),  # first divergence_window steps stops the run (NaN/inf: any step)
    # default: mlx-lm's default_loss; chunked: lib/loss.py, loss_chunk_tokens rows of hidden states a chunk
    "loss": ("default", _in("default", "chunked")), "loss_chunk_tokens": (64, _int(1)),
    "grad_average": ("mlx_lm", _in("mlx_lm", "tokens")),  # mean of rank means, or sum / global tokens
    "max_grad_norm": (None, _opt_pos),  # clip the global gradient norm before the step (null: no clipping)
    # each rank's share of the global batch, in the hostfile's order (null: even; auto: by calibration)
    "rank_shares": (None, _is("null, auto, or a list of integers >= 1, one per rank in the hostfile's order",
                              lambda v: v is None or v == "auto" or isinstance(v, list) and len(v) > 0
                              and all(type(x) is int and x >= 1 for x in v))),
    # length: the trainer's batches by real length, reshuffled each epoch, answers as served
    # (lib/batching.py, lib/chat.py Renderer); mlx_lm: mlx-lm 0.32.2's batches and masks, exactly
    "batching": ("length", _in("length", "mlx_lm")),
    # multiply each record's target losses by its `weight` (0: the record is not trained)
    "record_weights": (False, _bool),
    # refuse to train when more than this fraction of the train records lose their whole answer to
    # max_seq_length; below it they are left out and counted
    "max_lost_answers": (0.01, _is("a number >= 0 and <= 1", lambda v: type(v) in (int, float)
                                   and 0 <= v <= 1)),
    # mlx-lm's name: keyword arguments of every chat-template rendering (lib/chat.py), e.g. enable_thinking
    "chat_template_args": (None, _is("null or a mapping of keyword arguments, e.g. {enable_thinking: false}",
                                     lambda v: v is None or isinstance(v, dict)
                                     and all(str(k).isidentifier() for k in v))),
}
DEFAULTS = {k: default for k, (default, _) in KEYS.items()}


class ConfigError(RunbookError):
    def __init__(self, message: str, category: str | None = None):
        super().__init__(message, anchor_of(category) if category else ANCHOR, category)


def validate(cfg: dict, source: str = "config", lines: dict[str, int] | None = None) -> dict:
    """Refuse unknown keys, wrong types and inconsistent values; returns cfg."""
    where = {k: f"{source}:{n}" for k, n in (lines or {}).items()}
    for key in cfg:
        if key in REFUSED:
            raise ConfigError(f"{where.get(key, source)}: key {key!r} is not supported: {REFUSED[key]}")
        if key not in DEFAULTS:
            near = "".join(f" (did you mean {k!r}?)" for k in difflib.get_close_matches(str(key), KEYS, 1))
            raise ConfigError(f"{where.get(key, source)}: unknown config key {key!r}{near}; keys are mlx-lm "
                              "lora's plus the runbook's (lib/config.py DEFAULTS)")
        if (why := KEYS[key][1](cfg[key])) is not None:
            raise ConfigError(f"{where.get(key, source)}: {key} must be {why}, got {cfg[key]!r}")
    if not math.isfinite(lr := cfg.get("learning_rate", 1.0)) or lr <= 0:
        raise ConfigError(f"{where.get('learning_rate', source)}: learning_rate is {lr!r}: it must be a "
                          "finite number > 0 (LoRA is stable around 1e-5 to 1e-4 here)", category=STABILITY)
    return cfg


def load_config(path: str | Path) -> dict:
    """DEFAULTS <- the YAML file, validated; model and data may be unset (the orchestrator passes them)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        node, data = yaml.compose(text, Loader=_Loader), yaml.load(text, Loader=_Loader)
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        at = f":{e.problem_mark.line + 1}" if getattr(e, "problem_mark", None) else ""
        raise ConfigError(f"{path}{at}: invalid YAML: {getattr(e, 'problem', e)}") from e
    if not isinstance(data, dict | None):
        raise ConfigError(f"{path}: a config is a mapping of key: value, not {type(data).__name__}")
    lines = {k.value: k.start_mark.line + 1 for k, _ in node.value} if data else {}
    # mlx-lm writes every key, `hf_dataset: null` too: a refused key set to null is not set.
    data = {k: v for k, v in (data or {}).items() if not (k in REFUSED and v is None)}
    return {**copy.deepcopy(DEFAULTS), **copy.deepcopy(validate(data, str(path), lines))}


def resolve(path: str | Path | None, overrides: dict | None = None) -> dict:
    """DEFAULTS <- YAML file <- overrides (command line; None values are ignored)."""
    cfg = load_config(path) if path is not None else copy.deepcopy(DEFAULTS)
    cfg.update(validate({k: v for k, v in (overrides or {}).items() if v is not None}, "command line"))
    for key in ("model", "data"):
        if not cfg[key]:
            raise ConfigError(f"no {key} given: set `{key}:` in the config or pass --{key}")
    if cfg["rank_shares"] and cfg["grad_average"] != "tokens":
        raise ConfigError(f"rank_shares {cfg['rank_shares']} needs `grad_average: tokens`: only a token-"
                          "weighted gradient is the same however the global batch is split")
    if cfg["batching"] == "mlx_lm" and cfg["record_weights"]:
        raise ConfigError("record_weights needs `batching: length`: mlx-lm's batches carry no weights")
    for key in ("save_every", "iters"):
        if cfg[key] % cfg["grad_accumulation_steps"]:
            raise ConfigError(f"{key} ({cfg[key]}) must be a multiple of grad_accumulation_steps "
                              f"({cfg['grad_accumulation_steps']}): checkpoints and the end are updates")
    return cfg


def config_hash(cfg: dict) -> str:
    """sha256 over the keys that change the maths (not the RESUMABLE ones)."""
    core = {k: v for k, v in cfg.items() if k not in RESUMABLE}
    return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()


def diff_keys(a: dict, b: dict) -> list[str]:
    """Keys outside RESUMABLE whose values differ between two resolved configs."""
    return sorted(k for k in (set(a) | set(b)) - RESUMABLE if a.get(k) != b.get(k))


def rank_batches(cfg: dict, world_size: int) -> list[int]:
    """Each rank's records of the global batch: batch_size / W each (mlx-lm's rule), or with rank_shares in
    their proportion, whole records (the largest remainders get the rest), none at zero. One rank takes it
    all (the control). rank_shares: auto must have been resolved (lib/launch.py) before this."""
    bs, shares = cfg["batch_size"], cfg["rank_shares"]
    if not shares or world_size == 1:
        check_world(cfg, world_size)
        return [bs // world_size] * world_size
    if shares == "auto":  # the launcher resolves it (lib/launch.py) and passes each rank --rank-shares
        raise ConfigError("rank_shares: auto reached a rank unresolved: launch through make (or bin/run.py), "
                          "which takes the shares from the newest calibration")
    if not isinstance(shares, list) or len(shares) != world_size:
        raise ConfigError(f"rank_shares {shares} is not one share per rank: the hostfile has {world_size} "
                          "ranks (its hosts' order is the ranks')")
    if bs < world_size:
        raise ConfigError(f"batch_size {bs} cannot give each of {world_size} ranks a record: raise it")
    exact = [bs * s / sum(shares) for s in shares]
    n = [max(1, math.floor(x)) for x in exact]
    for _ in range(abs(bs - sum(n))):  # to bs: +1 where most is missing, -1 where most is over (never to 0)
        i = max((j for j in range(world_size) if sum(n) < bs or n[j] > 1),
                key=lambda j: (exact[j] - n[j]) * (1 if sum(n) < bs else -1))
        n[i] += 1 if sum(n) < bs else -1
    return n


SHARE_KEYS = ("batch_size", "max_seq_length", "num_layers", "lora_parameters", "grad_checkpoint")


def calibrated_shares(hosts: list[str], cfg: dict, config: str) -> list[int]:
    """rank_shares: auto: the newest calibration's shares for these hosts (in this order), measured with this
    config's batch and the settings that shape a step (SHARE_KEYS)."""
    for path in sorted(paths.RUNS.glob("calibration-*.json"), reverse=True):
        doc = paths.read_json(path)
        if [h["ssh"] for h in doc.get("hostfile", {}).get("hosts", [])] == hosts and doc.get("rank_shares") \
                and all(doc.get("config", {}).get(k) == cfg.get(k) for k in SHARE_KEYS):
            event("rank-shares", calibration=paths.rel(path), shares=json.dumps(doc["rank_shares"]["shares"]),
                  rule=doc["rank_shares"]["rule"])
            return doc["rank_shares"]["shares"]
    raise ConfigError(f"{config}: rank_shares: auto, but runs/ has no calibration of these hosts "
                      f"({', '.join(hosts)}) at batch_size {cfg['batch_size']} (and this config's "
                      f"{', '.join(SHARE_KEYS[1:])}): run `make calibrate` with it first, or write the "
                      "shares")


def check_world(cfg: dict, world_size: int) -> None:  # batch_size is the global batch, as in mlx-lm
    if cfg["batch_size"] % world_size:
        lo = cfg["batch_size"] - cfg["batch_size"] % world_size
        raise ConfigError(f"batch_size {cfg['batch_size']} is the global batch and must be divisible by the "
                          f"world size {world_size} (each rank takes batch_size / {world_size}): use "
                          f"{f'{lo} or {lo + world_size}' if lo else world_size}")


def set_flag(argv: list[str], flag: str, value: object) -> list[str]:
    """argv with `flag value` replaced, or appended (lib/launch.py writes every flag apart from its value)."""
    i = argv.index(flag) if flag in argv else len(argv)
    return [*argv[:i], flag, str(value), *argv[i + 2:]]


def fallback_ladder(cfg: dict, argv: list[str], world_size: int) -> list[tuple[str, list[str]]]:
    """The out-of-memory rungs, each keeping the global batch: per-rank batch 1 with gradient accumulation
    (iters and cadences scale: an mlx-lm iteration is one micro-batch), then also half max_seq_length. A
    value the launch's argv sets (smoke's --iters) wins over the config's."""
    def now(key: str) -> int:
        flag = "--" + key.replace("_", "-")
        return int(argv[argv.index(flag) + 1]) if flag in argv[:-1] else cfg[key]

    factor = max(now("batch_size") // max(world_size, 1), 1)
    accum = now("grad_accumulation_steps") * factor
    rung1 = set_flag(set_flag(list(argv), "--batch-size", world_size), "--grad-accumulation-steps", accum)
    for key in ("iters", "save_every", "steps_per_eval", "steps_per_report"):
        rung1 = set_flag(rung1, "--" + key.replace("_", "-"), now(key) * factor)
    half = max(now("max_seq_length") // 2, 2)
    first = f"per-rank batch 1, grad accumulation {accum}, global batch {now('batch_size')}"
    rungs = [(first, rung1)] if factor > 1 else []
    return rungs + [(f"as above and max_seq_length {half}", set_flag(rung1, "--max-seq-length", half))]
