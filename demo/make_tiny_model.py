#!/usr/bin/env python3
"""tiny-model: a randomly initialized model that mlx-lm loads, for tests and the demo.

Usage:
    python demo/make_tiny_model.py --arch gemma4|llama --seed N --out DIR [--layout text|released]
        [--quantize 4|8] [--template launch|current] [--vocab-size N] [--dtype float32|bfloat16|float16] [--force]

Example:
    .venv/bin/python demo/make_tiny_model.py --arch gemma4 --layout released --quantize 4 --out models/tiny-q4

DIR gets the Hugging Face layout mlx-lm loads offline: config.json, model.safetensors (Linear and
Embedding ~ N(0, 0.02^2) seeded by (seed, sha256(name))), a byte-level BPE tokenizer trained here on
`pydoc_data.topics` with the family's specials and chat template, and provenance.json. gemma4 keeps Gemma 4
E2B's traits at toy sizes (sliding/full attention, KV sharing, per-layer inputs, soft-capping), Gemma 4's
special tokens at their ids, its chat format (--template: the launch or the current generation prompt) and
generation_config.json's eos ids, and widths that quantize at group size 64 as the real ones do; --layout
released is the `gemma4` wrapper (text weights under model.language_model.*, stand-in towers mlx-lm drops);
--quantize runs mlx-lm's quantize_model. Same seed and versions, same bytes. The folder is loaded back and
checked before it replaces DIR, and only a DIR this script made (or --force).
"""

from __future__ import annotations

import os

# Before `tokenizers` is imported: single-threaded training is what makes it reproducible.
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
from importlib.metadata import version as pkg_version  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, paths  # noqa: E402
from lib.hashing import sha256_file  # noqa: E402
from lib.log import RunbookError, die, event  # noqa: E402

GENERATOR = "demo/make_tiny_model.py"
VERSION = 3
ANCHOR = "generated-inputs"
INIT_STD = 0.02
GROUP_SIZE = 64  # mlx-lm's default affine group size (mlx_lm convert -q)
# Shape-only stand-ins for the released checkpoint's vision and audio towers (mlx-lm drops them).
TOWERS = {
    "model.vision_tower.patch_embedder.input_proj.weight": (32, 48),
    "model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight": (32, 32),
    "model.vision_tower.encoder.layers.0.mlp.down_proj.linear.weight": (32, 64),
    "model.embed_vision.embedding_projection.weight": (64, 32),
    "model.audio_tower.layers.0.self_attn.q_proj.linear.weight": (32, 32),
    "model.audio_tower.layers.0.feed_forward1.ffw_layer_2.linear.weight": (32, 64),
    "model.embed_audio.embedding_projection.weight": (64, 32),
}
MAX_POSITIONS = 4096
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def chat_template(assistant: str, head: str, tail: str) -> str:
    """A family's turn format in Jinja: `head` + content + `tail` per message (head sees `role`, the
    assistant's named `assistant`); a system message only first; add_generation_prompt opens the assistant's turn."""
    return (
        "{{- bos_token -}}\n"
        "{%- for message in messages -%}\n"
        "  {%- if message['role'] == 'system' and not loop.first -%}\n"
        "    {{- raise_exception('a system message must come first') -}}\n"
        "  {%- endif -%}\n"
        "  {%- if message['role'] not in ['system', 'user', 'assistant'] -%}\n"
        "    {{- raise_exception('unknown role: ' + message['role']) -}}\n"
        "  {%- endif -%}\n"
        "  {%- set role = '@A@' if message['role'] == 'assistant' else message['role'] -%}\n"
        "  {%- if message['content'] is string -%}{%- set content = message['content'] -%}\n"
        "  {%- else -%}{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
        " | map(attribute='text') | join('\\n') -%}\n"
        "  {%- endif -%}\n"
        "  {{- @H@ + content | trim + @T@ -}}\n"
        "{%- endfor -%}\n"
        "{%- if add_generation_prompt -%}{%- set role = '@A@' -%}{{- @H@ -}}{%- endif -%}\n"
    ).replace("@A@", assistant).replace("@H@", head).replace("@T@", tail)


