"""A progress bar over the batches of an evaluation: tqdm when it is installed, log lines
otherwise (or with enabled=False)."""

from __future__ import annotations

from spec_jax.bench.results import log


class Progress:
  """total: batches to do. describe(text) shows what runs now (turn, category, drafter, batch);
  advance(reused) moves on by one batch. silent: show nothing at all (the processes other than
  process 0 of a multi-process run)."""

  def __init__(self, total: int = 0, enabled: bool = True, silent: bool = False):
    self.done, self.total, self._bar = 0, 0, None
    self._tqdm, self.silent = None, silent
    enabled = enabled and not silent
    if enabled:
      try:
        from tqdm.auto import tqdm
        self._tqdm = tqdm
      except ImportError:
        pass
    self.add_total(total)

  def add_total(self, n: int) -> None:
    """More batches to do (the next turn's, once its prompts are known)."""
    self.total += n
    if self._tqdm is not None and self._bar is None and self.total:
      self._bar = self._tqdm(total=self.total, unit="batch", dynamic_ncols=True, leave=True)
    elif self._bar is not None:
      self._bar.total = self.total
      self._bar.refresh()

  def describe(self, text: str) -> None:
    if self._bar is not None:
      self._bar.set_description_str(text, refresh=True)
    elif not self.silent:
      log(f"[eval] {self.done + 1}/{self.total} {text}")

  def advance(self, reused: bool = False) -> None:
    self.done += 1
    if self._bar is not None:
      self._bar.set_postfix_str("reused" if reused else "", refresh=False)
      self._bar.update(1)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
