"""Training side of specdec: target-generated data, draft construction, distillation and publishing.

Kept free of imports so that `python -m train.data` and `specdec data` load only what they use.
"""
