"""The command-line layer: the `arpo` command (`arpo_cli.cli`) and `arpo run`'s local launcher
(`arpo_cli.launcher`).

It sits on top of the three other packages: it may import arpo_async, actors and learner, and none of them
imports it (tests/unit/test_import_arrows.py checks the arrows).
"""
