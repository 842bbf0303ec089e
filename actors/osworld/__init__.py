"""OSWorld task support on our desktops: setup steps, getters, the download cache and OSWorld's own metrics.

Modules: :mod:`.setup` (setup step types), :mod:`.getters` (result/expected getters), :mod:`.downloads`
(content-addressed download cache), :mod:`.chrome` (Chromium over its DevTools HTTP endpoint, run inside the
desktop), :mod:`.native_metrics` (the few metrics we implement ourselves), :mod:`.metric_env` (the separate
virtualenv holding OSWorld's published package) and :mod:`.metric_worker` / :mod:`.metrics` (OSWorld's metric
functions run unchanged in that environment). actors.evaluation ties them together.
"""
