"""Gemma 4 as it is served (issue #26): the tiny model's tokenizer and chat format are Gemma 4's, the format
a run trains in is the config's chat_template_args, and mask_prompt masks exactly the prompt.

The template under test is the tiny model's own (demo/make_tiny_model.py), in both generation-prompt
variants; the expected text is built here from the format's description, not from that template. lib/chat.py
is checked for any template: the prompt/record split is computed, not assumed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil

import pytest
from conftest import PY, ROOT, run

from lib import chat
from lib import config as C

pytestmark = pytest.mark.beside  # beside the rest (tests/conftest.py)

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HTTPS_PROXY": "http://127.0.0.1:9"}
SPECIALS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, "<|tool>": 46, "<tool|>": 47,
            "<|tool_call>": 48, "<tool_call|>": 49, "<|tool_response>": 50, "<tool_response|>": 51, '<|"|>': 52,
            "<|think|>": 98, "<|channel>": 100, "<channel|>": 101, "<|turn>": 105, "<turn|>": 106}
EMPTY_THOUGHT = "<|channel>thought\n<channel|>"
SYSTEM = {"role": "system", "content": "  You explain Python.\n"}
TURNS = [{"role": "user", "content": "What is pass?"},
         {"role": "assistant", "content": "<|channel>thought\nA statement.<channel|>A null operation. "},
         {"role": "user", "content": " And del? "},
         {"role": "assistant", "content": "It deletes names."}]


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """{variant: model folder}: the tiny gemma4 with the launch and with the current template."""
    root = tmp_path_factory.mktemp("variants")
    for v in ("launch", "current"):
        run([PY, "demo/make_tiny_model.py", "--arch", "gemma4", "--template", v, "--out", str(root / v)],
            env=dict(os.environ, **OFFLINE))
    return {v: root / v for v in ("launch", "current")}


def tokenizer(folder):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(folder)


def expected(messages: list, thinking: bool, variant: str, generation_prompt: bool = False) -> str:
    """Gemma 4's format, from its description (the issue's 'Facts to build on')."""
    msgs, out = list(messages), "<bos>"
    system = msgs.pop(0)["content"].strip() if msgs and msgs[0]["role"] in ("system", "developer") else None
    if thinking or system is not None:
        out += "<|turn>system\n" + ("<|think|>" if thinking else "") + (system or "") + "<turn|>\n"
    for m in msgs:
        role, text = ("model", re.sub(r"<\|channel>.*?<channel\|>", "", m["content"], flags=re.S)) \
            if m["role"] == "assistant" else (m["role"], m["content"])
        out += f"<|turn>{role}\n{text.strip()}<turn|>\n"
    if generation_prompt:
        out += "<|turn>model\n" + (EMPTY_THOUGHT if variant == "launch" and not thinking else "")
    return out


def test_special_tokens_sit_at_gemma4s_ids_and_mlx_lm_sees_a_thinking_mode(variants):
    from mlx_lm.utils import load

    tok = tokenizer(variants["launch"])
    assert {s: tok.convert_tokens_to_ids(s) for s in SPECIALS} == SPECIALS
    assert all(tok.encode(s, add_special_tokens=False) == [i] for s, i in SPECIALS.items())
    assert tok.encode("\n", add_special_tokens=False) == [107] and tok.decode([107]) == "\n"
    assert tok.has_thinking and tok.think_start == "<|channel>thought"
    cfg, gen = (json.loads((variants["launch"] / f).read_text()) for f in ("config.json", "generation_config.json"))
    assert cfg["eos_token_id"] == [1, 106] and gen["eos_token_id"] == [1, 106, 50]
    _, loaded = load(str(variants["launch"]))
    assert loaded.eos_token_ids == {1, 106, 50}  # mlx-lm stops where Gemma 4 does


@pytest.mark.parametrize("variant", ["launch", "current"])
@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("shape", ["system", "no-system", "developer", "multi-turn", "parts"])
def test_the_template_renders_gemma4s_format(variants, variant, thinking, shape):
    tok = tokenizer(variants[variant])
    conv = {"system": [SYSTEM, *TURNS[:2]], "no-system": TURNS[:2], "multi-turn": [SYSTEM, *TURNS],
            "developer": [{**SYSTEM, "role": "developer"}, *TURNS[:2]],
            "parts": [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in [SYSTEM, *TURNS[:2]]]}[shape]
    plain = [{**m, "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]}
             for m in conv]
    assert tok.apply_chat_template(conv, tokenize=False, enable_thinking=thinking) == expected(
        plain, thinking, variant)
    assert tok.apply_chat_template(conv[:-1], tokenize=False, add_generation_prompt=True,
                                   enable_thinking=thinking) == expected(plain[:-1], thinking, variant, True)


def test_mlx_lm_renders_thinking_on_unless_told(variants):
    """Observation 1: mlx-lm's wrapper passes enable_thinking=has_thinking, so an unchosen record gets a
    system turn holding <|think|>; mlx-lm's ChatDataset passes nothing."""
    from mlx_lm.tuner.datasets import ChatDataset

    tok = tokenizer(variants["launch"])
    assert tok.apply_chat_template(TURNS[:2], tokenize=False).startswith("<bos><|turn>system\n<|think|><turn|>\n")
    tokens, _ = ChatDataset([{"messages": TURNS[:2]}], tok).process({"messages": TURNS[:2]})
    assert tok.decode(tokens).startswith("<bos><|turn>system\n<|think|><turn|>\n") and 98 in tokens


