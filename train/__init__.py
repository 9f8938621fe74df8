"""Distillation of draft heads onto a frozen target: python -m train.distill_heads."""
