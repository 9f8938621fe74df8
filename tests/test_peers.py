"""The peer suite's other engines on SmolLM2-135M-Instruct (../shared, the Q4_1 GGUF file):
llama.cpp through llama-cpp-python (the optional `peers` extra), transformers loading the same
GGUF file, chat-template prompts, and the suite's bookkeeping with llama.cpp rows.

No assertion looks at a measured timing. llama.cpp multiplies Q4_1 weights with activations
quantised to Q8_1 while transformers dequantises the weights to float32, so their greedy tokens
part at near-ties: with the chat template's default system prompt ("You are a helpful AI
assistant named SmolLM, ...") the France question's first token is one (top-2 gap 0.08 in
float32): transformers answers "The capital of France is Paris.", llama.cpp "L'Étoile, ...".
The agreement test therefore sends an empty system message, where the first 16 tokens of both
questions have no such tie (smallest gap 0.17) and the two engines agree token for token.
"""

import importlib.util
import types

import pytest

from spec_jax.bench import cli
from spec_jax.bench.suites import peer, peer_report

from .conftest import need_shared

GGUF = ("models", "smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf")
ASSISTANT_HEADER = [1, 520, 9531, 198]           # "<|im_start|>assistant\n"
QUESTIONS = ["What is the capital of France?", "Name three primary colors."]


def need_module(name):
  if importlib.util.find_spec(name) is None:
    pytest.skip(f"{name} is not installed (pip install -e '.[peers]'; docs/peers.md)")


@pytest.fixture(scope="module")
def gguf_path():
  need_module("gguf")
  return need_shared(*GGUF)


@pytest.fixture(scope="module")
def chat_ids(gguf_path):
  from spec_jax.bench.chat_prompts import hf_tokenizer
  tok = hf_tokenizer(str(gguf_path))
  out = []
  for q in QUESTIONS:
    ids = tok.apply_chat_template([{"role": "system", "content": ""},
                                   {"role": "user", "content": q}], add_generation_prompt=True,
                                  tokenize=True)
    out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
  return tok, out


def _job(side, gguf_path, prompts, configs, **extra):
  return dict({"side": side, "target": str(gguf_path), "gguf": str(gguf_path),
               "prompts": prompts, "batch": 1, "max_new": 8, "repeats": 1, "seed": 0,
               "threads": 1, "configs": configs}, **extra)


PLAIN = {"name": "plain", "mode": "plain", "draft": None, "k": 0}
LOOKUP2 = {"name": "prompt lookup 2", "mode": "ngram", "draft": None, "k": 2}


def test_llamacpp_greedy_equals_transformers_gguf_float32(gguf_path, chat_ids):
  """The llama.cpp worker side on the real GGUF (plain and prompt lookup, 2 prompts x 8 tokens)
  against transformers' float32 model dequantised from the same file."""
  need_module("llama_cpp")
  need_module("torch")
  need_module("accelerate")                     # transformers' GGUF loading needs it
  from spec_jax.bench import peer_worker
  from spec_jax.bench.peer_llamacpp import run_llamacpp
  tok, prompts = chat_ids
  assert all(p[-4:] == ASSISTANT_HEADER for p in prompts)
  ours = run_llamacpp(_job("llamacpp", gguf_path, prompts, [PLAIN, LOOKUP2]), peer_worker._rounds)
  hf = peer_worker.run_hf(_job("hf", gguf_path, prompts, [PLAIN, LOOKUP2], dtype="float32"))
  ll_plain = ours["configs"]["plain"]
  assert [len(t) for t in ll_plain["tokens"]] == [8, 8]            # exactly max_new, no EOS stop
  assert ll_plain["tau"] == 1.0 and len(ll_plain["tokens_per_s"]) == 1
  # Prompt lookup keeps plain decoding's tokens here (llama.cpp's verify over 1 + K tokens runs
  # other kernels than its one-token step, so at a near-tie it may part; not on these prompts).
  assert ours["configs"]["prompt lookup 2"]["tokens"] == ll_plain["tokens"]
  assert hf["configs"]["prompt lookup 2"]["tokens"] == hf["configs"]["plain"]["tokens"]
  assert ll_plain["tokens"] == hf["configs"]["plain"]["tokens"]
  assert tok.decode(ll_plain["tokens"][0]).startswith("The capital of France is Paris.")


