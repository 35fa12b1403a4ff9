"""Training side of specdec: target-generated data, draft construction, distillation and publishing.

Shipped as `specdec.train` (pyproject.toml's package-dir maps this folder there). Kept free of imports so that
`python -m specdec.train.data` and `specdec data` load only what they use.
"""
