"""The generated tiny models: load, generate, train through raw `mlx_lm lora`, deterministic; Gemma 4's
released layout and the 4-bit forms load in mlx-lm and train with bin/train.py.

Each model is generated once per session into a temp dir (demo/make_tiny_model.py, the
script `make tiny-model` runs). Every mlx-lm call runs with HF_HUB_OFFLINE=1 and a dead
proxy, so a hidden network access fails instead of passing.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re

import pytest
from conftest import PY, ROOT, make, run

from lib.hashing import sha256_file
from lib.log import RunbookError

pytestmark = pytest.mark.beside  # beside the rest (tests/conftest.py)

ARCHS = ("gemma4", "llama")
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HTTPS_PROXY": "http://127.0.0.1:9",
    "HTTP_PROXY": "http://127.0.0.1:9",
}
ANSI = re.compile(r"\x1b\[[0-9;]*m")
TURN_MARKERS = {"gemma4": ("<|turn>", "<turn|>"), "llama": ("<|start_header_id|>", "<|eot_id|>")}


def generate(arch: str, out, seed: int = 0):
    return run([PY, "demo/make_tiny_model.py", "--arch", arch, "--seed", str(seed), "--out", str(out)],
               env=dict(os.environ, **OFFLINE))


def file_hashes(folder) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(folder.iterdir())}


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """{arch: model folder}, generated once per session."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for arch in ARCHS:
        p = generate(arch, root / f"tiny-{arch}")
        assert p.stdout.startswith(f"tiny-model arch {arch} seed 0 params "), p.stdout
        out[arch] = root / f"tiny-{arch}"
    return out


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory):
    """A 3-split mlx-lm chat dataset made from sample-corpus records (both shapes)."""
    tmp = tmp_path_factory.mktemp("chat")
    run([PY, "demo/make_sample_corpus.py", "--out", str(tmp / "corpus.jsonl")])
    recs = [json.loads(line) for line in (tmp / "corpus.jsonl").read_text().splitlines()[:40]]
    system = {"role": "system", "content": "You explain the Python language reference."}

    def chat(r):
        if "text" in r:
            turns = [{"role": "user", "content": "Quote the Python reference."},
                     {"role": "assistant", "content": r["text"]}]
        else:
            turns = [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["response"]}]
        return {"messages": [system, *turns], "record_id": r["record_id"]}

    data = tmp / "data"
    data.mkdir()
    for name, part in (("train", recs[:24]), ("valid", recs[24:32]), ("test", recs[32:40])):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(chat(r)) + "\n" for r in part))
    return data


@pytest.mark.parametrize("arch", ARCHS)
def test_layout_and_provenance(models, arch):
    m = models[arch]
    names = {p.name for p in m.iterdir()}
    assert names == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "special_tokens_map.json", "provenance.json", *(["generation_config.json"] * (arch == "gemma4"))}
    cfg = json.loads((m / "config.json").read_text())
    prov = json.loads((m / "provenance.json").read_text())
    assert cfg["thunder_runbook"]["arch"] == prov["arch"] == arch
    assert cfg["thunder_runbook"]["seed"] == prov["seed"] == 0
    assert prov["generator"] == "demo/make_tiny_model.py" and prov["generator_version"] >= 1
    assert prov["files"] == {k: v for k, v in file_hashes(m).items() if k != "provenance.json"}
    assert 2048 <= cfg["vocab_size"] <= 4096
    assert prov["tokenizer"]["trained_on"].startswith("cpython-")
    assert not any(str(ROOT) in p.read_text(errors="replace") for p in m.iterdir() if p.suffix == ".json")
    # not the private mode of temp files: the umask decides, as for any file the operator makes
    mask = os.umask(0)
    os.umask(mask)
    assert {p.stat().st_mode & 0o777 for p in m.iterdir()} == {0o666 & ~mask}
    assert m.stat().st_mode & 0o777 == 0o777 & ~mask


