"""Planning tests: layouts, MoE, timing, fit, the planning CLI."""
