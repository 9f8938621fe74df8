"""Grammar constraints and logits processors (issue 32): bad input, the compiled automaton,
losslessness under speculation (chi-square against the exact constrained, processed target
joint, with a lossy variant that must fail), greedy equality with plain decoding, transformers
parity of the example processors, and sampled decodes that all parse.

The vocabulary-8 models of tests/test_lossless.py get a synthetic tokenizer: tokens 0-6 write
the letters a-g, token 7 is the end token. PATTERN makes the allowed set depend on the previous
token (after "a" only b / c, after "d" only e / f), so a verify position that does not advance
the grammar along its drafted prefix allows tokens plain decoding never emits.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from spec_jax.decoding import rounds
from spec_jax.decoding.compiled import clear_compiled
from spec_jax.decoding.strategies import tree as tree_strategy
from spec_jax.sampling import History
from tests.conftest import need_shared
from tests.stats_helpers import assert_same_distribution, chi2_sf, chi_square
from tests.test_lossless import PROMPT, V, _models, joint_counts
from tests.test_sampling_controls import exact_joint_processed as exact_joint

# Rows per sampled joint: half of test_lossless's 40k. Enough power here: a lossy grammar
# state emits tokens of probability 0 (chi-square = inf), and every joint below has ~100 bins
# of non-zero probability (expected counts >= 5 pooled).
N = 20_000

LETTERS = [bytes([ord("a") + i]) for i in range(V - 1)] + [None]
END = V - 1
PATTERN = r"(a[bc]|d[ef]|g)*"
CONTROLS = dict(min_p=0.05, repetition_penalty=1.8, presence_penalty=0.7,
                frequency_penalty=0.4, logit_bias={5: 1.5, 2: -0.5})


def grammar(pattern=PATTERN):
  return sj.constraints.regex(pattern).compile(vocabulary=LETTERS, vocab_size=V,
                                                end_ids=(END,))


# ------------------------------------------------------------------------------ bad input

@pytest.mark.parametrize("make,match", [
    (lambda: sj.constraints.regex(""), "regex"),
    (lambda: sj.constraints.regex(123), "regex"),
    (lambda: grammar("(ab"), "regex"),
    (lambda: grammar("z+"), "no token sequence"),
    (lambda: sj.constraints.json_schema("{not json"), "json_schema"),
    (lambda: sj.constraints.json_schema({"type": "object", "properties": {"a": {"$ref": "#/x"}}}),
     "json_schema"),
    # The compiler wraps the pattern as (?:P)<sentinel>: a ')' closed the wrapper's group and
    # 'a)|(b' compiled to another language; '$' never precedes the sentinel ('ab$' read as
    # unsatisfiable); a verbose-mode comment swallowed the ')'.
    (lambda: sj.constraints.regex("a)|(b"), r"unbalanced '\)' at position 1"),
    (lambda: sj.constraints.regex("(a|b"), r"1 unclosed '\('"),
    (lambda: sj.constraints.regex("ab$"), r"the anchor '\$'"),
    (lambda: sj.constraints.regex("^ab"), r"the anchor '\^'"),
    (lambda: sj.constraints.regex(r"\Aab"), r"the anchor \\A"),
    (lambda: sj.constraints.regex("(?x)a b # c"), "verbose mode"),
    # Keywords outlines-core ignores: outputs broke the schema (integers past the maximum).
    (lambda: sj.constraints.json_schema({"type": "integer", "maximum": 5}),
     "# uses maximum, which the grammar would not enforce"),
    (lambda: sj.constraints.json_schema({"type": "object", "properties": {"a": {
        "type": "array", "items": {"type": "integer", "multipleOf": 2}}}}),
     "#/properties/a/items uses multipleOf"),
    (lambda: sj.constraints.json_schema({"type": "string", "pattern": "^a|b$"}), "uses pattern"),
    (lambda: sj.constraints.json_schema({"oneOf": [{"type": "number"}, {"type": "integer"}]}),
     "oneOf compiles as anyOf"),
    (lambda: sj.constraints.json_schema({"type": "object", "required": ["x"]}),
     r"required names \['x'\], which are not in its properties"),
    (lambda: sj.constraints.regex("a").compile(vocabulary=LETTERS, vocab_size=V, end_ids=()),
     "end token"),
    (lambda: sj.constraints.regex("a").compile(vocab_size=V, end_ids=(END,)), "tokenizer"),
    (lambda: sj.processors.NoRepeatNGram(n=1), "NoRepeatNGram.n"),
    (lambda: sj.processors.BannedPhrases(phrases=((),)), "BannedPhrases"),
])
def test_bad_grammars_and_processors_raise(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_bad_input_is_refused_before_any_compile(monkeypatch):
  target, _ = _models()

  def no_compile(*a, **k):
    raise AssertionError("compiled before the check")

  monkeypatch.setattr("spec_jax.decoding.generate.compiled_decode_call", no_compile)
  with pytest.raises(ValueError, match="constraint must be"):
    sj.generate(target, [PROMPT], max_new_tokens=2, constraint=PATTERN)
  with pytest.raises(ValueError, match="tokenizer"):      # this model has none
    sj.generate(target, [PROMPT], max_new_tokens=2, constraint=sj.constraints.regex("a"))
  with pytest.raises(ValueError, match="LogitsProcessor"):
    sj.generate(target, [PROMPT], max_new_tokens=2, processors=[lambda x: x])


@pytest.mark.parametrize("pattern", [PATTERN, "(ab)*", "a(b|c)*d?", "(g|ab)+e", "x?ab",
                                     "a{2,3}(bc)*", "a.c?", "[^a]b*", "(a.)*", "(?P<x>a)[)(]?"])
def test_the_automaton_accepts_exactly_the_language(pattern):
  """Every word of up to 5 letters: the token automaton accepts it iff Python's re matches it
  in full (outlines-core 0.2.14 alone drops the moves out of accepting states: "(ab)*" would
  allow no "a" at all; constraints.py works around it with a sentinel, and '.' / '[^a]', which
  read the sentinel too, made "a" a complete "a.c?")."""
  import itertools
  import re
  g = grammar(pattern)
  for n in range(6):
    for word in map("".join, itertools.product("abcdefg", repeat=n)):
      assert g.accepts([ord(c) - ord("a") for c in word]) == bool(re.fullmatch(pattern, word)), \
          (pattern, word)


def test_the_tables_share_token_classes_and_allow_ends_when_complete():
  g = grammar()
  classes, nxt, initial = g.tables
  assert nxt.shape == (g.num_states, g.num_classes) and classes.shape == (V,)
  # b and c behave alike everywhere (one class), e and f too.
  assert classes[1] == classes[2] and classes[4] == classes[5] and classes[1] != classes[4]
  allowed = lambda state: np.asarray(g.allowed(g.params, jnp.asarray(state))).astype(int)
  np.testing.assert_array_equal(allowed(initial), [1, 0, 0, 1, 0, 0, 1, 1])   # a d g, end
  after_a = g.advance(g.params, jnp.asarray(initial), jnp.asarray(0))
  np.testing.assert_array_equal(allowed(after_a), [0, 1, 1, 0, 0, 0, 0, 0])   # b c, no end
  dead = g.advance(g.params, after_a, jnp.asarray(0))                         # "aa"
  assert int(dead) == g.dead and allowed(dead).all()      # never an empty distribution


# ------------------------------------------------------------------- losslessness (V = 8)

def sample(drafter, sampling, processors, seed, prompt=PROMPT, **kw):
  target, _ = _models()
  out = sj.generate(target, [prompt] * N, drafter=drafter, max_new_tokens=3, sampling=sampling,
                    key=jax.random.key(seed), stop_tokens=[], capacity=24,
                    prompt_bucket=len(prompt),
                    processors=processors, **kw)
  toks = np.asarray(out.tokens)
  assert toks.shape == (N, 3)
  return toks, out.stats


def _draft_model():
  return sj.drafters.DraftModel(_models()[1])


def _eagle3():
  from spec_jax.drafters import EAGLE3
  return EAGLE3.init(_models()[0], key=jax.random.key(5), init_std=0.5,
                     draft_tokens=[i for i in range(V) if i != 5])


def _dflash():
  from tests.test_dflash import tiny
  return tiny()[1]


# (drafter, strategy, sampling, processors): the constraint alone and with every control, a
# user processor, at T = 1 and T = 0.7, chains and trees.
MATRIX = {
    "draft-chain-T1": (_draft_model, dict(num_draft=2), sj.Sampling(1.0), "grammar"),
    "draft-chain-T0.7-all": (_draft_model, dict(num_draft=2), sj.Sampling(0.7, **CONTROLS),
                             "grammar"),
    "draft-tree-T1-all": (_draft_model, dict(tree=sj.TreeSpec(depth=2, top_k=2, num_nodes=4)),
                          sj.Sampling(1.0, **CONTROLS), "grammar"),
    "eagle3-chain-T0.7": (_eagle3, dict(num_draft=2), sj.Sampling(0.7, top_p=0.9), "grammar"),
    "dflash-chain-T1": (_dflash, dict(num_draft=3), sj.Sampling(1.0), "grammar"),
    "dflash-tree-T0.7": (_dflash, dict(tree=sj.TreeSpec(2, 2, 4)), sj.Sampling(0.7), "grammar"),
    "draft-chain-T1-norepeat": (_draft_model, dict(num_draft=2), sj.Sampling(1.0), "norepeat"),
}
PROCESSORS = {"grammar": lambda: (grammar(),),
              "norepeat": lambda: (sj.processors.NoRepeatNGram(n=2, window=16),)}


@pytest.mark.parametrize("case", list(MATRIX))
def test_constrained_speculation_is_lossless(case):
  make, kw, sampling, procs = MATRIX[case]
  processors = PROCESSORS[procs]()
  toks, stats = sample(make(), sampling, processors, seed=7, **kw)
  assert 0.02 < stats.acceptance_rate < 0.99, stats.summary()
  assert_same_distribution(joint_counts(toks), exact_joint(_models()[0], PROMPT, sampling,
                                                           processors), alpha=1e-3)


def test_ngram_drafts_under_a_grammar_are_lossless():
  prompt = [0, 1, 6, 0, 1, 6, 0]       # "abgabga": n-gram drafts "b g a ..."
  processors = (grammar(),)
  sampling = sj.Sampling(1.0)
  toks, stats = sample(sj.drafters.NGram(2, 1), sampling, processors, seed=8, prompt=prompt,
                       num_draft=2)
  assert stats.drafted > N // 2, stats.summary()
  assert_same_distribution(joint_counts(toks), exact_joint(_models()[0], prompt, sampling,
                                                           processors))


def _committed_only(history, n):
  """The lossy history: every verify position gets the committed grammar state (the drafted
  prefix left out)."""
  states = jax.tree.map(lambda a: jnp.broadcast_to(a[:, None], (a.shape[0], n) + a.shape[1:]),
                        history.states)
  return history.replace(states=states, lead=2)


@pytest.mark.parametrize("where", ["chain", "tree"])
def test_a_grammar_state_without_the_drafted_prefix_fails_the_same_test(monkeypatch, where):
  processors = (grammar(),)
  sampling = sj.Sampling(1.0)
  if where == "chain":
    monkeypatch.setattr(rounds, "chain_history",
                        lambda h, drafts: _committed_only(h, drafts.shape[1] + 1))
    kw = dict(num_draft=2)
  else:
    monkeypatch.setattr(tree_strategy, "tree_history",
                        lambda h, tree, depth: _committed_only(h, tree.tokens.shape[1]))
    kw = dict(tree=sj.TreeSpec(depth=2, top_k=2, num_nodes=4))
  clear_compiled()
  try:
    toks, _ = sample(_draft_model(), sampling, processors, seed=7, **kw)
  finally:
    clear_compiled()
  stat, dof = chi_square(joint_counts(toks), exact_joint(_models()[0], PROMPT, sampling,
                                                         processors))
  assert chi2_sf(stat, dof) < 1e-6, (stat, dof)


# --------------------------------------------------------------------- greedy equality

@pytest.mark.parametrize("procs", ["grammar", "norepeat", "banned"])
def test_greedy_speculation_equals_plain_greedy_under_processors(procs):
  target, draft = _models()
  processors = {"grammar": (grammar(),), "norepeat": (sj.processors.NoRepeatNGram(n=2),),
                "banned": (sj.processors.BannedPhrases(phrases=((4, 2), (6,))),)}[procs]
  prompts = [PROMPT, [3, 0, 1, 5], [6, 6, 2]]
  run = lambda **kw: np.asarray(sj.generate(
      target, prompts, max_new_tokens=12, sampling=sj.Sampling(0.0), stop_tokens=[],
      processors=processors, **kw).tokens)
  plain = run()
  free = np.asarray(sj.generate(target, prompts, max_new_tokens=12, sampling=sj.Sampling(0.0),
                                stop_tokens=[]).tokens)
  assert (plain != free).any()                  # the processor changes the path
  if procs == "grammar":
    g = processors[0]
    for row in plain:
      body = list(row[:list(row).index(END)] if END in row else row)
      assert g.accepts(body) or END not in row
  for kw in (dict(drafter=sj.drafters.DraftModel(draft), num_draft=3),
             dict(drafter=sj.drafters.DraftModel(draft),
                  tree=sj.TreeSpec(depth=2, top_k=2, num_nodes=4)),
             dict(drafter=sj.drafters.NGram(2, 1), num_draft=2)):
    np.testing.assert_array_equal(run(**kw), plain)


# --------------------------------------------------------- the example processors' parity

def test_example_processors_match_transformers():
  """NoRepeatNGram / BannedPhrases against transformers' NoRepeatNGramLogitsProcessor /
  NoBadWordsLogitsProcessor on random histories: the same tokens masked."""
  torch = pytest.importorskip("torch")
  from transformers.generation import logits_process as lp
  rng = np.random.default_rng(0)
  vocab, length = 11, 14
  seqs = rng.integers(0, 4, size=(6, length)).astype(np.int32)   # small alphabet: repeats
  logits = rng.normal(size=(6, vocab)).astype(np.float32)
  for proc, ref in [
      (sj.processors.NoRepeatNGram(n=2, window=32), lp.NoRepeatNGramLogitsProcessor(2)),
      (sj.processors.NoRepeatNGram(n=3, window=32), lp.NoRepeatNGramLogitsProcessor(3)),
      (sj.processors.BannedPhrases(phrases=((1, 2), (3,), (0, 1, 3))),
       lp.NoBadWordsLogitsProcessor([[1, 2], [3], [0, 1, 3]], eos_token_id=vocab - 1))]:
    hist = History.of_prompt(jnp.asarray(seqs), jnp.full((6,), length), vocab, penalties=False,
                             processors=(proc,), params=(proc.params,))
    ours = np.asarray(sj.sampling.process_logits(jnp.asarray(logits), sj.Sampling(), hist))
    theirs = ref(torch.as_tensor(seqs, dtype=torch.long), torch.as_tensor(logits)).numpy()
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(theirs), err_msg=type(proc).__name__)
    assert np.isinf(ours).any()
    # The same after committing more tokens one by one (advance, not init).
    more = rng.integers(0, 4, size=(6, 3)).astype(np.int32)
    ours2 = np.asarray(sj.sampling.process_logits(
        jnp.asarray(logits), sj.Sampling(), hist.add(jnp.asarray(more), jnp.full((6,), 3))))
    theirs2 = ref(torch.as_tensor(np.concatenate([seqs, more], 1), dtype=torch.long),
                  torch.as_tensor(logits)).numpy()
    np.testing.assert_array_equal(np.isinf(ours2), np.isinf(theirs2))


# -------------------------------------------------- real tokenizers: sampled decodes parse

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "kind": {"enum": ["cat", "dog", "fox"]},
    "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
    "size": {"type": "number"},
    "home": {"type": "object", "properties": {"town": {"type": "string", "maxLength": 5}},
             "required": ["town"]}},
    "required": ["name", "kind", "tags", "size", "home"]}


def _valid(doc) -> bool:
  """SCHEMA's rules, checked by hand."""
  return (isinstance(doc, dict) and set(doc) == set(SCHEMA["properties"]) and
          isinstance(doc["name"], str) and len(doc["name"]) <= 6 and
          doc["kind"] in ("cat", "dog", "fox") and isinstance(doc["tags"], list) and
          len(doc["tags"]) <= 2 and all(isinstance(t, int) for t in doc["tags"]) and
          isinstance(doc["size"], (int, float)) and isinstance(doc["home"], dict) and
          set(doc["home"]) == {"town"} and isinstance(doc["home"]["town"], str) and
          len(doc["home"]["town"]) <= 5)


