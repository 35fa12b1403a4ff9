"""Evaluation: baseline vs speculative benchmark, equivalence checks, the decision report, and `specdec verify`.

Shipped as `specdec.eval` (pyproject's package-dir maps this folder there): `from specdec.eval import runner`.
"""
