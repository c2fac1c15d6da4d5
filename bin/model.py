#!/usr/bin/env python3
"""model: fetch a model from the Hugging Face Hub into MODEL, recording where it came from.

Usage:
    python bin/model.py --repo ORG/NAME --out DIR [--revision REV] [--quantize 4|8] [--group-size N] [--replace]

Example:
    make model HF_REPO=mlx-community/gemma-4-e2b-it-4bit MODEL=models/gemma-4-e2b-4bit

The revision is pinned to its commit; the files mlx-lm fetches are copied (or quantized with mlx-lm's
convert) and DIR/provenance.json records repo, commit, every file's sha256, quantization and tool versions.
HF_HUB_OFFLINE=1 works from the cache. The same model again is a no-op; another is refused unless --replace.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
from importlib.metadata import version as pkg_version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, paths  # noqa: E402
from lib.hashing import sha256_file  # noqa: E402
from lib.log import RunbookError, die, event  # noqa: E402

ANCHOR = "model"
TOOLS = {"mlx": "mlx", "mlx_lm": "mlx-lm", "huggingface_hub": "huggingface_hub"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--repo", required=True, help="Hugging Face repository id, e.g. google/gemma-4-E2B-it")
    p.add_argument("--out", required=True, type=Path, help="the model folder to write (MODEL)")
    p.add_argument("--revision", default="main", help="branch, tag or commit (default main)")
    p.add_argument("--quantize", type=int, choices=[4, 8], help="bits: quantize with mlx-lm's convert")
    p.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128], help="quantization group size (64)")
    p.add_argument("--replace", action="store_true", help="replace a different model already in --out")
    return p


def hub(what: str, call, *args, **kw):
    """call(*args, **kw) into huggingface_hub; its failure as a RunbookError that names the fix."""
    from huggingface_hub.errors import HfHubHTTPError, RevisionResolutionError

    try:
        return call(*args, **kw)
    except (HfHubHTTPError, RevisionResolutionError, OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise RunbookError(
            f"{what}: {type(e).__name__}: {first}; check the repository id and revision on huggingface.co "
            "(a gated model: accept its licence there and run `hf auth login`); with HF_HUB_OFFLINE=1 the "
            "Hugging Face cache (HF_HOME) must already hold it: fetch once where the Hub is reachable", ANCHOR) from e


def hashes(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file but provenance.json."""
    return {p.relative_to(folder).as_posix(): sha256_file(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.relative_to(folder).as_posix() != "provenance.json"}


def describe(repo: str, commit: str, quant: dict | None) -> str:
    q = f"{quant['bits']}-bit, group size {quant['group_size']}" if quant else "not quantized here"
    return f"{repo}@{commit[:12]} ({q})"


def already_there(out: Path, repo: str, commit: str, quant: dict | None) -> bool:
    """True when out holds exactly this model; a RunbookError when it holds anything else."""
    if not out.exists():
        return False
    how = "to replace it on purpose: make model ... REPLACE=1 (bin/model.py --replace); or choose another MODEL"
    try:
        prov = json.loads((out / "provenance.json").read_text(encoding="utf-8"))
        have, files = (prov["repo"], prov["commit"], prov["quantization"]), prov["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RunbookError(f"{out} exists but has no provenance.json from bin/model.py ({type(e).__name__}: {e}); "
                           f"refusing to replace it; {how}", ANCHOR) from e
    if have != (repo, commit, quant):
        raise RunbookError(f"{out} holds {describe(*have)}, not {describe(repo, commit, quant)}; "
                           f"refusing to replace it; {how}", ANCHOR)
    now = hashes(out)
    changed = sorted(set(now) ^ set(files) | {k for k in files if now.get(k) != files[k]})
    if changed:
        raise RunbookError(f"{out} holds {describe(*have)} but these files differ from its provenance.json: "
                           f"{', '.join(changed[:5])}; refusing to replace it; {how}", ANCHOR)
    return True


def build(snapshot: Path, tmp: Path, args: argparse.Namespace, config: dict) -> None:
    """Fill tmp: the snapshot's files as they are, or quantized by mlx-lm's own convert."""
    if args.quantize:
        from mlx_lm import convert
        if "quantization" in config or "quantization" in config.get("text_config", {}):
            raise RunbookError(f"the repository is already quantized ({config.get('quantization')}): drop "
                               "QUANTIZE (--quantize), or fetch its bf16 original and quantize that", ANCHOR)
        tmp.rmdir()  # convert writes a folder that does not exist yet
        with contextlib.redirect_stdout(sys.stderr):  # convert's [INFO] lines; stdout is our one event line
            convert(hf_path=str(snapshot), mlx_path=str(tmp), quantize=True, q_bits=args.quantize,
                    q_group_size=args.group_size)
        return
    for src in sorted(p for p in snapshot.rglob("*") if p.is_file()):
        dest = tmp / src.relative_to(snapshot)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)  # follows the cache's link to its blob


def main() -> int:
    args = build_parser().parse_args()
    from huggingface_hub import HfApi, constants, snapshot_download
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS
    quant = {"bits": args.quantize, "group_size": args.group_size, "mode": "affine", "by": "mlx_lm.convert"} \
        if args.quantize else None
    try:  # the commit a branch or tag points to now (offline: the one the cache's refs/ recorded)
        commit = hub(f"cannot resolve {args.repo}@{args.revision}", HfApi().resolve_revision, args.repo,
                     revision=args.revision, local_files_only=constants.HF_HUB_OFFLINE).resolved
        if not args.replace and already_there(args.out, args.repo, commit, quant):
            event("model", status="unchanged", repo=args.repo, revision=args.revision, commit=commit,
                  out=paths.rel(args.out), note="same repo, commit, quantization and bytes: nothing to do")
            return 0
        snapshot = Path(hub(f"cannot fetch {args.repo}@{commit[:12]}", snapshot_download, args.repo, revision=commit,
                            allow_patterns=DEFAULT_ALLOW_PATTERNS))  # the cache's folder, with mlx-lm's files
        if not (snapshot / "config.json").is_file() or not list(snapshot.glob("model*.safetensors")):
            raise RunbookError(f"{args.repo}@{commit[:12]} has no config.json and model*.safetensors: "
                               "not a model mlx-lm loads (safetensors only)", ANCHOR)
        if gone := paths.missing_shards(snapshot):
            raise RunbookError(f"{args.repo}@{commit[:12]} is incomplete in the cache: model.safetensors.index.json "
                               f"names {', '.join(gone)}, never downloaded; fetch it online (HF_HUB_OFFLINE unset)",
                               ANCHOR)
        config = json.loads((snapshot / "config.json").read_text(encoding="utf-8"))
        with atomic.atomic_dir(args.out) as tmp:
            build(snapshot, tmp, args, config)
            files = hashes(tmp)
            atomic.write_json(tmp / "provenance.json", {
                "fetched_by": "bin/model.py", "repo": args.repo, "revision": args.revision, "commit": commit,
                "quantization": quant, "repo_quantization": config.get("quantization"),
                "tools": {name: pkg_version(dist) for name, dist in TOOLS.items()}, "files": files,
            })
    except RunbookError as e:
        return die(e)
    except OSError as e:
        return die(RunbookError(f"cannot write {args.out}: {e}; check the folder is writable and the disk has "
                                "room for the model twice (the cache and MODEL)", ANCHOR))
    event("model", status="fetched", repo=args.repo, revision=args.revision, commit=commit,
          quantize=args.quantize or "none", files=len(files), out=paths.rel(args.out),
          bytes=sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
