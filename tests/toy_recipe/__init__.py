"""A toy recipe written as a plugin, outside framework/: a small CNN that learns to smooth a
random 2-D field. It proves a recipe needs nothing from the engine but the Task contract,
the registries and a config folder (tests/framework/test_plugins.py)."""