@pytest.mark.parametrize("variant", ["launch", "current"])
@pytest.mark.parametrize("conv", [TURNS[:2], [SYSTEM, *TURNS]], ids=["single", "multi-turn"])
def test_the_loss_covers_every_answer_token_and_no_prompt_token(variants, variant, conv):
    tok, args = tokenizer(variants[variant]), {"enable_thinking": False}
    cfg = {**C.DEFAULTS, "mask_prompt": True, "chat_template_args": args}
    tokens, k = chat.dataset([{"messages": conv}], tok, cfg)[0]
    prompt = tok.apply_chat_template(conv[:-1], add_generation_prompt=True, return_dict=False, **args)
    visible = re.sub(r"<\|channel>.*?<channel\|>", "", conv[-1]["content"], flags=re.S).strip()
    answer = tok.encode(visible, add_special_tokens=False)
    assert tokens == tok.apply_chat_template(conv, return_dict=False, **args)
    assert tokens[k:] == [*answer, 106, 107]  # every answer token (and the turn's end), nothing before it
    assert tokens[:k] == prompt[:k] and tok.decode(tokens[:k]).endswith("<|turn>model\n")
    if variant == "launch":  # observation 2: mlx-lm's offset, len(prompt), would cut 5 answer tokens
        assert prompt[k:] == tok.encode(EMPTY_THOUGHT, add_special_tokens=False) and len(prompt) == k + 5
    else:
        assert prompt == tokens[:k]
    # without mask_prompt the whole record is in the loss, rendered with the same arguments
    assert chat.dataset([{"messages": conv}], tok, {**cfg, "mask_prompt": False})[0] == (tokens, 0)


def test_prompt_completion_records_are_rendered_and_masked_alike(variants):
    tok = tokenizer(variants["launch"])
    cfg = {**C.DEFAULTS, "mask_prompt": True, "chat_template_args": {"enable_thinking": False}}
    a = chat.dataset([{"prompt": "What is pass?", "completion": "A null operation."}], tok, cfg)[0]
    b = chat.dataset([{"messages": [{"role": "user", "content": "What is pass?"},
                                    {"role": "assistant", "content": "A null operation."}]}], tok, cfg)[0]
    assert a == b and 98 not in a[0]


