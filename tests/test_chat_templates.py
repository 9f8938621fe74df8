"""Chat input on Hugging Face folders: the ids transformers' apply_chat_template gives (every key
of a message, the template's options), a template's refusals as ValueErrors, the generated text
of a sentencepiece tokenizer after its prompt, and the default stops of a config.json without
eos_token_id. Tiny folders: tests/chat_helpers.py."""

import json
import subprocess
import sys

import jax
import pytest

import spec_jax as sj
from spec_jax.models import chat
from spec_jax.models.tokenizers import decode_generated
from tests.chat_helpers import chat_folder

USER = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  root = tmp_path_factory.mktemp("chat")
  return {kind: chat_folder(root / kind, kind) for kind in ("chatml", "gemma2", "mistral")}


@pytest.fixture(scope="module")
def models(folders):
  return {kind: sj.load(folder) for kind, folder in folders.items()}


def hf_ids(model, conversation, **kwargs):
  ids = model.tokenizer.hf.apply_chat_template(conversation, add_generation_prompt=True,
                                               tokenize=True, **kwargs)
  return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_every_key_of_a_message_reaches_the_template(models):
  """tool_calls and reasoning_content were dropped (an empty assistant turn, no <think>)."""
  model = models["chatml"]
  tool_turn = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None,
                "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
               {"role": "tool", "content": "22C"}]
  thought = [{"role": "user", "content": "2+2?"},
             {"role": "assistant", "content": "4", "reasoning_content": "two plus two"},
             {"role": "user", "content": "And 3+3?"}]
  for conversation, shown in ((tool_turn, "get_weather"), (thought, "two plus two")):
    ids = chat.chat_ids(model, chat.check_conversation(conversation))
    assert ids == hf_ids(model, conversation)
    assert shown in model.tokenizer.hf.decode(ids)
  with pytest.raises(ValueError, match=r"content must be a string \(or None in an assistant "
                                       r"turn with tool_calls\), got NoneType"):
    chat.check_conversation([{"role": "user", "content": None}])


def test_template_options_reach_the_template(models):
  model = models["chatml"]
  off = chat.chat_ids(model, USER, chat_template_kwargs={"enable_thinking": False})
  assert off == hf_ids(model, USER, enable_thinking=False) != chat.chat_ids(model, USER)
  out = sj.generate(model, messages=[USER], max_new_tokens=2,
                    chat_template_kwargs={"enable_thinking": False})
  assert out.result.prompt_lens.tolist() == [len(off)]
  with pytest.raises(ValueError, match="chat_template_kwargs are the chat template's options: "
                                       "give messages too"):
    sj.generate(model, ["Hello"], max_new_tokens=2, chat_template_kwargs={"tools": []})
  for bad, message in (([1], "must be a dict of template variables"),
                       ({"tokenize": False}, r"sets \['tokenize'\]: apply_chat_template's own"),
                       ({"truncation": True, "max_length": 5},
                        r"sets \['max_length', 'truncation'\]"),
                       ({"chat_template": "{{ 'hi' }}"}, r"sets \['chat_template'\]"),
                       ({"messages": []}, r"sets \['messages'\]")):
    with pytest.raises(ValueError, match=message):
      sj.generate(model, messages=[USER], max_new_tokens=2, chat_template_kwargs=bad)


def test_a_conversation_the_template_refuses_is_a_value_error(models):
  """The template's raise_exception was a jinja2 TemplateError (the CLI: a traceback, rc 1)."""
  with pytest.raises(ValueError, match=r"messages\[1\]: the model's chat template refuses this "
                                       r"conversation: System role not supported"):
    sj.generate(models["gemma2"], messages=[USER, [{"role": "system", "content": "Be brief"}]
                                            + USER], max_new_tokens=2)
  with pytest.raises(ValueError, match="Conversation roles must alternate"):
    chat.chat_ids(models["mistral"], USER + USER)