@pytest.fixture(scope="module")
def stories():
  return sj.load(need_shared("models", "stories260K"))


@pytest.mark.parametrize("kind", ["json", "regex"])
@pytest.mark.optimized
def test_two_hundred_sampled_decodes_parse(stories, kind):
  """200 rows at T = 1 with n-gram speculation on a real (sentencepiece, byte-fallback)
  tokenizer: every row that ends (with EOS) parses and satisfies the schema / matches the
  regex; a row cut at max_new_tokens (a story model writes long numbers) is a prefix the
  grammar still admits."""
  import re
  constraint = (sj.constraints.json_schema(SCHEMA) if kind == "json" else
                sj.constraints.regex(r"[A-Z][a-z]{1,8} (is|was) [0-9]{1,3} (cats|dogs)\."))
  out = sj.generate(stories, ["Once upon a time"] * 200, drafter=sj.drafters.NGram(),
                    num_draft=3, max_new_tokens=160, sampling=sj.Sampling(1.0),
                    key=jax.random.key(0), constraint=constraint)
  eos = set(stories.tokenizer.eos_ids)
  grammar = constraint.compile(stories.tokenizer, vocab_size=stories.config.vocab_size,
                               end_ids=tuple(eos))
  ended = 0
  for toks, text in zip(out.tokens, out.text):
    if not (toks and toks[-1] in eos):
      assert len(toks) == 160 and grammar.admits(toks), text
    else:
      ended += 1
      if kind == "json":
        assert _valid(json.loads(text)), text
      else:
        assert re.fullmatch(r"[A-Z][a-z]{1,8} (is|was) [0-9]{1,3} (cats|dogs)\.", text.strip()), text
  assert ended >= 180, ended


