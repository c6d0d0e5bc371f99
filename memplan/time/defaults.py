"""Defaults the planning commands show in their help (a module light enough to import eagerly)."""

DEFAULT_MFU = 0.4
"""Assumed model FLOPs utilisation: 40 % is what well-tuned large dense training reaches on A100/H100
(Korthikanti et al. 2022 Table 5: 41.5–56.3 %; Llama 3 405B on H100: 38–43 %)."""
