"""The planning layer: parallelism per device, mixture of experts, GPUs, time, compare and fit.

Built on the single-device analytic core (``memplan.analytic``, ``memplan.estimate``) without changing it:
one tensor-parallel rank is a narrower model (``parallel.tp_model``), sequence parallelism and MoE
transform its inventory (``shard``, ``moe``), pipeline stages regroup it and ``analytic.peak`` runs per
stage (``device``). Pure Python, no torch.

API (each module's docstring gives the sources and the known limitations):

- ``parallel.Parallel(tp, sp, pp, vpp, ep)``; dp and ZeRO stay in ``StrategyConfig``.
- ``device.plan(setup, parallel=None, moe=None) -> Plan``: ``Plan.stages`` (first and last pipeline
  stage: params, states, activations, peak), ``Plan.device`` (the most loaded), ``Plan.flops`` (one
  micro-batch, whole model), ``Plan.to_json()`` (the estimate's JSON keys for that device, plus
  ``parallel``, ``stages``, ``moe``). At ``Parallel()`` it equals ``estimate(setup)``.
- ``moe.MoEConfig(experts, top_k, shared_experts, shared_ffn, shared_gate, capacity_factor)``,
  ``moe.param_counts(model, moe)`` (total, active).
- ``presets.load_plan_model(name_or_path) -> PlanModel`` (``.model``, ``.moe``): MoE presets
  (``plan/models/*.toml``: a dense preset plus ``published_active_params`` and a ``[moe]`` table),
  mixtral / qwen2_moe ``config.json``, or any dense preset.
- ``timing.timing(plan, gpu, mfu=… | step_time=…, tokens=…) -> Timing`` (step time, tokens/s, MFU, HFU,
  bubble, days); ``budget.verdict(plan, gpu) -> Verdict`` (fits, headroom, the overflowing term).
- ``options.build(PlanOptions) -> Built``: what ``memplan plan`` computes from its options.
- ``compare.rows(...)``, ``fit.fit(setup, moe, gpu, gpus, ...) -> FitResult``; ``render`` draws them.
"""