def test_a_json_schema_over_the_real_49k_vocabulary():
  """SmolLM2's byte-level BPE vocabulary: the schema compiles in seconds into a small table,
  and a greedy chat answer under it is valid JSON (with n-gram speculation, equal to plain)."""
  from spec_jax.models.chat import default_stop_ids
  model = sj.load(need_shared("models", "smollm2-135m-instruct"), dtype="float32")
  # The end ids generate() compiles the schema with (the default stops: <|im_end|> and
  # <|endoftext|>): the generates below reuse this grammar instead of compiling the 49k-token
  # schema a second time.
  g = sj.constraints.json_schema(SCHEMA).compile(model.tokenizer,
                                                  vocab_size=model.config.vocab_size,
                                                  end_ids=default_stop_ids(model))
  assert g.compile_seconds < 10 and g.sizes["classes"] < 2000, (g.compile_seconds, g.sizes)
  msgs = [[{"role": "user", "content": "Describe a pet as JSON."}]]
  kw = dict(messages=msgs, max_new_tokens=64, sampling=sj.Sampling(0.0),
            constraint=sj.constraints.json_schema(SCHEMA))
  plain = sj.generate(model, **kw)
  spec = sj.generate(model, drafter=sj.drafters.NGram(), num_draft=3, **kw)
  assert spec.tokens == plain.tokens
  assert plain.tokens[0][-1] in model.tokenizer.eos_ids, plain.text   # it ends by itself
  assert _valid(json.loads(plain.text[0])), plain.text[0]
  assert g.accepts(plain.tokens[0][:-1])


