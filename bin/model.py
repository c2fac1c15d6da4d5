#!/usr/bin/env python3
"""model: fetch a model from the Hugging Face Hub into MODEL, recording where it came from.

Usage: python bin/model.py --repo ORG/NAME --out DIR [--revision REV] [--quantize 4|8] [--replace]
Example: make model HF_REPO=mlx-community/gemma-4-e2b-it-4bit MODEL=models/gemma-4-e2b-4bit

The revision is pinned to its commit; the files mlx-lm loads are copied (or quantized by mlx-lm's
convert); DIR/provenance.json records repo, commit, each file's sha256, quantization and tools. Offline
(HF_HUB_OFFLINE=1) from the cache. The same model again is a no-op; another is refused unless --replace.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shutil
import sys
from importlib.metadata import version as pkg_version
from pathlib import Path

from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, RevisionResolutionError
from mlx_lm import convert
from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS, load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, paths  # noqa: E402
from lib.hashing import tree_hashes  # noqa: E402
from lib.log import RunbookError, die, event  # noqa: E402

ANCHOR, GROUP_SIZE = "model", 64
REPLACE = "refusing to replace it; on purpose: make model ... REPLACE=1 (--replace); or choose another MODEL"
HUB_FIX = ("check the repository id and revision on huggingface.co (gated: accept its licence there, `hf "
           "auth login`); with HF_HUB_OFFLINE=1 the cache (HF_HOME) must hold it: fetch it where online")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repo", required=True, help="Hugging Face repository id, e.g. google/gemma-4-E2B-it")
    p.add_argument("--out", required=True, type=Path, help="the model folder to write (MODEL)")
    p.add_argument("--revision", default="main", help="branch, tag or commit (default main)")
    p.add_argument("--quantize", type=int, choices=[4, 8], help="bits: quantize with mlx-lm's convert")
    p.add_argument("--replace", action="store_true", help="replace a different model already in --out")
    return p


def hub(what: str, call, *args, **kw):
    """call(*args, **kw) into huggingface_hub; its failure as a RunbookError that names the fix."""
    try:
        return call(*args, **kw)
    except (HfHubHTTPError, RevisionResolutionError, OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise RunbookError(f"{what}: {type(e).__name__}: {first}; {HUB_FIX}", ANCHOR) from e


def hashes(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file but provenance.json (and hidden ones, as sync skips them)."""
    return {f: h for f, h in tree_hashes(folder, ["."]).items() if f != "provenance.json"}


def describe(repo: str, commit: str, quant: dict | None) -> str:
    q = f"{quant['bits']}-bit, group size {quant['group_size']}" if quant else "not quantized here"
    return f"{repo}@{commit[:12]} ({q})"


def already_there(out: Path, repo: str, commit: str, quant: dict | None) -> bool:
    """True when out (which exists) holds exactly this model; a RunbookError if it holds anything else."""
    prov = paths.read_json(out / "provenance.json")  # {} when missing or unreadable
    have, files = (prov.get("repo"), prov.get("commit"), prov.get("quantization")), prov.get("files")
    if not isinstance(files, dict) or None in have[:2]:
        raise RunbookError(f"{out} exists but has no provenance.json from bin/model.py; {REPLACE}", ANCHOR)
    if have != (repo, commit, quant):
        raise RunbookError(f"{out} holds {describe(*have)}, not {describe(repo, commit, quant)}; {REPLACE}",
                           ANCHOR)
    now = hashes(out)
    if changed := sorted(set(now) ^ set(files) | {k for k in files if now.get(k) != files[k]}):
        raise RunbookError(f"{out} holds {describe(*have)} but these files differ from its provenance.json: "
                           f"{', '.join(changed[:5])}; {REPLACE}", ANCHOR)
    return True


def chat_template(tok) -> dict | None:
    """Its sha256, thinking mode and generation-prompt variant: `launch` when the thinking-off prompt ends in
    text the conversation lacks (Gemma 4's launch template: an empty thought channel), else `current`."""
    if not tok.has_chat_template:
        return None
    conv = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    full, prompt = (tok.apply_chat_template(conv[:n], tokenize=False, add_generation_prompt=n == 1,
                                            enable_thinking=False) for n in (2, 1))
    return {"sha256": hashlib.sha256(str(tok.chat_template).encode()).hexdigest(), "has_thinking":
            tok.has_thinking, "variant": "current" if full.startswith(prompt) else "launch"}


def main() -> int:
    args = build_parser().parse_args()
    quant = args.quantize and {"bits": args.quantize, "group_size": GROUP_SIZE, "mode": "affine",
                               "by": "mlx_lm.convert"}
    try:  # the commit a branch or tag points to now (offline: the one the cache's refs/ recorded)
        commit = hub(f"cannot resolve {args.repo}@{args.revision}", HfApi().resolve_revision, args.repo,
                     revision=args.revision, local_files_only=constants.HF_HUB_OFFLINE).resolved
        if not args.replace and args.out.exists() and already_there(args.out, args.repo, commit, quant):
            event("model", status="unchanged", repo=args.repo, revision=args.revision, commit=commit,
                  out=paths.rel(args.out), note="same repo, commit, quantization and bytes: nothing to do")
            return 0
        name = f"{args.repo}@{commit[:12]}"  # fetched: the cache's folder of the files mlx-lm loads
        snapshot = Path(hub(f"cannot fetch {name}", snapshot_download, args.repo, revision=commit,
                            allow_patterns=DEFAULT_ALLOW_PATTERNS))
        need = [f for f in ("config.json", "model*.safetensors") if not list(snapshot.glob(f))]
        if gone := need + paths.missing_shards(snapshot):  # safetensors only; every shard the index names
            raise RunbookError(f"{name} in the cache lacks {', '.join(gone)}: not a model mlx-lm loads, or "
                               "its download stopped; fetch it online (HF_HUB_OFFLINE unset)", ANCHOR)
        config = json.loads((snapshot / "config.json").read_text(encoding="utf-8"))
        with atomic.atomic_dir(args.out) as tmp:
            if not quant:
                shutil.copytree(snapshot, tmp, dirs_exist_ok=True)  # follows the cache's links to blobs
            elif "quantization" in {**config, **config.get("text_config", {})}:
                raise RunbookError(f"{name} is already quantized ({config.get('quantization')}): drop "
                                   "QUANTIZE, or fetch its bf16 original and quantize that", ANCHOR)
            else:
                tmp.rmdir()  # convert writes a folder that does not exist yet; its [INFO] lines to stderr
                with contextlib.redirect_stdout(sys.stderr):
                    convert(hf_path=str(snapshot), mlx_path=str(tmp), quantize=True, q_bits=args.quantize,
                            q_group_size=GROUP_SIZE)
            files, tpl = hashes(tmp), chat_template(load_tokenizer(tmp))
            atomic.write_json(tmp / "provenance.json", {
                "fetched_by": "bin/model.py", "repo": args.repo, "revision": args.revision, "commit": commit,
                "quantization": quant, "repo_quantization": config.get("quantization"), "chat_template": tpl,
                "tools": {m: pkg_version(m) for m in ("mlx", "mlx_lm", "huggingface_hub")}, "files": files})
    except RunbookError as e:
        return die(e)
    except OSError as e:
        return die(RunbookError(f"cannot write {args.out}: {e}; check the folder is writable and the disk "
                                "has room for the model twice (the cache and MODEL)", ANCHOR))
    event("model", status="fetched", repo=args.repo, revision=args.revision, commit=commit,
          quantize=args.quantize or "none", files=len(files), out=paths.rel(args.out),
          chat_template=json.dumps(tpl),
          bytes=sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
