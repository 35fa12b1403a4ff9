"""The shipped recipes (this folder's YAML files, and accelerate's launch configs in accelerate/), installed as
package data of `specdec.recipes` (pyproject.toml's package-dir). This file only makes the folder a package:
setuptools' editable install finds a mapped folder through its __init__.py, so `importlib.resources` reads the
recipes the same way from a checkout and from an installed wheel (specdec/config.py, `shipped_recipes`)."""