# ----------------------------------------------------------------------------- the CLIs

def test_generate_command_line_takes_a_regex_and_a_schema_file(tmp_path, capsys):
  from spec_jax.__main__ import main
  model = str(need_shared("models", "stories260K"))
  schema = tmp_path / "schema.json"
  schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                                "required": ["n"]}))
  assert main(["generate", "--model", model, "--prompt", "Once", "--max-new-tokens", "24",
               "--json-schema", str(schema), "--drafter", "ngram"]) == 0
  out = capsys.readouterr()
  text = out.out.splitlines()[0][len("Once"):]
  assert isinstance(json.loads(text)["n"], int), text
  assert "warning" not in out.err
  # Cut by --max-new-tokens inside the object: printed as it is, and said to be unfinished.
  assert main(["generate", "--model", model, "--prompt", "Once", "--max-new-tokens", "3",
               "--json-schema", str(schema)]) == 0
  assert "row(s) [0] reached --max-new-tokens 3 before their grammar was complete" in (
      capsys.readouterr().err)
  # Cut after a whole match (any text of [a-z ]+ is one): a match, no warning (it said "not a
  # match" of every cut row).
  assert main(["generate", "--model", model, "--prompt", "Once", "--max-new-tokens", "6",
               "--regex", "[a-z ]+"]) == 0
  out = capsys.readouterr()
  assert re.fullmatch("[a-z ]+", out.out.splitlines()[0][len("Once"):]) and "warning" not in out.err
  # The two calls the command line just made (greedy, its default; one row): their compiled
  # decodes are reused.
  stories = sj.load(model)
  cut = sj.generate(stories, ["Once"], max_new_tokens=6, constraint=(
      sj.constraints.regex("[a-z ]+")), sampling=sj.Sampling(temperature=0.0))
  assert cut.complete == [True] and len(cut.tokens[0]) == 6
  unfinished = sj.generate(stories, ["Once"], max_new_tokens=3, constraint=(
      sj.constraints.json_schema(json.loads(schema.read_text()))),
      sampling=sj.Sampling(temperature=0.0))
  assert unfinished.complete == [False]
  for argv, match in ((["--regex", "a", "--json-schema", str(schema)], "not both"),
                      (["--json-schema", str(tmp_path / "missing.json")], "cannot read"),
                      (["--regex", "(a"], "regex")):
    assert main(["generate", "--model", model, "--prompt", "Once", *argv]) == 2
    assert match in capsys.readouterr().err


