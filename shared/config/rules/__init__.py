"""Cross-key rules: forbidden combinations, node-role checks and resolved values.

Each module holds small rule functions for one area and lists them in ``RULES``;
``run_rules`` runs them all and collects what they found.
"""

from __future__ import annotations

from pdmesh.shared.config.rules import eplb, features, parallel, scheduler, switches
from pdmesh.shared.config.rules.base import Findings, Rule, RuleContext

ALL_RULES: tuple[Rule, ...] = (*scheduler.RULES, *eplb.RULES, *parallel.RULES, *features.RULES,
                               *switches.RULES)


def run_rules(ctx: RuleContext) -> Findings:
    """Every rule's errors, warnings and overrides for one parsed config."""
    findings = Findings()
    for rule in ALL_RULES:
        rule(ctx, findings)
    return findings


__all__ = ["ALL_RULES", "Findings", "Rule", "RuleContext", "run_rules"]
