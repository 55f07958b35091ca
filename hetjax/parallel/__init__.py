"""parallel: how devices split a run (mesh axes, rules, layouts, strategies)."""