def sly_model(src, dst):
    """A copy whose template renders a user turn differently when the generation prompt follows."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{{ bos_token }}{% for m in messages %}<|turn>{{ m['role'] }}\n{{ m['content'] }}"
                            "{% if add_generation_prompt %}?{% endif %}<turn|>\n{% endfor %}"
                            "{% if add_generation_prompt %}<|turn>model\n{% endif %}")
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


def test_a_prompt_that_parts_from_the_record_before_the_answer_is_refused(variants, tmp_path):
    model = sly_model(variants["launch"], tmp_path / "sly")
    tok, cfg = tokenizer(model), {**C.DEFAULTS, "mask_prompt": True, "chat_template_args": {}}
    with pytest.raises(ValueError, match=r"the prompt and the record part at token \d+, before the generation "
                                         r"prompt: prompt '\?<turn\|>.*' vs record '<turn\|>.*' \(ids \[") as e:
        chat.dataset([{"messages": TURNS[:2]}], tok, cfg)[0]
    assert "mask_prompt: false" in str(e.value)
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"messages": TURNS[:2], "record_id": f"r{i}"}) + "\n"
                                              for i in range(4)))
    conf = tmp_path / "c.yaml"
    conf.write_text("batch_size: 2\niters: 2\nsave_every: 2\nmask_prompt: true\nval_batches: 0\n"
                    "chat_template_args: {enable_thinking: false}\n")
    p = run([PY, "bin/train.py", "--config", str(conf), "--model", str(model), "--data", str(data),
             "--run-dir", str(tmp_path / "run")], check=False, env=dict(os.environ, **OFFLINE))
    assert p.returncode == 11, p.stderr[-2000:]  # the data category: the record names its file and line
    assert f"{data / 'train.jsonl'}:1 (record_id r0) does not render" in p.stderr
    assert "the generation prompt does not start with the conversation before the answer" in p.stderr


def train(model, data_dir, conf, run_dir, records, config_text):
    data_dir.mkdir(exist_ok=True)
    (data_dir / "train.jsonl").write_text("".join(json.dumps({"messages": r}) + "\n" for r in records))
    conf.write_text(config_text)
    return run([PY, "bin/train.py", "--config", str(conf), "--model", str(model), "--data", str(data_dir),
                "--run-dir", str(run_dir)], check=False, env=dict(os.environ, **OFFLINE))


@pytest.mark.parametrize("args", [None, {}, {"add_generation_prompt": False}], ids=["unset", "empty", "other"])
def test_a_thinking_tokenizer_without_a_choice_is_refused_when_the_run_starts(variants, tmp_path, args):
    line = "" if args is None else f"chat_template_args: {json.dumps(args)}\n"
    p = train(variants["launch"], tmp_path / "data", tmp_path / "c.yaml", tmp_path / "run", [TURNS[:2]] * 2,
              "batch_size: 1\niters: 2\nsave_every: 2\n" + line)
    assert p.returncode == 2, p.stderr[-2000:]  # a config error, naming the choice and the anchor
    assert "has a thinking mode and the config does not choose it" in p.stderr
    assert "set `chat_template_args: {enable_thinking: false}`" in p.stderr
    assert p.stderr.strip().endswith("see RUNBOOK.md#chat-format")
    assert json.loads((tmp_path / "run" / "logs" / "rank-0.failure.json").read_text())["anchor"] == "chat-format"


def test_the_choice_is_validated_recorded_and_optional_without_a_thinking_mode(variants, tmp_path):
    with pytest.raises(C.ConfigError, match="chat_template_args must be null or a mapping of keyword arguments"):
        C.validate({"chat_template_args": ["enable_thinking"]})
    with pytest.raises(C.ConfigError, match="chat_template_args must be"):
        C.validate({"chat_template_args": {1: True}})
    conf = "num_layers: -1\nbatch_size: 1\niters: 2\nsave_every: 2\nval_batches: 0\nmask_prompt: true\n"
    p = train(variants["launch"], tmp_path / "data", tmp_path / "c.yaml", tmp_path / "run", [TURNS[:2]] * 2,
              conf + "chat_template_args: {enable_thinking: false}\n")
    assert p.returncode == 0, p.stderr[-2000:]
    joined = json.loads((tmp_path / "run" / "logs" / "rank-0.joined.json").read_text())
    rec = joined["chat_format"]["first_record"]
    assert joined["chat_format"]["chat_template_args"] == {"enable_thinking": False}
    assert joined["chat_format"]["has_thinking"] is True
    # trained as served: the generation prompt (launch template: the empty thought), then the answer
    assert rec["text"] == expected(TURNS[:1], False, "launch", True) + "A null operation.<turn|>\n"
    assert rec["targets"] == ["A null operation.<turn|>"]
    adapter_cfg = json.loads((tmp_path / "run" / "adapters" / "adapter_config.json").read_text())
    assert adapter_cfg["chat_template_args"] == {"enable_thinking": False}  # mlx-lm's adapter folder keeps it
    # a tokenizer without a thinking mode (the tiny llama) needs no choice
    run([PY, "demo/make_tiny_model.py", "--arch", "llama", "--out", str(tmp_path / "llama")],
        env=dict(os.environ, **OFFLINE))
    p = train(tmp_path / "llama", tmp_path / "data", tmp_path / "c.yaml", tmp_path / "run2", [TURNS[:2]] * 2, conf)
    assert p.returncode == 0, p.stderr[-2000:]


def model_script():
    spec = importlib.util.spec_from_file_location("model_script", ROOT / "bin" / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_snapshots_template_is_described_with_its_variant(variants):
    describe = model_script().chat_template
    for v, folder in variants.items():
        facts = describe(tokenizer(folder))
        text = json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
        assert facts == {"sha256": hashlib.sha256(text.encode()).hexdigest(), "has_thinking": True, "variant": v}


# ---- batching: length (lib/chat.py Renderer): targets, the served format, every assistant turn ------
def loaded_tokenizer(folder):
    """mlx-lm's tokenizer as a run loads it: eos_token_ids from the model's config (<turn|> among them)."""
    from mlx_lm.utils import load

    return load(str(folder))[1]


def renderer(tok, mask, thinking: bool):
    return chat.Renderer(tok, {**C.DEFAULTS, "mask_prompt": mask, "chat_template_args": {"enable_thinking": thinking}})


def visible(message: dict) -> str:
    return re.sub(r"<\|channel>.*?<channel\|>", "", message["content"], flags=re.S).strip()


@pytest.mark.parametrize("variant", ["launch", "current"])
@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("conv", [TURNS[:2], [SYSTEM, *TURNS]], ids=["single", "multi-turn-system"])
def test_the_last_answer_is_trained_after_exactly_the_served_generation_prompt(variants, variant, thinking, conv):
    tok = loaded_tokenizer(variants[variant])
    rendered = renderer(tok, True, thinking).record({"messages": conv})
    args = {"enable_thinking": thinking}
    served = tok.apply_chat_template(conv[:-1], add_generation_prompt=True, return_dict=False, **args)
    assert rendered.tokens[:len(served)] == served  # what mlx_lm generate / mlx_lm.server feed the model
    # the text from the format's description, built here: the generation prompt, the answer, its end
    text = expected(conv[:-1], thinking, variant, True) + visible(conv[-1]) + "<turn|>\n"
    assert tok.decode(rendered.tokens) == text
    assert rendered.spans[-1][0] == len(served)  # the prefix (role header, empty thought) is no target


@pytest.mark.parametrize("variant", ["launch", "current"])
@pytest.mark.parametrize("thinking", [False, True])
def test_every_assistant_turn_is_a_target_and_nothing_else(variants, variant, thinking):
    tok = loaded_tokenizer(variants[variant])
    conv = [SYSTEM, *TURNS]
    answers = [visible(m) + "<turn|>" for m in conv if m["role"] == "assistant"]
    every = renderer(tok, True, thinking).record({"messages": conv})
    assert chat.decoded_targets(tok, every) == answers
    last = renderer(tok, "last", thinking).record({"messages": conv})
    assert chat.decoded_targets(tok, last) == answers[-1:] and last.tokens == every.tokens
    plain = renderer(tok, False, thinking).record({"messages": conv})
    assert plain.spans == [(1, len(plain.tokens))] and plain.tokens == every.tokens
    # never a role header, a thought-channel marker, the newline after <turn|>, or a pad
    for a, b in every.spans:
        assert not {SPECIALS["<|turn>"], SPECIALS["<|channel>"], SPECIALS["<channel|>"], 0} & set(every.tokens[a:b])
        assert every.tokens[b - 1] == SPECIALS["<turn|>"] and every.tokens[b] == 107


def test_prompt_completion_records_render_as_their_chat(variants):
    tok = loaded_tokenizer(variants["launch"])
    r = renderer(tok, True, False)
    a = r.record({"prompt": "What is pass?", "completion": "A null operation."})
    b = r.record({"messages": [{"role": "user", "content": "What is pass?"},
                               {"role": "assistant", "content": "A null operation."}]})
    assert a == b and chat.decoded_targets(tok, a) == ["A null operation.<turn|>"]


def test_a_record_that_does_not_end_with_an_answer_is_refused(variants):
    tok = loaded_tokenizer(variants["launch"])
    with pytest.raises(ValueError, match="the last message is 'user', not 'assistant'"):
        renderer(tok, True, False).record({"messages": TURNS[:3]})


# ---- long records, record weights, epochs: what the trainer leaves out, counts and says -------------------
def weighted_run(model, tmp_path, name: str, extra: str, weights: list, long_at: set):
    """bin/train.py on one rank: records r0.. with these weights, those in long_at with a prompt so long
    that max_seq_length 48 cuts their whole answer. Returns (the process, rank 0's metrics events)."""
    data = tmp_path / f"data-{name}"
    data.mkdir()
    lines = []
    for i, w in enumerate(weights):
        question = "Why? " * 60 if i in long_at else f"What is {i}?"
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": f"It is {i}."}]
        lines.append(json.dumps({"messages": messages, "record_id": f"r{i}", "weight": w}) + "\n")
    (data / "train.jsonl").write_text("".join(lines))
    conf = tmp_path / f"{name}.yaml"
    conf.write_text("num_layers: -1\nbatch_size: 2\niters: 2\nsave_every: 2\nval_batches: 0\nmask_prompt: true\n"
                    "max_seq_length: 48\n"
                    "chat_template_args: {enable_thinking: false}\n" + extra)
    run_dir = tmp_path / f"run-{name}"
    p = run([PY, "bin/train.py", "--config", str(conf), "--model", str(model), "--data", str(data),
             "--run-dir", str(run_dir)], check=False, env=dict(os.environ, **OFFLINE))
    metrics = run_dir / "metrics.jsonl"
    events = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    return p, data / "train.jsonl", events


def test_records_that_lose_their_whole_answer_are_refused_or_left_out_and_counted(variants, tmp_path):
    p, path, _ = weighted_run(variants["launch"], tmp_path, "refused", "", [1.0] * 10, {3})
    assert p.returncode == 11, p.stderr[-2000:]  # the data category
    assert f"1 of 10 records of {path} lose their whole answer to max_seq_length 48" in p.stderr
    assert f"the first {path}:4 (record_id r3): raise max_seq_length" in p.stderr
    p, _, events = weighted_run(variants["launch"], tmp_path, "kept", "max_lost_answers: 0.2\n", [1.0] * 10, {3})
    assert p.returncode == 0, p.stderr[-2000:]
    train = next(e for e in events if e["kind"] == "data")["splits"]["train"]
    assert (train["records"], train["kept"], train["lost_answers"]) == (10, 9, 1)
    assert any(e["kind"] == "warning" and e["what"] == "lost-answers" for e in events)


def test_record_weights_train_weight_zero_never_and_ignored_weights_are_said(variants, tmp_path):
    weights = [1.0, 0.0, 0.5, 1.0, 1.0, 1.0]
    p, _, events = weighted_run(variants["launch"], tmp_path, "weights", "record_weights: true\n", weights, set())
    assert p.returncode == 0, p.stderr[-2000:]
    train = next(e for e in events if e["kind"] == "data")["splits"]["train"]
    assert (train["kept"], train["weight_zero"], train["weights_ignored"]) == (5, 1, False)
    assert not any(e["kind"] == "warning" and e["what"] == "weights-ignored" for e in events)
    p, _, events = weighted_run(variants["launch"], tmp_path, "ignored", "", weights, set())
    assert p.returncode == 0, p.stderr[-2000:]
    train = next(e for e in events if e["kind"] == "data")["splits"]["train"]
    assert (train["kept"], train["weight_zero"], train["weights_ignored"]) == (6, 0, True)
    assert "have a weight other than 1 and record_weights is false" in p.stdout


def test_epochs_outside_half_to_ten_are_warned(variants, tmp_path):
    p, _, events = weighted_run(variants["launch"], tmp_path, "epochs", "", [1.0] * 12, set())
    assert p.returncode == 0, p.stderr[-2000:]
    data = next(e for e in events if e["kind"] == "data")
    assert data["batches_per_epoch"] == 6 and data["epochs"] == round(2 / 6, 4)
    assert "iters 2 x batch_size 2 is 0.33 epochs of the 12 train records" in p.stdout


def test_the_shipped_configs_train_answers_only_never_exports_fixed_prompt(demo_inputs):
    """Observation 4: stage 1 trained prompts and template (mask_prompt: false), and export's fixed
    text prompt was in 39% of the train records. Under the shipped configs no target holds it."""
    from conftest import SAMPLE_DATASET

    from lib import jsonl

    fixed = "Write a passage from the reference documentation."
    tok = loaded_tokenizer(ROOT / "models" / "tiny-gemma4")
    records = list(jsonl.read(ROOT / "datasets" / SAMPLE_DATASET / "train.jsonl"))[:300]
    assert sum(fixed in json.dumps(r) for r in records) > 50  # the prompt is there to be learned
    for name in ("stage1", "demo"):
        cfg = C.resolve(ROOT / "configs" / f"{name}.yaml", {"model": "m", "data": "d"})
        assert cfg["mask_prompt"] is True and cfg["batching"] == "length", name
        r = chat.Renderer(tok, cfg)
        targets = [t for rec in records for t in chat.decoded_targets(tok, r.record(rec))]
        assert len(targets) == len(records)  # one answer each: single-turn records
        assert not any(fixed in t or "<|turn>" in t for t in targets), name