def gemma4_template(variant: str) -> str:
    """Gemma 4's turn format in Jinja, written here from its description (not Google's template): <bos>;
    a system turn when the first message is system/developer or enable_thinking is on (<|think|> first in
    it); `<|turn>ROLE\n` + trimmed content + `<turn|>\n` per message, the assistant's role written `model`
    and its thought channels (<|channel>...<channel|>) dropped; add_generation_prompt opens `<|turn>model\n`,
    and in the launch variant, with thinking off, an empty thought channel follows it."""
    empty = "{%- if not thinking -%}{{- '<|channel>thought\\n<channel|>' -}}{%- endif -%}"
    return (
        "{%- macro text(content, model) -%}\n"
        "  {%- set ns = namespace(out='', kept='') -%}\n"
        "  {%- for part in ([{'type': 'text', 'text': content}] if content is string else content) -%}\n"
        "    {%- if part['type'] == 'text' and model -%}\n"
        "      {%- set pieces = part['text'].split('<|channel>') -%}{%- set ns.kept = pieces[0] -%}\n"
        "      {%- for p in pieces[1:] if '<channel|>' in p -%}"
        "{%- set ns.kept = ns.kept + p.split('<channel|>', 1)[1] -%}{%- endfor -%}\n"
        "      {%- set ns.out = ns.out + ns.kept | replace('<channel|>', '') | trim -%}\n"
        "    {%- elif part['type'] == 'text' -%}{%- set ns.out = ns.out + part['text'] | trim -%}\n"
        "    {%- endif -%}\n"
        "  {%- endfor -%}\n"
        "  {{- ns.out -}}\n"
        "{%- endmacro -%}\n"
        "{%- set thinking = enable_thinking is defined and enable_thinking -%}\n"
        "{%- set system = messages and messages[0]['role'] in ['system', 'developer'] -%}\n"
        "{{- bos_token -}}\n"
        "{%- if thinking or system -%}\n"
        "  {{- '<|turn>system\\n' + ('<|think|>' if thinking else '') -}}\n"
        "  {%- if system -%}{{- text(messages[0]['content'], false) -}}{%- endif -%}\n"
        "  {{- '<turn|>\\n' -}}\n"
        "{%- endif -%}\n"
        "{%- for message in (messages[1:] if system else messages) -%}\n"
        "  {%- if message['role'] in ['system', 'developer'] -%}\n"
        "    {{- raise_exception('a system message must come first') -}}\n"
        "  {%- elif message['role'] not in ['user', 'assistant'] -%}\n"
        "    {{- raise_exception('unknown role: ' + message['role']) -}}\n"
        "  {%- endif -%}\n"
        "  {%- set model = message['role'] == 'assistant' -%}\n"
        "  {{- '<|turn>' + ('model' if model else 'user') + '\\n' + text(message['content'], model) + '<turn|>\\n' -}}\n"
        "{%- endfor -%}\n"
        "{%- if add_generation_prompt -%}\n"
        "  {{- '<|turn>model\\n' -}}" + (empty if variant == "launch" else "") + "\n"
        "{%- endif -%}\n"
    )


# Gemma 4's special tokens at Gemma 4's ids (the other ids below 107 are placeholders); "\n" is id 107.
GEMMA4_SPECIALS = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>", 46: "<|tool>", 47: "<tool|>",
                   48: "<|tool_call>", 49: "<tool_call|>", 50: "<|tool_response>", 51: "<tool_response|>",
                   52: '<|"|>', 98: "<|think|>", 100: "<|channel>", 101: "<channel|>", 105: "<|turn>",
                   106: "<turn|>"}
