"""Evaluation: baseline vs speculative benchmark, equivalence checks, the decision report, and `specdec verify`.

Import submodules as `from eval import runner`; `import eval` would shadow the builtin.
"""
