"""Plan before you train: every layout and the per-device memory for any mesh, from shapes only.

- :mod:`theseus.plan.build`: :func:`plan`, one policy with every other side by side, its
  pre-flight verdict (the trainer's own check) and optionally the compiled step's memory;
- :mod:`theseus.plan.budget`: :func:`plan_for_budget`, the least communication that fits, and
  :func:`plan_training_for_budget`, also the recompute and per-device batch (``train --budget``);
- :mod:`theseus.plan.policies`: the policies a mesh allows and their communication order;
- :mod:`theseus.plan.results`: the result dataclasses (JSON through :func:`theseus.accounting.records.as_json`);
- :mod:`theseus.plan.render`: :func:`render`, the text ``theseus plan`` prints.

Per-parameter rows, the replicated share and the one-line plan of a run come from the trainer
(:mod:`theseus.training.summary`); memory arithmetic from :mod:`theseus.accounting.memory`.
"""

from theseus.accounting.memory import format_bytes, parse_bytes
from theseus.plan.budget import plan_for_budget, plan_training_for_budget
from theseus.plan.build import plan
from theseus.plan.policies import candidate_policies, communication
from theseus.plan.render import render
from theseus.plan.results import (
    BudgetChoice,
    ClosedForm,
    NoPolicyFits,
    Plan,
    PolicyOption,
    Verdict,
)
from theseus.training.summary import PlanRow, ReplicatedShare, one_line_plan

__all__ = [
    "BudgetChoice",
    "ClosedForm",
    "NoPolicyFits",
    "Plan",
    "PlanRow",
    "PolicyOption",
    "ReplicatedShare",
    "Verdict",
    "candidate_policies",
    "communication",
    "format_bytes",
    "one_line_plan",
    "parse_bytes",
    "plan",
    "plan_for_budget",
    "plan_training_for_budget",
    "render",
]