GEMMA4_NEWLINE = 107
# Each family's special tokens, in id order (ids 0..n-1), and its turn format.
FAMILIES = {
    "gemma4": {
        "specials": [GEMMA4_SPECIALS.get(i, f"<unused{i}>") for i in range(GEMMA4_NEWLINE)],
        "named": list(GEMMA4_SPECIALS.values()), "newline": GEMMA4_NEWLINE,
        "bos": "<bos>", "eos": "<eos>", "pad": "<pad>", "unk": "<unk>",
        "turn_markers": ["<|turn>", "<turn|>"], "stop": ["<eos>", "<turn|>"],  # config.json's eos_token_id
        "generation_stop": ["<eos>", "<turn|>", "<|tool_response>"],  # generation_config.json's (mlx-lm reads it)
    },
    "llama": {
        "specials": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                     "<|eot_id|>", "<|finetune_right_pad_id|>"],
        "bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "pad": "<|finetune_right_pad_id|>", "unk": None,
        "turn_markers": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "stop": ["<|end_of_text|>", "<|eot_id|>"],
        # Llama 3's format: <|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n...<|eot_id|>
        "chat_template": chat_template("assistant", "'<|start_header_id|>' + role + '<|end_header_id|>\\n\\n'",
                                       "'<|eot_id|>'"),
    },
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--arch", required=True, choices=sorted(FAMILIES))
    p.add_argument("--seed", type=int, default=0, help="weight init seed (default 0)")
    p.add_argument("--out", required=True, type=Path, help="model folder to (re)write")
    p.add_argument("--vocab-size", type=int, default=3072, help="BPE vocabulary incl. specials (default 3072)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--layout", default="text", choices=["text", "released"], help="gemma4: released = the wrapper")
    p.add_argument("--quantize", type=int, choices=[4, 8], help="bits: quantize with mlx-lm's quantize_model")
    p.add_argument("--template", default="launch", choices=["launch", "current"], help="gemma4's chat template: "
                   "launch = thinking-off generation prompt ends in an empty thought channel (default), current = not")
    p.add_argument("--force", action="store_true", help="replace --out even if this script did not make it")
    return p


def model_config(arch: str, tok: dict, vocab: int, dtype: str, seed: int) -> dict:
    ids, fam = tok["ids"], FAMILIES[arch]
    common = {
        "bos_token_id": ids[fam["bos"]], "eos_token_id": [ids[t] for t in fam["stop"]], "pad_token_id": ids[fam["pad"]],
        "vocab_size": vocab, "max_position_embeddings": MAX_POSITIONS, "initializer_range": INIT_STD, "torch_dtype": dtype,
        "thunder_runbook": {"generator": GENERATOR, "generator_version": VERSION, "arch": arch, "seed": seed,
                            "note": "random weights for tests and the demo; not a trained model"},
    }
    if arch == "gemma4":
        return {
            **common, "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6, "sliding_window": 64,
            # 2 sliding : 1 full; the last layer is full attention, as in Gemma 4
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "global_head_dim": 32,
            # the last 2 layers reuse the K/V of the last sliding and full layer before them
            "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
            # 64 (E2B: 256): the per-layer table (vocab x 6 x 64) and projections quantize at group size 64
            "hidden_size_per_layer_input": 64, "vocab_size_per_layer_input": vocab,
            "rope_parameters": {
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
            },
            "attention_k_eq_v": False, "enable_moe_block": False, "final_logit_softcapping": 30.0,
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        }
    return {
        **common, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 176, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False}


def training_text() -> tuple[list[str], str]:
    """The tokenizer's training text (pydoc topics, sorted) and its sha256."""
    from pydoc_data.topics import topics  # ships with every CPython

    h = hashlib.sha256(b"".join(k.encode() + b"\0" + topics[k].encode() + b"\0" for k in sorted(topics)))
    return [topics[k] for k in sorted(topics)], h.hexdigest()


