"""Each built-in task's training recipe: what the run's "auto" flags become (``RunConfig`` resolves them).

A recipe is sized for this project's reference machine, two CPU cores: the default job (digits) ends in
seconds and ``--task charlm`` in a few minutes with 4 peers. A flag given explicitly always wins. A user's
own task (``package.module:function``) gets the digits recipe: SGD with momentum, constant lr.

When ``--optimizer`` names another optimizer than the recipe's, the lr and weight decay left at auto are
that optimizer's usual ones (``OPTIMIZER_DEFAULTS``), not the recipe's, which were tuned for its own.
Kept free of torch, like ``gossip.config``, so ``--help`` and flag errors stay instant.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Recipe:
    steps: int = 300
    batch_size: int = 32
    eval_every: int = 25
    optimizer: str = "sgd"
    lr: float = 0.05
    weight_decay: float = 0.0
    lr_schedule: str = "constant"
    warmup_fraction: float = 0.0  # of --steps
    min_lr_fraction: float = 0.0  # of --lr
    headline: str = "accuracy"  # the metric the summary leads with: "accuracy" (higher is better) or "loss"
    partitions: tuple[str, ...] = ("iid", "dirichlet")  # the --partition rules the task's data allows


# lr and weight decay of an optimizer chosen against the recipe (PyTorch's AdamW default weight decay)
OPTIMIZER_DEFAULTS = {"sgd": {"lr": 0.05, "weight_decay": 0.0}, "adamw": {"lr": 1e-3, "weight_decay": 0.01}}

DIGITS = Recipe()
# A GPT-style character model of 0.44 M parameters (gossip/tasks/charlm.py): AdamW with warm-up and cosine
# decay to a tenth, weight decay 0.1 on matrices (nanoGPT's settings), 1,000 steps of 16 x 64 characters.
CHARLM = Recipe(steps=1000, batch_size=16, eval_every=100, optimizer="adamw", lr=3e-3, weight_decay=0.1,
                lr_schedule="cosine", warmup_fraction=0.05, min_lr_fraction=0.1, headline="loss",
                partitions=("iid", "by-file"))
RECIPES = {"digits": DIGITS, "digits-wide": DIGITS, "mnist": DIGITS, "consensus": Recipe(partitions=("iid",)),
           "charlm": CHARLM}


def recipe(task: str) -> Recipe:
    """The recipe of a built-in task; a user's task gets the digits recipe, with every partition rule
    (its own code decides what a rule means for its data)."""
    return RECIPES.get(task, USER)


USER = Recipe(partitions=("iid", "dirichlet", "by-file"))
