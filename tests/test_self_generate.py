"""train.self_generate (issue 31): an instruct target writes its own training conversations
(Magpie): the user turn from the template's user-turn prefix alone, then the answer; batched,
deduplicated, resumable shards; the trainer's `self_generated` data source."""

import jax
import numpy as np
import pytest

import spec_jax as sj
from tests.conftest import ROOT, need_shared
from train import config as train_config, data as train_data


def resolve(raw: dict) -> dict:
  """A config dict as load_config makes it from YAML (checked keys, defaults, validated)."""
  train_config._check(raw, train_config.DEFAULTS)
  return train_config.validate(train_config._merge(train_config.DEFAULTS, raw))
from spec_jax.models.chat import chat_ids
from train.self_generate import load_conversations, self_generate, user_turn_prefix


@pytest.fixture(scope="module")
def smol():
  return sj.load(need_shared("models", "smollm2-135m-instruct"), dtype="bfloat16")


@pytest.mark.optimized
def test_conversations_are_written_deduplicated_and_resumed(smol, tmp_path, monkeypatch):
  prefix = user_turn_prefix(smol)
  hf = smol.tokenizer.hf
  assert hf.decode(prefix).endswith("<|im_start|>user\n"), hf.decode(prefix)
  steered = hf.decode(user_turn_prefix(smol, "You answer in French."))
  assert steered.endswith("system\nYou answer in French.<|im_end|>\n<|im_start|>user\n"), steered
  out = tmp_path / "sg"
  kw = dict(batch=4, user_batch=4, user_tokens=40, answer_tokens=16, seed=0, log=lambda m: None)
  seqs = self_generate(smol, 3, out, **kw)
  assert len(seqs) == 3
  stored, users = load_conversations(out)
  assert len(stored) == len(users) >= 3 and len({u.lower() for u in users}) == len(users)
  for seq, user in zip(stored, users):
    assert seq[:len(prefix)] == prefix                      # the template, then the message
    decoded = hf.decode(seq)
    assert user in decoded and "<|im_start|>assistant\n" in decoded
  # Resumed: the finished shards are read, not regenerated; asking for more extends them.
  shards = sorted(p.name for p in out.glob("shard_*.npz"))
  calls = []
  real = sj.generate
  monkeypatch.setattr(sj, "generate", lambda *a, **k: calls.append((a, k)) or real(*a, **k))
  assert self_generate(smol, 3, out, **kw) == seqs and not calls
  # The extension answers greedily (answer_temperature=0) while the question stays sampled,
  # and asks after the steering system prompts in turn (question j: system_prompts[j % n]).
  systems = ["", "You are a math tutor. Users ask you to solve word problems."]
  more = self_generate(smol, len(stored) + 1, out, **kw, answer_temperature=0.0,
                       system_prompts=systems)
  assert more[:len(stored)] == stored and len(more) == len(stored) + 1
  (ask_args, asked), (_, answered) = calls
  steered = user_turn_prefix(smol, systems[1])
  first = len(shards) * kw["user_batch"]                   # questions asked before this batch
  assert ask_args[1] == [[prefix, steered][(first + r) % 2] for r in range(kw["user_batch"])]
  assert asked["sampling"].temperature == 1.0 and answered["sampling"].temperature == 0.0
  again = real(smol, messages=answered["messages"], max_new_tokens=16,
               sampling=sj.Sampling(temperature=0.0), key=jax.random.key(7))
  new, new_rows = more[len(stored):], answered["messages"][:len(more) - len(stored)]
  for seq, row, answer in zip(new, new_rows, again.tokens):
    assert seq == chat_ids(smol, row) + list(answer)      # the greedy answer, whatever the key
  assert sorted(p.name for p in out.glob("shard_*.npz"))[:len(shards)] == shards
  with pytest.raises(ValueError, match="answer_temperature"):
    self_generate(smol, 1, tmp_path / "bad", answer_temperature=-1.0)
  with pytest.raises(ValueError, match="system_prompts must be a list of strings"):
    self_generate(smol, 1, tmp_path / "bad", system_prompts="be brief")
  assert not (tmp_path / "bad").exists()                  # refused before anything is written