def train_tokenizer(arch: str, vocab_size: int, texts: list[str]) -> dict:
    import tokenizers as tk

    fam = FAMILIES[arch]
    tok = tk.Tokenizer(tk.models.BPE())
    # Llama 3's split: a newline run is one piece whether text follows it or not, so a chat
    # template's generation prompt ("...\n\n") stays a token prefix of the full conversation.
    tok.pre_tokenizer = tk.pre_tokenizers.Sequence([
        tk.pre_tokenizers.Split(tk.Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[tk.AddedToken(s, special=True, normalized=False) for s in fam["specials"]], show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    if "newline" in fam:  # "\n" (byte-level "Ċ") moves to its id, the token there to "\n"'s (merges name strings)
        spec = json.loads(tok.to_str())
        vocab, nl = spec["model"]["vocab"], "\u010a"
        there = next(t for t, i in vocab.items() if i == fam["newline"])
        vocab[there], vocab[nl] = vocab[nl], fam["newline"]
        tok = tk.Tokenizer.from_str(json.dumps(spec))
    ids = {s: tok.token_to_id(s) for s in fam["specials"]}
    if [ids[s] for s in fam["specials"]] != list(range(len(fam["specials"]))) or (
            "newline" in fam and tok.encode("\n", add_special_tokens=False).ids != [fam["newline"]]):
        raise RunbookError(f"special tokens did not get ids 0..n-1 (or \\n its id): {ids}", ANCHOR)
    ids = {s: ids[s] for s in fam.get("named", fam["specials"])}
    bos = fam["bos"]
    # Plain encode() adds the BOS, as Gemma's and Llama 3's tokenizers do; chat templates
    # write their own, and apply_chat_template encodes without special tokens.
    tok.post_processor = tk.processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, ids[bos])])
    return {"json": tok.to_str(pretty=True), "ids": ids, "vocab": tok.get_vocab_size()}