def test_llamacpp_decodes_past_eos_and_recomputes_the_prompt(gguf_path, chat_ids):
  """generate() ignores EOS: 40 tokens after the France question run past its <|im_end|> (2);
  a second call gives the same tokens and evaluates its prompt again (no prefix reuse)."""
  need_module("llama_cpp")
  from spec_jax.bench.peer_llamacpp import greedy_tokens, load_llama
  _, prompts = chat_ids
  llm = load_llama(gguf_path, threads=1, n_ctx=128)
  tokens, evals = greedy_tokens(llm, prompts[0], 40)
  assert len(tokens) == 40 and 2 in tokens and evals == 40
  again, evals2 = greedy_tokens(llm, prompts[0], 40)
  assert again == tokens and evals2 == 40 and llm.n_tokens == len(prompts[0]) + 39
  with pytest.raises(ValueError, match="max_new"):
    greedy_tokens(llm, prompts[0], 0)


def test_gguf_info_counts_the_bytes_llamacpp_reads(gguf_path):
  from spec_jax.bench.peer_llamacpp import gguf_info
  info = gguf_info(gguf_path)
  # 210 Q4_1 projections, the tied embedding in Q8_0 (49152 x 576: 34 bytes per 32 values),
  # 61 float32 norms; the file is 98 MB with its metadata.
  assert info["type"] == "Q4_1"
  assert info["bytes_by_type"]["Q8_0"] == 49152 * 576 // 32 * 34
  assert info["bytes_by_type"]["F32"] == (30 * 2 + 1) * 576 * 4
  assert info["bytes"] == sum(info["bytes_by_type"].values())
  assert info["bytes"] < gguf_path.stat().st_size < info["bytes"] + 4_000_000


def test_chat_prompts_spread_over_spec_bench_categories(gguf_path):
  need_shared("data", "prompts", "spec_bench.jsonl")
  from spec_jax.bench.chat_prompts import chat_prompt_token_lists
  ids, texts, cats = chat_prompt_token_lists(str(gguf_path), "chat:spec_bench", 6, 2048)
  assert len(ids) == len(texts) == 6
  for row in ids:                     # ChatML: system prompt, the user turn, assistant header
    assert row[:2] == [1, 9690] and row[-4:] == ASSISTANT_HEADER and len(row) <= 2048
  assert len(set(cats)) == 6, cats                # 480 questions, 6 evenly spaced: 6 categories
  short, _, _ = chat_prompt_token_lists(str(gguf_path), "chat:spec_bench", 3, 60)
  assert all(len(r) <= 60 for r in short)         # too long: left out, never cut
  with pytest.raises(ValueError, match="no question fits"):
    chat_prompt_token_lists(str(gguf_path), "chat:spec_bench", 2, 10)
  with pytest.raises(ValueError, match="chat template"):
    chat_prompt_token_lists("random:tiny", "chat:spec_bench", 2, 100)


def test_peer_options_and_gguf_resolution(tmp_path):
  args = cli.parse_args(["--suite", "peer", "--peers", "hf", "llamacpp",
                         "--peer-lookup-tokens", "2", "4", "--llamacpp-threads", "1", "2"])
  assert args.peers == ["hf", "llamacpp"] and args.peer_lookup_tokens == [2, 4]
  assert args.llamacpp_threads == [1, 2]
  with pytest.raises(ValueError, match="peer-lookup-tokens"):
    cli.parse_args(["--suite", "peer", "--peer-lookup-tokens", "0"])
  with pytest.raises(SystemExit):
    cli.parse_args(["--suite", "peer", "--peers", "vllm"])
  g = tmp_path / "m.gguf"
  g.write_bytes(b"GGUF")
  assert peer.gguf_of(str(g), None) == str(g.resolve())
  assert peer.gguf_of(str(tmp_path), None) is None
  assert peer.gguf_of(str(tmp_path), str(g)) == str(g.resolve())
  with pytest.raises(ValueError, match="not a .gguf file"):
    peer.gguf_of(str(tmp_path), str(tmp_path / "missing.gguf"))


def test_peer_suite_refuses_llamacpp_without_a_gguf_and_chat_at_batch_8(capsys):
  rc = cli.main(["--suite", "peer", "--peers", "llamacpp", "--pairs", "random:tiny@ngram"])
  assert rc == 2 and "needs a GGUF file" in capsys.readouterr().err
  opts = types.SimpleNamespace(prompts="chat:spec_bench", peer_batch=[1, 8],
                               max_prompt_tokens=512)
  with pytest.raises(ValueError, match="peer-batch 1"):
    peer._prompt_ids(opts, None, "random:tiny", 8)
  from spec_jax.bench.prompts import prompt_token_lists
  with pytest.raises(ValueError, match="peer suite"):
    prompt_token_lists(None, "chat:spec_bench", 2, 8, 64, 0)