@pytest.mark.optimized
def test_the_trainer_reads_self_generated_conversations(smol, tmp_path):
  cfg = resolve({"target": "x", "out_dir": str(tmp_path), "head": {"kind": "eagle3"},
                              "data": {"sources": ["self_generated"], "window": 16,
                                       "cache_dir": str(tmp_path / "cache"),
                                       "self_generate": {"conversations": 2, "batch": 4,
                                                         "user_batch": 4,
                                                         "user_tokens": 40,
                                                         "answer_tokens": 16}}})
  windows = train_data.build_windows(smol, cfg["data"], "fp", seed=1, log=lambda m: None)
  assert windows.shape[1] == 16 and windows.shape[0] >= 2
  assert np.isin(user_turn_prefix(smol)[:4], windows).all()
  with pytest.raises(ValueError, match="self_generate.batch"):
    resolve({"target": "x", "out_dir": "o", "head": {"kind": "eagle3"},
                          "data": {"sources": ["self_generated"],
                                   "self_generate": {"batch": 0}}})
  with pytest.raises(ValueError, match="self_generate.system_prompts"):
    resolve({"target": "x", "out_dir": "o", "head": {"kind": "eagle3"},
             "data": {"sources": ["self_generated"],
                      "self_generate": {"system_prompts": "be brief"}}})
  with pytest.raises(ValueError, match="self_generate.answer_temperature"):
    resolve({"target": "x", "out_dir": "o", "head": {"kind": "eagle3"},
             "data": {"sources": ["self_generated"],
                      "self_generate": {"answer_temperature": -0.5}}})


def test_evaluation_prompts_from_a_prompt_set_use_the_chat_template(smol):
  """eval.path: spec_bench gives the first turns of its questions, round-robin over its
  categories, in the chat template; a text file keeps its paragraphs' first tokens."""
  from spec_jax.bench.prompts import read_prompt_records
  from train.evaluate import heldout_prompts
  prompts = heldout_prompts(smol, "spec_bench", 13, 12)
  records = read_prompt_records("spec_bench")
  categories = list(dict.fromkeys(r.category for r in records))
  assert len(prompts) == 13 and len(categories) >= 13
  firsts = [next(r for r in records if r.category == c).turns[0] for c in categories[:13]]
  hf = smol.tokenizer.hf
  for ids, question in zip(prompts, firsts):
    text = hf.decode(ids)
    assert question.strip()[:40] in text and text.endswith("<|im_start|>assistant\n"), text
  assert all(len(p) == 12 for p in heldout_prompts(smol, "tinystories", 3, 12))


def test_shipped_smollm2_configs_validate():
  for name in ("distill_smollm2_eagle3", "distill_smollm2_dflash"):
    cfg = train_config.load_config(ROOT / "configs" / f"{name}.yaml")
    assert cfg["data"]["sources"] == ["self_generated"] and cfg["target_dtype"] == "bfloat16"


def test_a_run_killed_inside_a_shard_write_resumes_without_a_gap(tmp_path, monkeypatch):
  """A kill inside np.savez leaves shard_0000N.npz.tmpPID.npz. The resume counted it as a
  shard (glob shard_*.npz) and wrote shard N + 1, leaving a gap at N that load_conversations
  stops at: every later shard was lost, and each resume trained on other data. The target and
  sj.generate are stand-ins: only the shard bookkeeping is under test."""
  import itertools
  import types
  from train import self_generate as sg
  ids = itertools.count(100)

  class Out:
    def __init__(self, rows, users: bool):
      self.tokens = [[next(ids), 2] for _ in rows]              # distinct, ended by stop id 2
      self.text = [f"question number {t[0]}" for t in self.tokens] if users else [""] * len(rows)

  fake = lambda target, prompts=None, messages=None, **kw: Out(prompts or messages, prompts)
  monkeypatch.setattr(sg, "sj", types.SimpleNamespace(generate=fake, Sampling=lambda **k: None))
  monkeypatch.setattr(sg, "user_turn_prefix", lambda target, system="": [1, 7])
  monkeypatch.setattr(sg, "stop_array", lambda target, stops: np.array([2]))
  monkeypatch.setattr(sg, "chat_ids", lambda target, conv: [1, 7, 9])
  kw = dict(batch=4, user_batch=4, log=lambda m: None)
  out = tmp_path / "sg"
  sg.self_generate(None, 8, out, **kw)
  (out / "shard_00002.npz.tmp12345.npz").write_bytes(b"partial")
  second = sg.self_generate(None, 16, out, **kw)
  assert sorted(p.name for p in out.iterdir()) == [f"shard_{i:05d}.npz" for i in range(4)]
  assert load_conversations(out)[0] == second and len(second) == 16
  assert sg.self_generate(None, 16, out, **kw) == second         # nothing regenerated
