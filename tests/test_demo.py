"""`specdec demo`'s time budget (the demo itself runs end to end in CI: `make demo-quick`)."""

import pytest

from specdec.demo import DemoConfig, train_minutes


def test_training_gets_what_the_budget_leaves_after_the_evaluation():
    assert train_minutes(45.0, spent=20.0, eval_minutes=5.0, recipe_cap=None) == 20.0
    assert train_minutes(45.0, spent=20.0, eval_minutes=5.0, recipe_cap=12.0) == 12.0  # the recipe's own cap
    assert train_minutes(45.0, spent=44.0, eval_minutes=5.0, recipe_cap=None) == 1.0  # some training, always


def test_the_default_budget_follows_the_demo_kind():
    assert DemoConfig().budget_minutes() == 45.0 and DemoConfig(quick=True).budget_minutes() == 5.0
    assert DemoConfig(minutes=90).budget_minutes() == 90.0
    with pytest.raises(ValueError, match="data_share"):
        DemoConfig(data_share=0.0)