def test_gemma4_config_exercises_the_architecture(models):
    from mlx_lm.models.gemma4_text import ModelArgs

    cfg = json.loads((models["gemma4"] / "config.json").read_text())
    assert cfg["model_type"] == "gemma4_text"
    args = ModelArgs.from_dict(cfg)
    n, shared = args.num_hidden_layers, args.num_kv_shared_layers
    assert {"sliding_attention", "full_attention"} <= set(args.layer_types[: n - shared])
    assert args.layer_types[-1] == "full_attention"
    assert 0 < shared < n and args.hidden_size_per_layer_input > 0
    assert args.sliding_window < 256 and args.hidden_size <= 128


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_and_generates(models, arch):
    from mlx_lm import stream_generate
    from mlx_lm.utils import load

    model, tok = load(str(models[arch]))
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is a lambda?"}],
                                     add_generation_prompt=True, return_dict=False)
    out = list(stream_generate(model, tok, prompt, max_tokens=5))
    assert 1 <= len(out) <= 5
    assert len(out) == 5 or out[-1].token in tok.eos_token_ids
    assert all(0 <= r.token < model.args.vocab_size for r in out)
    cfg = json.loads((models[arch] / "config.json").read_text())
    assert set(cfg["eos_token_id"]) <= tok.eos_token_ids


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template(models, arch):
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(models[arch])
    conv = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is pass?"},
        {"role": "assistant", "content": "A null operation."},
    ]
    text = tok.apply_chat_template(conv, tokenize=False, enable_thinking=False)
    if arch == "gemma4":
        assert text == ("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nWhat is pass?<turn|>\n"
                        "<|turn>model\nA null operation.<turn|>\n")
        gen = "<|turn>model\n<|channel>thought\n<channel|>"  # the launch template's, thinking off
    else:
        assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                        "<|start_header_id|>user<|end_header_id|>\n\nWhat is pass?<|eot_id|>"
                        "<|start_header_id|>assistant<|end_header_id|>\n\nA null operation.<|eot_id|>")
        gen = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    prompt = tok.apply_chat_template(conv[:-1], add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert prompt.endswith(gen) and text.startswith(prompt.removesuffix("<|channel>thought\n<channel|>"))
    # markers are single special tokens; the history is a token prefix of both (lib/chat.py masks the common one)
    ids = tok.apply_chat_template(conv, return_dict=False, enable_thinking=False)
    hids = tok.apply_chat_template(conv[:-1], return_dict=False, enable_thinking=False)
    assert ids[: len(hids)] == hids
    for marker in TURN_MARKERS[arch]:
        mid = tok.convert_tokens_to_ids(marker)
        assert mid in ids and tok.convert_ids_to_tokens(mid) == marker
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert tok.encode("x")[0] == tok.bos_token_id  # plain encode adds BOS (TextDataset path)
    # list-of-parts content renders like a string
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in conv]
    assert tok.apply_chat_template(parts, tokenize=False, enable_thinking=False) == text
    with pytest.raises(Exception, match="unknown role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)
    with pytest.raises(Exception, match="system message must come first"):
        tok.apply_chat_template(conv[1:2] + conv[:1], tokenize=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_random_init_is_trainable(models, arch):
    """Full fine-tuning on one batch must drive the loss well down: every path carries gradient."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx_lm.utils import load

    model, tok = load(str(models[arch]))
    model.train()
    ids = tok.encode("The assert statement inserts debugging assertions into a program.")
    x = mx.array([ids, ids[::-1]])

    def loss_fn(m):
        return nn.losses.cross_entropy(m(x[:, :-1]), x[:, 1:]).mean()

    step = nn.value_and_grad(model, loss_fn)
    opt = optim.Adam(learning_rate=1e-2)
    first = None
    for _ in range(25):
        loss, grads = step(model)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        first = loss.item() if first is None else first
    last = loss.item()
    assert math.isfinite(last)
    assert abs(first - math.log(model.args.vocab_size)) < 1.0  # random init: near-uniform
    assert last < first - 3.0, (first, last)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_raw_mlx_lm_lora_trains(models, chat_data, arch, tmp_path):
    adapters = tmp_path / "adapters"
    p = run(
        [PY, "-m", "mlx_lm", "lora", "--model", str(models[arch]), "--train", "--data", str(chat_data),
         "--iters", "5", "--num-layers", "2", "--batch-size", "2", "--adapter-path", str(adapters),
         "--steps-per-eval", "5", "--val-batches", "2", "--test", "--test-batches", "2"],
        env=dict(os.environ, **OFFLINE),
    )
    out = ANSI.sub("", p.stdout + p.stderr)
    vals = [float(v) for v in re.findall(r"^\s*\d+\s+val\s+([0-9.]+)", out, re.M)]
    test_loss = re.search(r"Test loss ([0-9.]+|nan|inf)", out)
    assert len(vals) == 2 and test_loss, out[-2000:]
    assert all(math.isfinite(v) and 0 < v < 12 for v in [*vals, float(test_loss.group(1))]), out[-2000:]
    assert (adapters / "adapters.safetensors").is_file()
    cfg = json.loads((adapters / "adapter_config.json").read_text())
    assert cfg["num_layers"] == 2

    import mlx.core as mx
    from mlx_lm.utils import load

    model, tok = load(str(models[arch]), adapter_path=str(adapters))
    logits = model(mx.array([tok.encode("pass")]))
    assert logits.shape[-1] == model.args.vocab_size and mx.all(mx.isfinite(logits)).item()


def test_deterministic_same_seed(models, tmp_path):
    for arch in ARCHS:
        generate(arch, tmp_path / arch)
        assert file_hashes(tmp_path / arch) == file_hashes(models[arch]), arch


def test_seed_changes_weights_only(models, tmp_path):
    generate("llama", tmp_path / "s1", seed=1)
    a, b = file_hashes(models["llama"]), file_hashes(tmp_path / "s1")
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"] and a["tokenizer_config.json"] == b["tokenizer_config.json"]
    assert json.loads((tmp_path / "s1" / "config.json").read_text())["thunder_runbook"]["seed"] == 1


def test_regenerating_replaces_own_model(models, tmp_path):
    out = tmp_path / "m"
    generate("llama", out)
    (out / "stray.txt").write_text("left over")
    generate("llama", out)
    assert not (out / "stray.txt").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_refuses_to_replace_a_folder_it_did_not_make(tmp_path):
    out = tmp_path / "real-model"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "gemma4_text"}')
    p = run([PY, "demo/make_tiny_model.py", "--arch", "gemma4", "--out", str(out)], check=False)
    assert p.returncode != 0
    assert "--force" in p.stderr and "see RUNBOOK.md#generated-inputs" in p.stderr
    assert [x.name for x in out.iterdir()] == ["config.json"]
    # A model made when the generator lived in bin/ is still the generator's own (make rebuilds it).
    spec = importlib.util.spec_from_file_location("make_tiny_model", ROOT / "demo" / "make_tiny_model.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    (out / "provenance.json").write_text('{"generator": "bin/make_tiny_model.py"}')
    gen.check_replaceable(out, force=False)
    (out / "provenance.json").write_text('{"generator": "somebody-else"}')
    with pytest.raises(RunbookError, match="--force"):
        gen.check_replaceable(out, force=False)


def test_make_target_runs_the_script():
    p = make("-n", "-B", "tiny-model", "ARCH=llama", "TINY_SEED=3")
    assert "demo/make_tiny_model.py --arch llama --seed 3 --out models/tiny-llama" in p.stdout


def test_make_rebuilds_on_another_seed_and_only_then():
    """`make tiny-model TINY_SEED=N` rebuilds a model built with another seed; the same seed
    again leaves it (and its mtime, which the hosts' copies are checked against) alone."""
    model = ROOT / "models" / "tiny-llama"
    make("tiny-model", "ARCH=llama", "TINY_SEED=0")
    seed0 = file_hashes(model)
    make("tiny-model", "ARCH=llama", "TINY_SEED=1")
    assert file_hashes(model)["model.safetensors"] != seed0["model.safetensors"]
    mtime = (model / "config.json").stat().st_mtime_ns
    p = make("tiny-model", "ARCH=llama", "TINY_SEED=1")
    assert "make_tiny_model.py" not in p.stdout and (model / "config.json").stat().st_mtime_ns == mtime
    make("tiny-model", "ARCH=llama", "TINY_SEED=0")
    assert file_hashes(model) == seed0


# ---- Gemma 4's released layout and the 4-bit forms (issue #18) ----------------------------------
FORMS = {"released": ["--layout", "released"], "q4": ["--quantize", "4"],
         "released-q4": ["--layout", "released", "--quantize", "4"],
         "released-q4-current": ["--layout", "released", "--quantize", "4", "--template", "current"]}
TOWER_PREFIXES = ("vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.")


@pytest.fixture(scope="session")
def forms(models, tmp_path_factory):
    """{form: folder}: the gemma4 text layout (seed 0) and its released / 4-bit forms, same seed."""
    root = tmp_path_factory.mktemp("forms")
    out = {"text": models["gemma4"]}
    for name, extra in FORMS.items():
        p = run([PY, "demo/make_tiny_model.py", "--arch", "gemma4", "--seed", "0", "--out", str(root / name), *extra],
                env=dict(os.environ, **OFFLINE))
        assert p.stdout.startswith("tiny-model arch gemma4 seed 0 ") and p.stdout.count("\n") == 1, p.stdout
        out[name] = root / name
    return out


def weight_names(folder) -> set[str]:
    import mlx.core as mx

    return set(mx.load(str(folder / "model.safetensors")))


def logits(folder, text="The assert statement inserts debugging assertions into a program."):
    import mlx.core as mx
    from mlx_lm.utils import load

    model, tok = load(str(folder))
    out = model(mx.array([tok.encode(text)]))
    mx.eval(out)
    return model, out


def test_released_layout_is_gemma4s_wrapper(forms):
    text_cfg = json.loads((forms["text"] / "config.json").read_text())
    cfg = json.loads((forms["released"] / "config.json").read_text())
    assert (cfg["model_type"], cfg["architectures"]) == ("gemma4", ["Gemma4ForConditionalGeneration"])
    assert cfg["text_config"] == {k: v for k, v in text_cfg.items()
                                  if k not in ("architectures", "thunder_runbook", "torch_dtype")}
    assert cfg["text_config"]["model_type"] == "gemma4_text" and cfg["vocab_size"] == text_cfg["vocab_size"]
    assert cfg["vision_config"]["model_type"] == "gemma4_vision" and cfg["audio_config"]["model_type"] == "gemma4_audio"
    names = weight_names(forms["released"])
    text = {"model.language_model." + k.removeprefix("model.") for k in weight_names(forms["text"])}
    towers = names - text
    assert text <= names and {t.split(".")[1] for t in towers} == {p.rstrip(".") for p in TOWER_PREFIXES}
    assert all(t.startswith("model.") for t in towers)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert sha256_file(forms["released"] / f) == sha256_file(forms["text"] / f)
    prov = json.loads((forms["released"] / "provenance.json").read_text())
    assert (prov["layout"], prov["quantization"], prov["model_type"]) == ("released", None, "gemma4")


def test_released_layout_loads_text_only_with_the_same_logits(forms):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma4

    model, released = logits(forms["released"])
    _, text = logits(forms["text"])
    assert isinstance(model, gemma4.Model)
    params = [k for k, _ in tree_flatten(model.parameters())]
    assert params and not [k for k in params if any(p.rstrip(".") in k for p in TOWER_PREFIXES)]  # towers dropped
    diff = mx.abs(released - text).max().item()
    print(f"released vs text layout logits: max abs diff {diff}")
    assert diff == 0.0


def test_quantized_forms_load_with_quantized_linear(forms):
    import mlx.core as mx
    import mlx.nn as nn

    out = {}
    for name in ("q4", "released-q4"):
        cfg = json.loads((forms[name] / "config.json").read_text())
        assert cfg["quantization"] == cfg["quantization_config"] == {"group_size": 64, "bits": 4, "mode": "affine"}
        model, out[name] = logits(forms[name])
        quantized = {k for k, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}
        assert any(k.endswith("self_attn.q_proj") for k in quantized) and any(k.endswith("mlp.down_proj") for k in quantized)
        # as in the real 4-bit conversion, nothing stays float: the per-layer embedding table and projections too
        assert not [k for k, m in model.named_modules() if type(m) in (nn.Linear, nn.Embedding)]
        kinds = {k.split(".")[-1]: type(m) for k, m in model.named_modules()}
        assert kinds["embed_tokens_per_layer"] is nn.QuantizedEmbedding
        assert {kinds[k] for k in ("per_layer_model_projection", "per_layer_projection", "per_layer_input_gate")} \
            == {nn.QuantizedLinear}
        assert bool(mx.all(mx.isfinite(out[name])).item())
        prov = json.loads((forms[name] / "provenance.json").read_text())
        assert prov["quantization"]["bits"] == 4 and prov["quantization"]["group_size"] == 64
    # the 4-bit released form: mlx-lm's names for the language model, the towers at the top level
    names = weight_names(forms["released-q4"])
    assert any(k.startswith("language_model.model.layers.0.self_attn.q_proj.scales") for k in names)
    assert {k.split(".")[0] + "." for k in names if not k.startswith("language_model.")} == set(TOWER_PREFIXES)
    assert mx.abs(out["q4"] - out["released-q4"]).max().item() == 0.0
    _, text = logits(forms["text"])
    cos = (mx.sum(out["q4"] * text) / mx.sqrt(mx.sum(out["q4"] ** 2) * mx.sum(text ** 2))).item()
    print(f"4-bit vs float logits: cosine {cos:.4f}")
    assert cos > 0.5  # quantized, not garbage: 0.71 here; another seed's model gives ~0.01, 8-bit ~0.998


def test_released_layout_is_deterministic_and_gemma4_only(forms, tmp_path):
    p = run([PY, "demo/make_tiny_model.py", "--arch", "gemma4", "--out", str(tmp_path / "r"), *FORMS["released-q4"]],
            env=dict(os.environ, **OFFLINE))
    assert file_hashes(tmp_path / "r") == file_hashes(forms["released-q4"]), p.stdout
    p = run([PY, "demo/make_tiny_model.py", "--arch", "llama", "--layout", "released", "--out", str(tmp_path / "l")],
            check=False)
    assert p.returncode == 1 and "--arch gemma4" in p.stderr and not (tmp_path / "l").exists()


def test_make_names_the_forms():
    p = make("-n", "-B", "tiny-model", "LAYOUT=released", "QUANT=4")
    assert ("demo/make_tiny_model.py --arch gemma4 --seed 0 --out models/tiny-gemma4-released-q4 "
            "--layout released --quantize 4") in p.stdout
    p = make("-n", "-B", "tiny-model", "QUANT=8")
    assert "--out models/tiny-gemma4-q8 --quantize 8" in p.stdout
    p = make("-n", "-B", "tiny-model", "QUANT=4", "TEMPLATE=current")
    assert "--out models/tiny-gemma4-q4-current --quantize 4 --template current" in p.stdout


LORA_CONFIG = """\
fine_tune_type: lora
num_layers: -1
lora_parameters: {rank: 4, dropout: 0.0, scale: 20.0}
learning_rate: 1e-3
batch_size: 2
iters: 3
steps_per_report: 1
steps_per_eval: 3
save_every: 3
val_batches: 1
test: true
test_batches: 1
max_seq_length: 96
mask_prompt: true
chat_template_args: {enable_thinking: false}
seed: 0
"""


@pytest.mark.slow
@pytest.mark.parametrize("form", ["released", "released-q4", "released-q4-current"])
def test_lora_trains_and_the_adapter_loads_in_fuse_and_generate(forms, chat_data, form, tmp_path):
    """bin/train.py as one rank (no mlx.launch), then mlx-lm's own fuse and generate on the adapter."""
    cfg = tmp_path / "lora.yaml"
    cfg.write_text(LORA_CONFIG)
    run_dir = tmp_path / "run"
    env = dict(os.environ, **OFFLINE)
    p = run([PY, "bin/train.py", "--config", str(cfg), "--model", str(forms[form]), "--data", str(chat_data),
             "--run-dir", str(run_dir)], env=env, timeout=300)
    assert re.search(r"^done .*step 3", p.stdout, re.M), p.stdout[-2000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [e["loss"] for e in steps if e["kind"] == "step"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    adapters = run_dir / "adapters"
    assert (adapters / "adapters.safetensors").is_file()
    # mask_prompt: the targets are the answer and its <turn|>, after the served generation prompt (the
    # launch variant's empty thought channel included) in either template variant (issues #26, #39)
    from mlx_lm.utils import load_tokenizer

    first = json.loads((run_dir / "logs" / "rank-0.joined.json").read_text())["chat_format"]["first_record"]
    ids = load_tokenizer(forms[form]).encode(first["text"], add_special_tokens=False)
    assert len(ids) == first["tokens"] and len(first["targets"]) == 1
    answer = first["targets"][0]
    assert answer.endswith("<turn|>") and first["text"].endswith(answer + "\n")
    prompt = first["text"][: -len(answer) - 1]
    served = "<|turn>model\n" + ("" if form.endswith("current") else "<|channel>thought\n<channel|>")
    assert prompt.endswith(served), prompt[-60:]
    # Exact resume on this layout: stopped after step 2, resumed to step 3, the same adapter bit for bit.
    assert_resumes_exactly(cfg, forms[form], chat_data, run_dir, tmp_path / "resumed", env)

    import mlx.nn as nn
    from mlx_lm.tuner.lora import LoRALinear
    from mlx_lm.utils import load

    model, _ = load(str(forms[form]), adapter_path=str(adapters))
    # LoRA sits on QuantizedLinear in the 4-bit form
    wrapped = {k: m.linear for k, m in model.named_modules() if isinstance(m, LoRALinear)}
    q_proj = [m for k, m in wrapped.items() if k.endswith("self_attn.q_proj")]
    assert q_proj and all(isinstance(m, nn.QuantizedLinear) == ("-q4" in form) for m in q_proj)
    p = run([PY, "-m", "mlx_lm", "generate", "--model", str(forms[form]), "--adapter-path", str(adapters),
             "--prompt", "What is a list?", "--max-tokens", "4", "--temp", "0",
             "--chat-template-config", '{"enable_thinking": false}'], env=env, timeout=120)
    assert "Generation:" in p.stdout or "tokens-per-sec" in p.stdout, p.stdout
    fused = tmp_path / "fused"
    run([PY, "-m", "mlx_lm", "fuse", "--model", str(forms[form]), "--adapter-path", str(adapters),
         "--save-path", str(fused)], env=env, timeout=120)
    import mlx.core as mx

    _, fused_logits = logits(fused)
    assert bool(mx.all(mx.isfinite(fused_logits)).item())
    assert json.loads((fused / "config.json").read_text())["model_type"] == "gemma4"


def assert_resumes_exactly(cfg, model, data, run_dir, resumed, env) -> None:
    again = [PY, "bin/train.py", "--config", str(cfg), "--model", str(model), "--data", str(data),
             "--run-dir", str(resumed)]
    run([*again, "--stop-at-step", "2"], env=env, timeout=300)
    p = run([*again, "--resume"], env=env, timeout=300)
    assert re.search(r"^resume rank 0 checkpoint \S+step-0000002 step 2", p.stdout, re.M), p.stdout[-2000:]
    from safetensors.numpy import load_file

    want, got = (load_file(str(d / "adapters" / "adapters.safetensors")) for d in (run_dir, resumed))
    assert want.keys() == got.keys() and all((want[k] == got[k]).all() for k in want)