def tokenizer_files(arch: str, tok: dict, template: str) -> tuple[dict, dict]:
    fam = FAMILIES[arch]
    named = {"bos_token": fam["bos"], "eos_token": fam["eos"], "pad_token": fam["pad"], "unk_token": fam["unk"]}
    named = {k: v for k, v in named.items() if v}  # Llama 3 has no unk token
    extra = [s for s in fam.get("named", fam["specials"]) if s not in named.values()]
    special_map = {**named, "additional_special_tokens": extra}
    added = {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True} for i, s in enumerate(fam["specials"])}
    config = {**special_map, "tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added,
              "chat_template": gemma4_template(template) if arch == "gemma4" else fam["chat_template"], "add_bos_token": True, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": MAX_POSITIONS, "padding_side": "right"}
    return config, special_map


def normal(seed: int, name: str, shape: tuple):
    """N(0, INIT_STD^2) from numpy's stream seeded by (seed, sha256(name)[:8])."""
    import numpy as np

    key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")
    return np.random.default_rng([seed, key]).standard_normal(shape, dtype=np.float32) * np.float32(INIT_STD)


def init_weights(config: dict, seed: int, dtype: str) -> tuple[dict, int]:
    """{name: mx.array} for every parameter of the mlx-lm model the config describes."""
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    random_init = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    weights = {}
    for name, value in sorted(tree_flatten(model.parameters())):
        # norms, layer scalars: keep the module's init
        arr = normal(seed, name, value.shape) if name in random_init else np.array(value, dtype=np.float32)
        weights[name] = mx.array(arr).astype(getattr(mx, dtype))
    return weights, sum(int(np.prod(v.shape)) for v in weights.values())


def released_layout(config: dict, weights: dict, seed: int) -> tuple[dict, dict]:
    """Gemma 4's released layout: the gemma4 wrapper config, model.language_model.*, towers mlx-lm drops."""
    import mlx.core as mx

    top = ("architectures", "thunder_runbook", "torch_dtype")
    wrapper = {
        "architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
        "text_config": {k: v for k, v in config.items() if k not in top},
        "vision_config": {"model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64,
                          "num_hidden_layers": 1, "num_attention_heads": 2, "patch_size": 4},
        "audio_config": {"model_type": "gemma4_audio", "hidden_size": 32, "num_hidden_layers": 1,
                         "num_attention_heads": 2, "output_proj_dims": 32},
        # mlx-lm's gemma4.ModelArgs copies this into text_config (its default is 262,144)
        "vocab_size": config["vocab_size"],
        **{k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings", *top[1:])},
    }
    dtype = next(iter(weights.values())).dtype
    out = {"model.language_model." + k.removeprefix("model."): v for k, v in weights.items()}
    out.update({name: mx.array(normal(seed, name, shape)).astype(dtype) for name, shape in TOWERS.items()})
    return wrapper, out


def quantize(config: dict, weights: dict, bits: int) -> tuple[dict, dict]:
    """mlx-lm's own quantize_model (after sanitize()); the towers it drops stay float at the top level."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, quantize_model

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.load_weights(list(model.sanitize(dict(weights)).items()))
    with contextlib.redirect_stdout(sys.stderr):  # its "[INFO] Quantized ..." line
        model, config = quantize_model(model, config, GROUP_SIZE, bits)
    config["quantization_config"] = config["quantization"]  # as mlx-lm's save_config writes it
    towers = {k.removeprefix("model."): v for k, v in weights.items() if k in TOWERS}
    return config, {**dict(tree_flatten(model.parameters())), **towers}


def verify(path: Path, arch: str, sample: str) -> None:
    """Load the folder back with mlx-lm the way training will, and check it works."""
    import mlx.core as mx
    from mlx_lm.utils import load

    model, tokenizer = load(str(path))
    conv = [{"role": "system", "content": "You answer questions about Python."},
            {"role": "user", "content": "What does the assert statement do?"}, {"role": "assistant", "content": sample}]
    text = tokenizer.apply_chat_template(conv, tokenize=False)
    for marker in FAMILIES[arch]["turn_markers"]:
        if marker not in text:
            raise RunbookError(f"verify: chat template output lacks {marker!r}: {text[:200]!r}", ANCHOR)
    full = tokenizer.apply_chat_template(conv, return_dict=False)
    history = tokenizer.apply_chat_template(conv[:-1], return_dict=False)
    prompt = tokenizer.apply_chat_template(conv[:-1], add_generation_prompt=True, return_dict=False)
    if full[: len(history)] != history or prompt[: len(history)] != history or full.count(tokenizer.bos_token_id) != 1:
        raise RunbookError("verify: the history before the answer is not a token prefix of the conversation and "
                           "of the generation prompt, or BOS is not there exactly once", ANCHOR)
    if arch == "gemma4" and not tokenizer.has_thinking:
        raise RunbookError("verify: mlx-lm detects no thinking mode (<|channel>, <channel|>) on the tokenizer", ANCHOR)
    if tokenizer.decode(tokenizer.encode(sample, add_special_tokens=False)) != sample:
        raise RunbookError("verify: tokenizer round trip changed the text", ANCHOR)
    logits = model(mx.array([full]))
    mx.eval(logits)
    want = (1, len(full), model.args.vocab_size)
    if logits.shape != want or not bool(mx.all(mx.isfinite(logits)).item()):
        raise RunbookError(f"verify: bad logits (shape {logits.shape}, want {want})", ANCHOR)


def check_replaceable(out: Path, force: bool) -> None:
    """Refuse to replace a folder this script did not make (unless --force)."""
    try:
        made_by = json.loads((out / "provenance.json").read_text(encoding="utf-8")).get("generator")
        ours = made_by in (GENERATOR, "bin/make_tiny_model.py")  # its path before 2026-11
    except (OSError, ValueError, AttributeError):
        ours = False
    if out.exists() and not force and not ours:
        raise RunbookError(f"{out} exists and was not made by {GENERATOR} (no provenance.json naming it); "
                           "refusing to replace it: choose another --out, or pass --force to overwrite", ANCHOR)


def provenance(args, config: dict, tok: dict, text_sha: str, n_params: int, files: dict) -> dict:
    return {
        "generator": GENERATOR, "generator_version": VERSION, "arch": args.arch, "layout": args.layout,
        "quantization": config.get("quantization"), "model_type": config["model_type"],
        "seed": args.seed, "dtype": args.dtype, "parameters": n_params,
        "init": f"Linear and Embedding weights ~ N(0, {INIT_STD}^2), numpy default_rng"
                "([seed, sha256(name)[:8]]); other parameters keep the module's init",
        "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": tok["vocab"], "min_frequency": 2,
                      "special_tokens": tok["ids"], "trained_on_sha256": text_sha,
                      "trained_on": f"cpython-{platform.python_version()}/pydoc_data.topics"},
        "chat_template": args.template if args.arch == "gemma4" else "llama3",
        "python": platform.python_version(), "files": files,
        "packages": {p: pkg_version(p) for p in ("mlx", "mlx-lm", "numpy", "tokenizers")},
    }


def main() -> int:
    args = build_parser().parse_args()
    try:
        if not 512 <= args.vocab_size <= 65536:
            raise RunbookError(f"--vocab-size {args.vocab_size} is out of range: use 512..65536", ANCHOR)
        if args.layout == "released" and args.arch != "gemma4":
            raise RunbookError("--layout released is Gemma 4's released layout: use it with --arch gemma4", ANCHOR)
        if args.template == "current" and args.arch != "gemma4":
            raise RunbookError("--template picks Gemma 4's generation prompt: use it with --arch gemma4", ANCHOR)
        check_replaceable(args.out, args.force)
        texts, text_sha = training_text()
        tok = train_tokenizer(args.arch, args.vocab_size, texts)
        config = model_config(args.arch, tok, tok["vocab"], args.dtype, args.seed)
        config["thunder_runbook"].update(layout=args.layout, quantize=args.quantize)
        tok_config, special_map = tokenizer_files(args.arch, tok, args.template)
        weights, n_params = init_weights(config, args.seed, args.dtype)
        if args.layout == "released":
            config, weights = released_layout(config, weights, args.seed)
        if args.quantize:
            config, weights = quantize(config, weights, args.quantize)
        import mlx.core as mx
        with atomic.atomic_dir(args.out) as tmp:
            atomic.write_json(tmp / "config.json", config)
            atomic.write_text(tmp / "tokenizer.json", tok["json"] + "\n")
            atomic.write_json(tmp / "tokenizer_config.json", tok_config)
            atomic.write_json(tmp / "special_tokens_map.json", special_map)
            if stops := FAMILIES[args.arch].get("generation_stop"):  # mlx-lm takes its eos_token_id over config's
                atomic.write_json(tmp / "generation_config.json", {
                    "bos_token_id": tok["ids"]["<bos>"], "eos_token_id": [tok["ids"][t] for t in stops],
                    "pad_token_id": tok["ids"]["<pad>"]})
            mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
            files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
            atomic.write_json(tmp / "provenance.json", provenance(args, config, tok, text_sha, n_params, files))
            verify(tmp, args.arch, " ".join(texts[0].split("\n\n")[2].split()))
    except RunbookError as e:
        return die(e)
    except OSError as e:
        return die(RunbookError(f"cannot write {args.out}: {e}; check the folder is writable", ANCHOR))
    event("tiny-model", arch=args.arch, seed=args.seed, params=n_params, vocab=tok["vocab"], dtype=args.dtype,
          layout=args.layout, quantize=args.quantize or "none", out=paths.rel(args.out),
          bytes=sum(p.stat().st_size for p in args.out.iterdir() if p.is_file()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