def test_eval_runs_one_category_under_a_schema(tmp_path):
  """python -m spec_jax.eval --category beta --json-schema FILE: only that category's
  requests, every answer (plain and n-gram, equal under the greedy check) valid JSON."""
  from spec_jax.eval import cli
  from tests.test_eval import PROMPTS, TINY
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS[:3]))
  schema = tmp_path / "schema.json"
  schema.write_text(json.dumps({"enum": ["yes", "no", "maybe"]}))
  out = tmp_path / "run"
  assert cli.main(["--target", str(need_shared("models", TINY)), "--drafter", "ngram",
                   "--prompts", str(prompts), "--max-new-tokens", "6", "--out", str(out),
                   "--no-progress", "--category", "beta", "--json-schema", str(schema)]) == 0
  res = json.loads((out / "results.json").read_text())
  assert {r["category"] for r in res["requests"]} == {"beta"}
  assert res["greedy_check"]["checked"]
  units = [json.loads(p.read_text()) for p in (out / "units").glob("*.json")]
  answers = [t for u in units for t in u["answers"]["text"]]
  assert answers and all(json.loads(t) in ("yes", "no", "maybe") for t in answers), answers
  with pytest.raises(SystemExit):
    cli.main(["--target", "x", "--drafter", "ngram", "--out", str(out), "--category"])
  assert cli.main(["--target", str(need_shared("models", TINY)), "--drafter", "ngram",
                   "--prompts", str(prompts), "--out", str(tmp_path / "r2"), "--no-progress",
                   "--category", "zeta"]) == 2


def test_grammars_of_one_size_share_a_compiled_decode_and_differ_as_statics():
  """Two grammars with equal table sizes: generate() compiles once (the tables are arguments)
  and each decode follows its own grammar; as jit statics they differ (their fingerprints), so
  a user's jit that reads `params` as constants never mixes them up."""
  from spec_jax.decoding import compiled
  target, _ = _models()
  g1, g2 = grammar("(ab)+"), grammar("(dg)+")
  assert g1.shape_key() == g2.shape_key() and g1 != g2 and hash(g1) != hash(g2)
  clear_compiled()
  outs = [np.asarray(sj.generate(target, [PROMPT], max_new_tokens=6, sampling=sj.Sampling(0.0),
                                 stop_tokens=[], processors=(g,)).tokens)[0] for g in (g1, g2)]
  assert len(compiled._COMPILED) == 1
  assert set(outs[0]) <= {0, 1, END} and set(outs[1]) <= {3, 6, END}, outs