def _row(lib, mode, tps, threads=None, dtype="float32", config=None, tau=1.0):
  return {"target": "m", "batch": 1, "library": lib, "threads": threads, "dtype": dtype,
          "config": config or mode, "mode": mode, "K": 0 if mode == "plain" else 4,
          "tokens_per_s": {"median": tps, "min": tps * 0.9, "max": tps * 1.1}, "tau": tau,
          "reads_per_token_bytes": 96_576_768 if lib == "llama.cpp" else 269_000_000,
          "greedy_match": lib != "llama.cpp", "first_difference": None}


def test_peer_summary_and_table_with_llamacpp_rows():
  rows = [_row("spec_jax", "plain", 50.0, dtype="bfloat16"), _row("spec_jax", "plain", 40.0),
          _row("spec_jax", "ngram", 75.0, dtype="bfloat16", config="ngram K=4", tau=1.8),
          _row("llama.cpp", "plain", 100.0, threads=2, dtype="Q4_1"),
          _row("llama.cpp", "plain", 60.0, threads=1, dtype="Q4_1"),
          _row("llama.cpp", "ngram", 125.0, threads=2, dtype="Q4_1", config="prompt lookup 4")]
  s = peer_report.summarize_batch("m", 1, rows)
  assert s["ours_plain"] == 50.0 and s["ours_plain_dtype"] == "bfloat16"
  assert s["llamacpp_plain_best"] == 100.0 and s["llamacpp_plain_best_threads"] == 2
  assert s["ours_over_llamacpp_plain"] == pytest.approx(0.5)
  assert s["ours_over_llamacpp_ngram"] == pytest.approx(0.6)
  assert s["ours_ngram_best"]["speedup"] == pytest.approx(1.5)
  assert "hf_plain_best" not in s and all(r["vs_hf_plain"] is None for r in rows)
  assert [r["vs_llamacpp_plain"] for r in rows][3:] == pytest.approx([1.0, 0.6, 1.25])
  s.update(roofline_tokens_per_s=100.0, ours_plain_vs_roofline=0.5,
           llamacpp_roofline_tokens_per_s=250.0, llamacpp_plain_vs_roofline=0.4)
  text = peer_report.format_peer({"rows": rows, "summary": [s], "notes": ["n1"]})
  assert "vs llama.cpp plain 100.0 (2 threads, Q4_1; its best): 0.50x" in text
  assert "96.6" in text and "269.0" in text                       # MB read per token
  assert "NO" in text and "yes" in text
  assert "llama.cpp plain vs the roofline of its GGUF bytes: 100.0 / 250.0 tok/s = 40 %" in text
  assert "prompt lookup: ours ngram K=4 bfloat16 75.0 tok/s (1.50x" in text
  assert text.rstrip().endswith("note: n1")
  lines = text.splitlines()
  assert lines[2].split()[2] == "spec_jax" and lines[6].split()[2] == "llama.cpp"


@pytest.mark.parametrize("signal_exit, names", [(-11, "AMX off"), (-4, "illegal instruction")])
def test_a_crashed_llamacpp_worker_names_the_build_to_fix(monkeypatch, signal_exit, names):
  """A llama.cpp built for another CPU dies by a signal, not an exception: the error says which
  build flag to change (a build with GGML_AVX_VNNI on an AMD EPYC died with SIGILL)."""
  crashed = types.SimpleNamespace(returncode=signal_exit, stdout="", stderr="Fatal Python error")
  monkeypatch.setattr(peer.subprocess, "run", lambda *a, **kw: crashed)
  with pytest.raises(RuntimeError, match=names) as err:
    peer._run_worker({"side": "llamacpp"}, "/tmp/unused-cache")
  assert f"exit {signal_exit}" in str(err.value) and "docs/peers.md" in str(err.value)
  with pytest.raises(RuntimeError) as err:             # transformers: no llama.cpp hint
    peer._run_worker({"side": "hf"}, "/tmp/unused-cache")
  assert "docs/peers.md" not in str(err.value)