def test_cli_refuses_a_conversation_and_bad_template_options_with_status_2(folders):
  base = [sys.executable, "-m", "spec_jax", "generate", "--chat", "--max-new-tokens", "1"]
  for extra, message in (
      (["--model", str(folders["gemma2"]), "--system", "Be brief"],
       "error: prompt 0: the model's chat template refuses this conversation: System role"),
      (["--model", str(folders["chatml"]), "--chat-template-kwargs", "{enable_thinking: 0}"],
       "error: --chat-template-kwargs '{enable_thinking: 0}' is not JSON")):
    res = subprocess.run(base + extra, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and message in res.stderr, res.stderr[-2000:]


def test_generated_text_of_a_sentencepiece_tokenizer_keeps_its_first_space(models):
  """Decoded alone, "▁t" after "Once upon a time" read "t" (the decoder strips a decode's
  leading space): generate's text and the CLI printed "timet"."""
  model = models["mistral"]
  hf = model.tokenizer.hf
  t = hf.convert_tokens_to_ids("\u2581t")
  prompt = model.encode("Once upon a time")
  assert decode_generated(model.tokenizer, [t]) == "t"
  assert decode_generated(model.tokenizer, [t], context=prompt) == " t"
  out = sj.generate(model, ["Once upon a time"], max_new_tokens=1, stop_tokens=[],
                    sampling=sj.Sampling(temperature=0.0, logit_bias={t: 100.0}))
  assert out.tokens == [[t]] and out.text == [" t"]
  whole = hf.decode(prompt + [t], skip_special_tokens=True)
  assert whole == "Once upon a time t" == "Once upon a time" + out.text[0]
  res = subprocess.run([sys.executable, "-m", "spec_jax", "generate", "--model",
                        str(model.tokenizer.hf.name_or_path), "--prompt", "Once upon a time",
                        "--max-new-tokens", "1", "--logit-bias", f"{t}:100"],
                       capture_output=True, text=True, timeout=300)
  assert res.returncode == 0 and res.stdout.splitlines()[0] == "Once upon a time t", res.stdout


def test_stops_of_a_config_without_eos_are_generation_configs(tmp_path):
  """LlamaConfig's class default eos_token_id=2 (an ordinary token here) was a stop token when
  config.json named none; transformers' generate stops at generation_config.json's."""
  folder = chat_folder(tmp_path / "f", "gemma2", config_eos=False,
                       generation_eos=["<eos>", "<end_of_turn>"])
  model = sj.load(folder)
  hf = model.tokenizer.hf
  want = tuple(hf.convert_tokens_to_ids(t) for t in ("<eos>", "<end_of_turn>"))
  assert hf.convert_ids_to_tokens(2) == "<bos>" and model.config.eos_token_ids == want
  assert chat.default_stop_ids(model) == want


def test_bench_chat_prompts_read_the_template_of_a_widened_spec(folders):
  from spec_jax.bench.chat_prompts import hf_tokenizer
  tok = hf_tokenizer("widened:" + str(folders["chatml"]))      # widening keeps the tokenizer
  assert tok.chat_template == chat_folder.__globals__["CHATML"]
  with pytest.raises(ValueError, match="need a real model's chat template"):
    hf_tokenizer("widened:random:llama")


# ----------------------------------------------------------------------------- the generate CLI

def test_cli_warns_of_options_that_cannot_act_and_refuses_a_huge_seed(capsys):
  """--top-p at the CLI's default temperature 0 printed the greedy text without a word; a seed
  of 2**64 was an OverflowError traceback."""
  from spec_jax.__main__ import main
  from tests.conftest import need_shared
  stories = str(need_shared("models", "stories260K"))
  assert main(["generate", "--model", stories, "--max-new-tokens", "2", "--top-p", "0.5",
               "--num-draft", "2"]) == 0
  err = capsys.readouterr().err
  assert "warning: --top-p act on sampling only, and --temperature is 0" in err
  assert "warning: --num-draft is the drafter's K per round; without --drafter" in err
  assert main(["generate", "--model", stories, "--seed", str(2**64)]) == 2
  assert "--seed 18446744073709551616 is outside" in capsys.readouterr().err


def test_cli_attention_impl_reaches_a_draft_model_inside_lookup_first():
  """ngram+draft:MODEL kept the draft model's 'auto' (and skipped its prepare_model)."""
  from spec_jax.__main__ import _with_draft_model
  from tests.conftest import need_shared
  model = sj.load(need_shared("models", "stories260K"))
  inner = sj.drafters.DraftModel(sj.load(need_shared("models", "stories260K")))
  wrapped = sj.drafters.LookupFirst(inner, sj.drafters.NGram())
  set_impl = lambda m: __import__("dataclasses").replace(
      m, config=m.config.replace(attention_impl="reference"))
  for drafter in (inner, wrapped):
    out = _with_draft_model(drafter, set_impl)
    draft = out.fallback if isinstance(out, sj.drafters.LookupFirst) else out
    assert draft.model.config.attention_impl == "reference"
    assert type(out) is type(drafter)
  assert _with_draft_model(sj.drafters.NGram(), set_impl) == sj.drafters.NGram()
  assert model.config.attention_impl != "reference"


def test_compile_cache_that_cannot_be_made_runs_without_it(tmp_path):
  """A cache folder that cannot be made (a read-only or missing home) was a traceback, exit 1,
  in generate and eval; the cache only saves time."""
  import os
  blocker = tmp_path / "file"
  blocker.write_text("")                   # XDG_CACHE_HOME a file, where a folder must go
  env = {k: v for k, v in os.environ.items()
         if k not in ("SPEC_JAX_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR")}
  env["XDG_CACHE_HOME"] = str(blocker)
  res = subprocess.run([sys.executable, "-c", "from spec_jax import compile_cache; "
                        "print(compile_cache.enable())"], capture_output=True, text=True,
                       env=env, timeout=120)
  assert res.returncode == 0 and res.stdout.strip() == "None", res.stderr
  assert "warning: no compile cache" in res.stderr
