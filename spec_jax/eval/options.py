"""The options of an evaluation, checked before anything is loaded or run."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from typing import Optional, Union

from spec_jax.bench.prompts import PROMPT_SETS, source_path
from spec_jax.bench.specs import check_drafter_spec
from spec_jax.models.chat import check_template_kwargs
from spec_jax.sharding import parse_mesh_spec
from spec_jax.tree import parse_tree_spec
import spec_jax as sj


def auto_supported() -> bool:
  """Whether this spec_jax has the governor behind generate(num_draft="auto") (issue 9)."""
  return importlib.util.find_spec("spec_jax.governor") is not None


def parse_num_draft(value) -> Union[int, str]:
  """'auto' or an integer K >= 1 (ValueError otherwise)."""
  if isinstance(value, str) and value.strip().lower() == "auto":
    return "auto"
  try:
    k = int(value)
  except (TypeError, ValueError):
    k = None
  if k is None or isinstance(value, bool) or k < 1 or str(value).strip() != str(k):
    raise ValueError(f"--num-draft must be an integer K >= 1 or 'auto', got {value!r}")
  return k


@dataclasses.dataclass(frozen=True)
class EvalOptions:
  """target: a model spec (HF folder, llama2.c folder or .bin); drafters: drafter specs
  (ngram, ngram:MAX[:MIN], draft:MODEL, heads:PATH), plain decoding always runs beside them;
  prompts: spec_bench | mt_bench | humaneval | gsm8k | a .jsonl / .jsonl.gz / .txt path;
  batch: batch sizes; num_draft: K or 'auto'; out: the run directory. limit_per_category: the
  first N questions of every category (None = all); strict: prompts that do not fit the
  context are an error instead of being skipped (turn t > 1 prompts are known only once turn
  t - 1 has run; what ran is kept in DIR); repeats: timed rounds per batch;
  dtype: the target's weights (and a draft model's): None = as stored, 'float32' or
  'bfloat16'; plain_dtypes: plain decoding in these other dtypes runs beside it in every unit,
  and every speedup is also reported against the fastest plain decoding of any dtype;
  mesh: None or 'data=N,model=M' (spec_jax.sharding.parse_mesh): every generate() call on that
  mesh; needed when several processes run the evaluation (spec_jax.launch, a pod), and then
  every batch size must divide over N; sampling: the other sj.Sampling options as (name,
  value) pairs (min_p, penalties, logit_bias as (id, bias) pairs; `sampling_of`) and the
  grammar constraint as ("constraint", ("regex" | "json_schema", source)); categories: run only
  these prompt categories (() = all), e.g. one category under a JSON schema; trees: tree
  shapes 'D,k,N[,CANDIDATES]' (sj.TreeSpec(depth, top_k, num_nodes[, candidates])), each run
  beside the chain of every drafter that builds trees; chat_template_kwargs: the chat
  template's options for every prompt (e.g. {"enable_thinking": False} for Qwen3; None = the
  template's defaults), a JSON-serialisable dict of template variables; a target without a
  chat template refuses them."""
  target: str
  drafters: tuple
  out: str
  prompts: str = "spec_bench"
  batch: tuple = (1,)
  num_draft: Union[int, str] = 4
  temperature: float = 0.0
  max_new_tokens: int = 256
  limit_per_category: Optional[int] = None
  strict: bool = False
  repeats: int = 1
  seed: int = 0
  progress: bool = True
  mesh: Optional[str] = None
  dtype: Optional[str] = None
  plain_dtypes: tuple = ()
  sampling: tuple = ()
  categories: tuple = ()
  trees: tuple = ()
  chat_template_kwargs: Optional[dict] = None

  def sampling_of(self):
    """The sj.Sampling of every generate() call (ValueError naming a bad option)."""
    options = dict(self.sampling)
    options.pop("constraint", None)
    return sj.Sampling(temperature=self.temperature, **options)

  def validate(self) -> "EvalOptions":
    """The options with batch sorted and num_draft parsed; ValueError saying what is wrong
    and what is allowed."""
    if not self.target:
      raise ValueError("--target is required: a Hugging Face folder or a llama2.c .bin")
    drafters = tuple(self.drafters or ())
    if not drafters:
      raise ValueError("give at least one --drafter (ngram, ngram:MAX[:MIN], draft:MODEL or "
                       "heads:PATH); plain decoding always runs beside them")
    for d in drafters:
      if d in ("", "none"):
        raise ValueError("--drafter none is not needed: plain decoding always runs")
      check_drafter_spec(d)
    if len(set(drafters)) != len(drafters):
      raise ValueError(f"a --drafter is given twice: {list(drafters)}")
    batch = tuple(sorted(set(int(b) for b in self.batch)))
    if not batch or batch[0] < 1:
      raise ValueError(f"--batch sizes must be integers >= 1, got {list(self.batch)}")
    num_draft = parse_num_draft(self.num_draft)
    if num_draft == "auto" and not auto_supported():
      raise ValueError("--num-draft auto needs the governor (issue 9), which is not available "
                       "yet in this spec_jax; give an integer K >= 1")
    if self.temperature < 0:
      raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
    if self.max_new_tokens < 1:
      raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
    self.sampling_of()
    sj.constraints.from_pair(dict(self.sampling).get("constraint"))   # ValueError if bad
    if self.limit_per_category is not None and self.limit_per_category < 1:
      raise ValueError(f"--limit-per-category must be >= 1, got {self.limit_per_category}")
    if self.repeats < 1:
      raise ValueError(f"--repeats must be >= 1, got {self.repeats}")
    if not self.out:
      raise ValueError("--out DIR is required")
    if self.mesh is not None:
      data = parse_mesh_spec(self.mesh)["data"]
      bad = [b for b in batch if b % data]
      if bad:
        raise ValueError(f"--batch {' '.join(map(str, bad))} does not divide over --mesh "
                         f"{self.mesh}'s data axis of {data}: give batch sizes that are "
                         f"multiples of {data}")
    # ValueError: how a tree is written; equal trees written differently count once.
    trees = tuple(dict.fromkeys(tree_text(parse_tree_spec(t)) for t in self.trees or ()))
    source_path(self.prompts)             # ValueError naming PROMPT_SETS when missing
    template_kwargs = self.chat_template_kwargs
    if template_kwargs is not None:
      template_kwargs = check_template_kwargs(template_kwargs)
      try:
        json.dumps(template_kwargs)           # stored in DIR's manifest and results.json
      except (TypeError, ValueError) as e:
        raise ValueError(f"chat_template_kwargs must be JSON-serialisable (they are stored "
                         f"with the run), got {template_kwargs!r}: {e}") from e
    if self.dtype not in DTYPES:
      raise ValueError(f"--dtype must be one of float32, bfloat16 (or omitted: as stored), got "
                       f"{self.dtype!r}")
    plain_dtypes = tuple(dict.fromkeys(self.plain_dtypes or ()))
    bad = [d for d in plain_dtypes if d not in DTYPES[1:]]
    if bad:
      raise ValueError(f"--plain-dtypes takes float32 and/or bfloat16, got {bad}")
    if self.dtype is not None and self.dtype in plain_dtypes:
      raise ValueError(f"--plain-dtypes {self.dtype} is the target's own dtype (--dtype): its "
                       f"plain decoding always runs")
    return dataclasses.replace(self, drafters=drafters, batch=batch, num_draft=num_draft,
                               plain_dtypes=plain_dtypes, trees=trees,
                               chat_template_kwargs=template_kwargs)


def tree_text(tree) -> str:
  """A TreeSpec as the eval writes it: 'D,k,N', plus ',CANDIDATES' unless 'auto'."""
  return f"{tree.depth},{tree.top_k},{tree.num_nodes}" + (
      "" if tree.candidates == "auto" else f",{tree.candidates}")


PROMPT_CHOICES = " | ".join(PROMPT_SETS)
DTYPES = (None, "float32", "bfloat16")
