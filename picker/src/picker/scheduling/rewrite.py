"""Model rewrite: which target model a request for `model` goes to (InferenceModelRewrite)."""
from __future__ import annotations

import random

from picker.discovery.objects import Rewrite, RewriteRule


def order_rewrites(rewrites: list[Rewrite]) -> list[Rewrite]:
    """Oldest resource first (then name), the upstream precedence."""
    return sorted(rewrites, key=lambda r: (r.created, r.name))


def find_rule(rewrites: list[Rewrite], model: str) -> RewriteRule | None:
    """First exact match in precedence order; else the first rule with no matches."""
    catch_all = None
    for rw in rewrites:
        for rule in rw.rules:
            if not rule.models:
                catch_all = catch_all or rule
            elif model in rule.models:
                return rule
    return catch_all


def choose_target(rule: RewriteRule | None, model: str, rng: random.Random) -> str:
    if rule is None:
        return model
    targets = rule.targets
    if len(targets) == 1:
        return targets[0][0]
    return rng.choices([t for t, _ in targets], weights=[w for _, w in targets], k=1)[0]
